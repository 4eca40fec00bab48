"""A calibrator folder on disk: `calibrator_config.json` (the "type", the options and the fitted scalars) beside
`model.safetensors` (the fitted tensors), written atomically and read back without pickle; and the one rule that tells
a folder of ours from one in the layout of the paper's code. Torch-free at import (the CLI checks folders with it
before any model loads).

    folder/calibrator_config.json   {"type": "temperature", "max_passes": 20, "tol": 0.0001, "temperature": 1.7}
    folder/model.safetensors        only when the calibrator has tensors (bins, vectors, a network's weights)

    folder/config.json              the paper's layout: "calibration_type" and the head's sizes (docs/official_heads.md)
    folder/calibration_head.safetensors
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import ATSError
from ..io import atomic_dir, read_json

if TYPE_CHECKING:
    from torch import Tensor, nn

CONFIG_NAME = "calibrator_config.json"
WEIGHTS_NAME = "model.safetensors"
OFFICIAL_CONFIG = "config.json"  # the paper's layout
OFFICIAL_LAYOUT = "official layout"  # `saved_type` of a folder in the paper's layout


def saved_type(directory: Path) -> str:
    """What `directory` holds: the "type" of its calibrator_config.json, or `OFFICIAL_LAYOUT` for a folder in the
    layout of the paper's code (no calibrator_config.json; a config.json with "calibration_type"). The one place
    that tells the two apart (loading, the CLI's checks, lm-eval's).

    Args:
        directory: a local folder.

    Returns:
        The saved "type" (any JSON value, checked by the caller), or `OFFICIAL_LAYOUT`.

    Raises:
        ATSError: if the folder has neither config (a run folder is named as such), or its calibrator_config.json
            is not a JSON object.
    """
    if not (directory / CONFIG_NAME).exists() and (directory / OFFICIAL_CONFIG).is_file():
        official = read_json(directory / OFFICIAL_CONFIG)  # a broken one is named, not taken for a missing config
        if isinstance(official, dict) and "calibration_type" in official:
            return OFFICIAL_LAYOUT
    return read_config(directory).get("type")


def read_config(directory: Path) -> dict:
    """A calibrator folder's config; a folder without one gets a hint at where heads are saved.

    Args:
        directory: the calibrator's folder.

    Returns:
        The parsed calibrator_config.json, "type" included.

    Raises:
        ATSError: if `directory` is a file, the config is missing (a run folder is named as such) or is not a
            JSON object.
    """
    path = directory / CONFIG_NAME
    if directory.is_file():
        raise ATSError(f"{directory}: a file, not a calibrator folder (the folder that holds {CONFIG_NAME})")
    if directory.is_dir() and not path.exists() and (directory / "head" / CONFIG_NAME).exists():
        raise ATSError(f"{directory}: a run folder, not a calibrator; the head is in {directory / 'head'}")
    config = read_json(path)
    if not isinstance(config, dict):
        raise ATSError(f"{path}: expected a JSON object, got {type(config).__name__}")
    return config


def read_tensors(directory: Path) -> dict[str, Tensor]:
    """The tensors of `model.safetensors` ({} when the folder has none), with one-line errors for a corrupt file.

    Args:
        directory: the calibrator's folder.

    Returns:
        {name: tensor}, on the CPU.

    Raises:
        ATSError: if the file is corrupt or truncated.
    """
    from safetensors.torch import load_file

    path = directory / WEIGHTS_NAME
    if not path.exists():
        return {}
    try:
        return load_file(str(path))
    except Exception as err:  # safetensors raises its own error types for corrupt files
        raise ATSError(f"{path}: corrupt or truncated safetensors file ({err})") from None


def write_folder(directory: str | Path, kind: str, config: dict, tensors: dict[str, Tensor],
                 metadata: dict | None = None) -> None:
    """Write calibrator_config.json ({"type": kind, **config}) and, if there are tensors, model.safetensors (with
    `metadata`), atomically: an existing folder is replaced, an interrupted write leaves nothing half written."""
    from safetensors.torch import save_file

    with atomic_dir(directory) as tmp:
        (tmp / CONFIG_NAME).write_text(json.dumps({"type": kind, **config}, indent=2, sort_keys=True))
        tensors = {k: v.detach().contiguous().cpu() for k, v in tensors.items()}
        if tensors:
            save_file(tensors, str(tmp / WEIGHTS_NAME), metadata=metadata)


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
