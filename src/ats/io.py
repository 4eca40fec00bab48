"""Atomic file writing: a crash never leaves a half-written file or folder behind."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Iterator

from .errors import ATSError


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_file(path: str | Path, mode: str = "w") -> Iterator:
    """Open a temporary file beside `path`; on success fsync it and rename it over `path`.

    On an error the temporary file is removed and `path` is left as it was.

    Args:
        path: the file to write; its folder is created if missing.
        mode: the `open` mode ("w" for text, "wb" for bytes).

    Yields:
        The open temporary file.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, mode) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        _fsync_dir(path.parent)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def write_json(path: str | Path, obj) -> None:
    """Write `obj` as indented JSON with sorted keys, atomically.

    Args:
        path: the file to write.
        obj: a JSON-serialisable value.
    """
    with atomic_file(path) as f:
        json.dump(obj, f, indent=2, sort_keys=True)
        f.write("\n")


def read_json(path: str | Path):
    """Read a JSON file.

    Args:
        path: the file to read.

    Returns:
        The parsed value.

    Raises:
        ATSError: if the file is missing, a folder, not UTF-8 or not valid JSON (naming the file and line).
    """
    path = Path(path)
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise ATSError(f"{path}: file not found") from None
    except IsADirectoryError:
        raise ATSError(f"{path}: a folder, not a JSON file") from None
    try:
        return json.loads(_utf8(raw, path))
    except json.JSONDecodeError as err:
        raise ATSError(f"{path}:{err.lineno}: invalid JSON ({err.msg})") from None


def _utf8(raw: bytes, path: Path, first_line: int = 1) -> str:
    """`raw` (the file's text from line `first_line` on) decoded as UTF-8, or ATSError naming the file, the line and
    the first byte that is not UTF-8."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as err:
        line = first_line + raw.count(b"\n", 0, err.start)
        raise ATSError(f"{path}:{line}: not UTF-8 text (byte 0x{raw[err.start]:02x})") from None


def read_jsonl(path: str | Path) -> Iterator[tuple[int, object]]:
    """(line number, parsed object) for each non-blank line; invalid JSON raises ATSError naming file and line.

    Args:
        path: the JSON Lines file.

    Yields:
        (1-based line number, parsed object) for each non-blank line.

    Raises:
        ATSError: on a line that is not UTF-8 or not valid JSON.
    """
    path = Path(path)
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            line = _utf8(raw, path, lineno)
            if not line.strip():
                continue
            try:
                yield lineno, json.loads(line)
            except json.JSONDecodeError as err:
                raise ATSError(f"{path}:{lineno}: invalid JSON ({err.msg})") from None


@contextlib.contextmanager
def atomic_dir(path: str | Path) -> Iterator[Path]:
    """Build a folder in a temporary sibling; on success swap it into place (replacing an older one).

    On an error the temporary folder is removed and `path` is left as it was.

    Args:
        path: the folder to create or replace; its parent is created if missing.

    Yields:
        The temporary folder to write into.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp"))
    try:
        yield tmp
        for child in tmp.rglob("*"):
            if child.is_file():
                with open(child, "rb") as f:
                    os.fsync(f.fileno())
        old = None
        if path.exists():
            old = path.with_name(f".{path.name}.old")
            shutil.rmtree(old, ignore_errors=True)
            os.replace(path, old)
        os.replace(tmp, path)
        _fsync_dir(path.parent)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
