"""Options shared by the sub-commands, and the checks that run before any model is loaded.

Data, head and training options are generated from the config dataclasses (`DataConfig`, `HeadConfig`,
`ATSConfig`, `TrainingConfig`), so `--help`, the defaults and the validation come from one place. Every check here
runs before the backbone loads; a failed check writes nothing.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from ..checks import check_nonempty
from ..config import OptionType
from ..errors import ATSError
from ..model.embedded import DEFAULT_MODEL, EMBEDDED_MODELS

if TYPE_CHECKING:
    from ..model.backbone import Backbone
    from ..training.config import TrainingConfig
    from ..training.data import DataConfig

# The configs and name tables the options come from are torch-free; the library (and with it torch and
# transformers) is imported inside the functions that use it, so building the parser imports neither.


def add_model(p: argparse.ArgumentParser, *, loading: bool = True) -> None:
    """Add the model options to parser `p`: --model, and with `loading` (a command that loads it) --dtype, --device,
    --trust-remote-code."""
    g = p.add_argument_group("model")
    g.add_argument("--model", default=DEFAULT_MODEL,
                   help=f"embedded name ({', '.join(EMBEDDED_MODELS)}), .gguf file, model folder or Hub id")
    if not loading:
        return
    g.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    g.add_argument("--device", default=None, help="cpu, cuda, cuda:1, ... (default: cuda if available)")
    g.add_argument("--trust-remote-code", action="store_true", help="allow custom model code from the Hub")


def add_data(p: argparse.ArgumentParser, *, defaults: dict | None = None,
             shown: dict[str, str] | None = None) -> None:
    """Add `DataConfig`'s options and --features to parser `p`; `defaults` overrides fields' defaults, `shown` what
    --help states as defaults the command resolves after parsing."""
    from ..training.data import DataConfig

    g = p.add_argument_group("instruction data (features)")
    DataConfig.add_arguments(g, defaults=defaults, shown=shown)
    g.add_argument("--features", default=None, help="feature cache folder (default: OUT/features)")


def add_training(p: argparse.ArgumentParser, *, exclude=(), head_defaults: dict | None = None,
                 shown: dict[str, str] | None = None) -> None:
    """Add the head, ATS and training options to parser `p`; `exclude`: `TrainingConfig` fields left out;
    `head_defaults`: `HeadConfig` defaults replaced; `shown`: {field: the default --help states}, for head or
    training options the command resolves after parsing (`ConfigMixin.add_arguments`'s `shown`)."""
    from ..calibrators.ats_config import ATSConfig
    from ..model.heads import HeadConfig
    from ..training.config import TrainingConfig

    g = p.add_argument_group("head and training")
    HeadConfig.add_arguments(g, defaults=head_defaults, shown=shown)
    ATSConfig.add_arguments(g)
    TrainingConfig.add_arguments(g, exclude=exclude, shown=shown)


def add_number(p, flag: str, kind: type, check: Callable[[str, int | float], int | float], **kwargs) -> None:
    """Add the number option `flag` to parser (or group) `p`, converted by `kind` and validated by `check(flag,
    value)` (a validator of `ats.checks`) as argparse parses it, so a bad value fails at once (`OptionType`);
    `kwargs` go to `add_argument`."""
    p.add_argument(flag, type=OptionType(flag, kind, check), **kwargs)


def nonempty(flag: str) -> OptionType:
    """argparse's `type=` for a text option `flag` that must not be empty (`--out ''` would write into the working
    folder, `--calibrator ''` read it as a calibrator)."""
    return OptionType(flag, str, check_nonempty)


def _check_out_folder(flag: str, value: str) -> str:
    """`value`, an output folder to be: not empty, not a file, under a folder (not under a file)."""
    check_nonempty(flag, value)
    path = Path(value).expanduser().absolute()
    if path.exists() and not path.is_dir():
        raise ATSError(f"{flag} {value}: a file, not a folder")
    above = next(p for p in path.parents if p.exists())
    if not above.is_dir():
        raise ATSError(f"{flag} {value}: {above} is a file, not a folder")
    return value


def out_folder(flag: str) -> OptionType:
    """argparse's `type=` for an output folder option `flag` (`_check_out_folder`): checked as it is parsed, so that
    nothing runs towards an output that cannot be written."""
    return OptionType(flag, str, _check_out_folder)


def add_overwrite(p: argparse.ArgumentParser) -> None:
    """Add --overwrite to parser `p`."""
    p.add_argument("--overwrite", action="store_true",
                   help="replace results in OUT that were made with other options (default: refuse them)")


def device(name: str | None) -> str:
    """The --device `name`, checked against this machine before anything loads (`locate.device_problem`); None:
    "cuda" when available, else "cpu".

    Raises:
        ATSError: `name` is no device torch knows, or a CUDA / MPS device this machine does not have (one line).
    """
    from ..model.locate import default_device, device_problem

    if name is None:
        return default_device()
    why = device_problem(name)
    if why is not None:
        raise ATSError(f"--device {name}: {why}")
    return name


def check_model(name: str, option: str = "--model ") -> None:
    """Refuse a --model `name` that can be neither a local model nor a Hub id, before anything loads
    (`locate.model_name_problem`).

    Args:
        name: the model name.
        option: what the message calls the value, before the name (e.g. "pretrained=").

    Raises:
        ATSError: if `name` is a missing path, a folder without config.json, or not shaped like a Hub id.
    """
    from ..model.locate import model_name_problem

    why = model_name_problem(name)
    if why is not None:
        raise ATSError(f"{option}{name}: {why}")


def backbone_from_args(args) -> Backbone:
    """The backbone named by the model options in `args` (see `add_model`)."""
    from ..model.backbone import load_backbone

    return load_backbone(args.model, dtype=getattr(args, "dtype", "float32"), device=device(getattr(args, "device",
                                                                                                     None)),
                         trust_remote_code=getattr(args, "trust_remote_code", False))


def data_config(args) -> DataConfig:
    """The data options in `args`, checked (the data itself is read once here, so a bad file fails before the model
    loads); `ATSError` if they or the data are invalid."""
    from ..training.data import DataConfig, load_instructions

    config = DataConfig.from_args(args, seed=getattr(args, "seed", 0))
    load_instructions(config.source, limit=config.limit, seed=config.seed)
    return config


def training_config(args, **overrides) -> TrainingConfig:
    """The `TrainingConfig` from the options in `args`, with `overrides` (field -> value) on top."""
    from ..training.config import TrainingConfig

    return TrainingConfig.from_args(args, **overrides)


def split_names(values: list[str] | None, default: str, *, option: str) -> list[str]:
    """Repeatable and comma-separated option `values` (None: `default`), split and stripped, in order.

    Raises:
        ATSError: naming `option`, when no name is left (`--tasks ''`, `--tasks ,`).
    """
    names = [v.strip() for item in (values or [default]) for v in item.split(",") if v.strip()]
    if not names:
        raise ATSError(f"{option} {','.join(values or [default])!r}: no names given")
    return names


def calibrator_folder(name: str | Path) -> Path:
    """The folder of --calibrator `name` (a local folder, or a Hub repo id read from the cache or downloaded), its
    config checked: an `ats` calibrator_config.json or the paper's config.json (docs/official_heads.md).

    Raises:
        ATSError: if the folder, its config or the Hub id is missing or invalid (one line).
    """
    from ..calibrators.saving import OFFICIAL_LAYOUT, saved_type
    from ..hub import resolve_folder

    if str(name).strip().lower() == "none":
        raise ATSError(f"--calibrator {name}: this command needs a saved calibrator folder (ats train makes one)")
    folder = resolve_folder(name)
    if saved_type(folder) == OFFICIAL_LAYOUT:
        from ..calibrators.official import read_official_config

        read_official_config(folder)
    return folder


def calibrator_folders(names: list[str]) -> dict[str, Path | None]:
    """Each of `names` as a checked calibrator folder (see `calibrator_folder`), or None for a registered name to
    fit: a local folder first, then a registered name, then a Hub repo id.

    Raises:
        ATSError: if a name is none of these, or its folder is invalid.
    """
    from ..calibrators import REGISTRY
    from ..hub import is_repo_id

    folders: dict[str, Path | None] = {}
    for name in names:
        if Path(name).is_dir() or (name not in REGISTRY and is_repo_id(name)):
            folders[name] = calibrator_folder(name)
        elif name in REGISTRY:
            folders[name] = None
        else:
            raise ATSError(f"--calibrator {name!r}: not a folder, a known calibrator ({', '.join(REGISTRY)}) or a "
                           f"Hub id (owner/name)")
    return folders


def load_calibrator_folder(name: str | Path, backbone: Backbone):
    """The calibrator saved in folder `name` (or Hub id), checked against `backbone` and moved to its device."""
    from ..calibrators import load_calibrator

    return load_calibrator(name, backbone=backbone).to(backbone.device)
