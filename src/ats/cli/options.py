"""Options shared by the sub-commands, and the checks that run before any model is loaded.

Data, head and training options are generated from the config dataclasses (`DataConfig`, `HeadConfig`,
`ATSConfig`, `TrainingConfig`), so `--help`, the defaults and the validation come from one place. Every check here
runs before the backbone loads; a failed check writes nothing.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from ..calibrators import REGISTRY, load_calibrator
from ..calibrators.ats import ATSConfig
from ..calibrators.base import read_config
from ..errors import ATSError
from ..model.backbone import EMBEDDED_MODELS, Backbone, load_backbone
from ..model.heads import HeadConfig
from ..training.config import TrainingConfig
from ..training.data import DataConfig, load_instructions


def add_model(p: argparse.ArgumentParser) -> None:
    """Add the model options (--model, --dtype, --device, --trust-remote-code) to parser `p`."""
    g = p.add_argument_group("model")
    g.add_argument("--model", default="smollm2-135m-instruct",
                   help="embedded name (smollm2-135m-instruct, gemma3-270m), .gguf file, model folder or Hub id")
    g.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    g.add_argument("--device", default=None, help="cpu, cuda, cuda:1, ... (default: cuda if available)")
    g.add_argument("--trust-remote-code", action="store_true", help="allow custom model code from the Hub")


def add_data(p: argparse.ArgumentParser) -> None:
    """Add `DataConfig`'s options and --features to parser `p`."""
    g = p.add_argument_group("instruction data (features)")
    DataConfig.add_arguments(g)
    g.add_argument("--features", default=None, help="feature cache folder (default: OUT/features)")


def add_training(p: argparse.ArgumentParser, *, exclude=()) -> None:
    """Add the head, ATS and training options to parser `p`; `exclude`: `TrainingConfig` fields left out."""
    g = p.add_argument_group("head and training")
    HeadConfig.add_arguments(g)
    ATSConfig.add_arguments(g)
    TrainingConfig.add_arguments(g, exclude=exclude)


def add_overwrite(p: argparse.ArgumentParser) -> None:
    """Add --overwrite to parser `p`."""
    p.add_argument("--overwrite", action="store_true",
                   help="replace results in OUT that were made with other options (default: refuse them)")


def device(name: str | None) -> str:
    """The device `name`, or None: "cuda" when available, else "cpu"."""
    return name or ("cuda" if torch.cuda.is_available() else "cpu")


def check_model(name: str) -> None:
    """Refuse a --model `name` that can be neither a local model nor a Hub id, before anything loads.

    Raises:
        ATSError: if `name` is a missing path, a folder without config.json, or not shaped like a Hub id.
    """
    path = Path(name).expanduser()
    local = name.startswith((".", "/", "~")) or path.suffix == ".gguf" or path.exists()
    if name in EMBEDDED_MODELS:
        return
    if local:
        if not path.exists():
            raise ATSError(f"--model {name}: no such file or folder (and not an embedded model: "
                           f"{', '.join(EMBEDDED_MODELS)})")
        if path.is_dir() and not (path / "config.json").is_file():
            raise ATSError(f"--model {name}: not a model folder (no config.json)")
        return
    if name.count("/") > 1 or not name.strip():
        raise ATSError(f"--model {name!r}: not an embedded model ({', '.join(EMBEDDED_MODELS)}), a local path or "
                       f"a Hub id (owner/name)")


def backbone_from_args(args) -> Backbone:
    """The backbone named by the model options in `args` (see `add_model`)."""
    return load_backbone(args.model, dtype=getattr(args, "dtype", "float32"), device=device(getattr(args, "device",
                                                                                                     None)),
                         trust_remote_code=getattr(args, "trust_remote_code", False))


def data_config(args) -> DataConfig:
    """The data options in `args`, checked (the data itself is read once here, so a bad file fails before the model
    loads); `ATSError` if they or the data are invalid."""
    config = DataConfig.from_args(args, seed=getattr(args, "seed", 0))
    load_instructions(config.source, limit=config.limit, seed=config.seed)
    return config


def training_config(args, **overrides) -> TrainingConfig:
    """The `TrainingConfig` from the options in `args`, with `overrides` (field -> value) on top."""
    return TrainingConfig.from_args(args, **overrides)


def split_names(values: list[str] | None, default: str) -> list[str]:
    """Repeatable and comma-separated option `values` (None: `default`), split and stripped, in order."""
    return [v.strip() for item in (values or [default]) for v in item.split(",") if v.strip()]


def check_calibrators(names: list[str]) -> None:
    """Check that each of `names` is a calibrator folder (its config readable) or a registered name; `ATSError` if
    not."""
    for name in names:
        if Path(name).is_dir():
            read_config(Path(name))
        elif name not in REGISTRY:
            raise ATSError(f"--calibrator {name!r}: not a folder and not a known calibrator "
                           f"({', '.join(REGISTRY)})")


def load_calibrator_folder(name: str, backbone: Backbone):
    """The calibrator saved in folder `name`, checked against `backbone` and moved to its device."""
    return load_calibrator(name, backbone=backbone).to(backbone.device)
