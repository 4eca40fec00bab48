"""A calibrator folder: `calibrator_config.json` (the "type", the options and the fitted scalars) beside
`model.safetensors` (the fitted tensors), written atomically and read back without pickle; its Hub model card.

    folder/calibrator_config.json   {"type": "temperature", "max_passes": 20, "tol": 0.0001, "temperature": 1.7}
    folder/model.safetensors        only when the calibrator has tensors (bins, vectors, a network's weights)

`SavedCalibrator` is the mixin every calibrator inherits: `save_pretrained` writes what `config()` and
`state_tensors()` give, `from_pretrained` checks the "type" and hands the rest to the class's `from_saved`.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar

from ..config import ConfigMixin
from ..errors import ATSError
from ..hub import resolve_folder
from ..io import atomic_dir, read_json

if TYPE_CHECKING:
    from torch import Tensor, nn

CONFIG_NAME = "calibrator_config.json"
WEIGHTS_NAME = "model.safetensors"


def read_config(directory: Path) -> dict:
    """A calibrator folder's config; a folder without one gets a hint at where heads are saved.

    Args:
        directory: the calibrator's folder.

    Returns:
        The parsed calibrator_config.json, "type" included.

    Raises:
        ATSError: if the file is missing (a run folder is named as such) or is not a JSON object.
    """
    path = directory / CONFIG_NAME
    if directory.is_dir() and not path.exists() and (directory / "head" / CONFIG_NAME).exists():
        raise ATSError(f"{directory}: a run folder, not a calibrator; the head is in {directory / 'head'}")
    config = read_json(path)
    if not isinstance(config, dict):
        raise ATSError(f"{path}: expected a JSON object, got {type(config).__name__}")
    return config


def read_tensors(directory: Path) -> dict[str, Tensor]:
    """The tensors of `model.safetensors`, with one-line errors for a missing or corrupt file.

    Args:
        directory: the calibrator's folder.

    Returns:
        {name: tensor}, on the CPU.

    Raises:
        ATSError: if the file is missing, corrupt or truncated.
    """
    from safetensors.torch import load_file

    path = directory / WEIGHTS_NAME
    try:
        return load_file(str(path))
    except FileNotFoundError:
        raise ATSError(f"{path}: file not found") from None
    except Exception as err:  # safetensors raises its own error types for corrupt files
        raise ATSError(f"{path}: corrupt or truncated safetensors file ({err})") from None


def load_module(module: nn.Module, tensors: dict[str, Tensor]) -> None:
    """Load saved weights into `module` (strict) and put it in eval mode.

    Raises:
        ATSError: if the file held no tensors, or they do not match the module built from the config.
    """
    if not tensors:
        raise ATSError(f"{WEIGHTS_NAME}: file not found")
    try:
        module.load_state_dict(tensors, strict=True)
    except RuntimeError as err:
        raise ATSError(f"{WEIGHTS_NAME}: weights do not match the config ({str(err).splitlines()[0]})") from None
    module.eval()


class SavedCalibrator:
    """What a calibrator saves (`config()`: its `config_` options and its `fitted_keys`; `state_tensors()`) and how
    it is rebuilt (`from_saved`: the options through `Config`, the rest through `restore`); save_pretrained /
    from_pretrained. Mixed into `Calibrator`, which provides `config_`, `check_fitted` and `check_backbone`."""

    name: ClassVar[str]
    Config: ClassVar[type[ConfigMixin]]
    fitted_keys: ClassVar[tuple[str, ...]] = ()  # attributes saved in the config beside the options (fitted scalars)
    # safetensors metadata of the weights file; ATS heads write {"format": "pt"} (one key: safetensors writes its
    # metadata map in a per-process random order, so two keys would give the same weights different file bytes)
    weights_metadata: ClassVar[dict | None] = None

    def config(self) -> dict:
        """The options and the fitted scalars (`fitted_keys`), JSON-serialisable; tensors go to `state_tensors`.

        Returns:
            {option or fitted key: value}, written to calibrator_config.json beside "type".

        Raises:
            ATSError: if not fitted.
        """
        self.check_fitted()
        return {**self.config_.to_dict(), **{key: getattr(self, key) for key in self.fitted_keys}}

    def state_tensors(self) -> dict[str, Tensor]:
        """The fitted tensors, saved to model.safetensors (none by default).

        Returns:
            {name: tensor}.
        """
        return {}

    @classmethod
    def from_config(cls, config: ConfigMixin) -> "SavedCalibrator":
        """An unfitted calibrator with the options `config` (the loading path; ATS takes its config whole)."""
        return cls(**{f.name: getattr(config, f.name) for f in dataclasses.fields(config)})

    @classmethod
    def from_saved(cls, saved: dict, tensors: dict[str, Tensor], where: str = "calibrator config") -> "SavedCalibrator":
        """Rebuild from what `config()` and `state_tensors()` wrote: the options through `Config`, the rest through
        `restore`.

        Args:
            saved: the saved calibrator_config.json without its "type".
            tensors: the saved tensors ({} when there is no model.safetensors).
            where: the config's file, quoted in errors.

        Returns:
            The calibrator, fitted as it was saved.

        Raises:
            ATSError: if an option is missing, unknown or invalid, or a fitted value or tensor is.
        """
        options = {k: v for k, v in saved.items() if k not in cls.fitted_keys}
        for f in dataclasses.fields(cls.Config):
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING and f.name not in options:
                raise ATSError(f"{where}: missing field {f.name!r}")
        calibrator = cls.from_config(cls.Config.from_dict(options, where))
        calibrator.restore({k: saved[k] for k in cls.fitted_keys if k in saved}, tensors)
        return calibrator

    def restore(self, fitted: dict, tensors: dict[str, Tensor]) -> None:
        """Set the fitted state from the saved `fitted_keys` values and tensors (nothing by default).

        Raises:
            ATSError: in subclasses, if a value or tensor is missing or invalid.
        """

    def save_pretrained(self, directory: str | Path) -> None:
        """Write `calibrator_config.json` (with "type") and, if there are tensors, `model.safetensors`, atomically.

        Args:
            directory: the folder to write; an existing one is replaced.

        Raises:
            ATSError: if the calibrator is not fitted.
        """
        from safetensors.torch import save_file

        with atomic_dir(directory) as tmp:
            (tmp / CONFIG_NAME).write_text(json.dumps({"type": self.name, **self.config()}, indent=2, sort_keys=True))
            tensors = {k: v.detach().contiguous().cpu() for k, v in self.state_tensors().items()}
            if tensors:
                save_file(tensors, str(tmp / WEIGHTS_NAME), metadata=self.weights_metadata)

    @classmethod
    def from_pretrained(cls, directory: str | Path, backbone=None):
        """Load a saved calibrator of this type; with `backbone`, check that it matches.

        Args:
            directory: the calibrator's folder, or a Hub repo id (owner/name) when no such folder exists.
            backbone: the `Backbone` it will be applied to, or None to skip the check.

        Returns:
            The loaded calibrator (a network in eval mode).

        Raises:
            ATSError: naming the folder: if the config or weights are missing or invalid, the saved "type" is not
                this class's, or the backbone does not match.
        """
        directory = resolve_folder(directory)
        saved = read_config(directory)
        if saved.get("type") != cls.name:
            raise ATSError(f"{directory / CONFIG_NAME}: field 'type' is {saved.get('type')!r}, expected {cls.name!r}")
        tensors = read_tensors(directory) if (directory / WEIGHTS_NAME).exists() else {}
        try:
            calibrator = cls.from_saved({k: v for k, v in saved.items() if k != "type"}, tensors,
                                        where=str(directory / CONFIG_NAME))
        except ATSError as err:  # errors of the tensors name the file; name the folder too
            if str(directory) in str(err):
                raise
            raise ATSError(f"{directory}: {err}") from None
        if backbone is not None:
            calibrator.check_backbone(backbone)
        return calibrator
