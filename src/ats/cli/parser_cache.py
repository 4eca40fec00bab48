"""The `ats` parser replayed from a record, so `--help` and argument errors answer without importing torch.

The options of `train`, `eval` and `ablate` are generated from the config dataclasses, whose modules import torch and
transformers: building the parser takes seconds. So the first build records every argparse call the commands make
(`Recorder`), the record is saved as JSON under `$ATS_CACHE/cli` (default `~/.cache/ats/cli`), keyed by a hash of the
package's source files, and later runs replay it onto plain argparse objects in milliseconds. Editing any source file
changes the key, so a record is never stale; a record that cannot be written or read is rebuilt, never trusted.
Functions given to argparse (each command's `run`) are recorded by name and imported when called.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import sys
import time
from collections.abc import Callable
from importlib import import_module
from pathlib import Path

from .. import __version__

logger = logging.getLogger(__name__)

PACKAGE = Path(__file__).resolve().parents[1]  # src/ats
CACHED_CALLS = ("add_argument", "add_argument_group", "add_mutually_exclusive_group", "add_parser",
                "add_subparsers", "set_defaults")
RETURNS_OBJECT = ("add_argument_group", "add_mutually_exclusive_group", "add_parser", "add_subparsers")
TYPES = {"int": int, "float": float, "str": str}
KEEP = 8  # records kept in the cache folder


class NotCacheable(Exception):
    """A call the record cannot hold (an unknown method, a value that is not JSON, a nameless function)."""


class LazyFunction:
    """A module-level function named "module:name", imported on its first call (the commands' `run`)."""

    def __init__(self, module: str, name: str) -> None:
        self.module, self.name = module, name
        self.__name__ = name  # argparse names a failing `type` by its __name__

    def __call__(self, *args, **kwargs):
        return getattr(import_module(self.module), self.name)(*args, **kwargs)


def _encode(value):
    """`value` as JSON: tuples, argparse types and module-level functions tagged so `_decode` restores them."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        items = [_encode(v) for v in value]
        return items if isinstance(value, list) else {"$tuple": items}
    if isinstance(value, dict) and all(isinstance(k, str) for k in value):
        return {"$dict": {k: _encode(v) for k, v in value.items()}}
    if isinstance(value, type) and TYPES.get(value.__name__) is value:
        return {"$type": value.__name__}
    if isinstance(value, LazyFunction):
        return {"$function": f"{value.module}:{value.name}"}
    module, name = getattr(value, "__module__", None) or "", getattr(value, "__qualname__", "")
    if callable(value) and module.startswith("ats.") and name.isidentifier():
        return {"$function": f"{module}:{name}"}
    raise NotCacheable(f"cannot record {value!r}")


def _decode(value):
    """The inverse of `_encode`."""
    if isinstance(value, list):
        return [_decode(v) for v in value]
    if not isinstance(value, dict):
        return value
    (tag, inner), = value.items()
    if tag == "$tuple":
        return tuple(_decode(v) for v in inner)
    if tag == "$dict":
        return {k: _decode(v) for k, v in inner.items()}
    if tag == "$type":
        return TYPES[inner]
    module, _, name = inner.partition(":")
    return LazyFunction(module, name)


class Recorder:
    """Forwards calls to a real argparse object and appends each to `log` (objects it returns are wrapped too).

    Args:
        target: the parser, sub-parsers action or argument group.
        log: the shared list of recorded calls.
        ident: this object's number in the record (0: the root parser).
        counter: the shared one-item list holding the next free number.
    """

    def __init__(self, target, log: list[dict], ident: int = 0, counter: list[int] | None = None) -> None:
        self._target, self._log, self._ident = target, log, ident
        self._counter = counter if counter is not None else [1]

    def __getattr__(self, name: str):
        attr = getattr(self._target, name)
        if name not in CACHED_CALLS:
            raise NotCacheable(f"argparse attribute {name!r} is not recorded")

        def call(*args, **kwargs):
            entry = {"on": self._ident, "call": name, "args": _encode(list(args)), "kwargs": _encode(kwargs)}
            result = attr(*args, **kwargs)
            self._log.append(entry)
            if name not in RETURNS_OBJECT:
                return result
            entry["result"] = self._counter[0]
            self._counter[0] += 1
            return Recorder(result, self._log, entry["result"], self._counter)

        return call


def replay(root: argparse.ArgumentParser, log: list[dict]) -> argparse.ArgumentParser:
    """Apply the recorded calls `log` to `root` (a fresh parser made as the recorded one was).

    Returns:
        `root`, with every option and sub-command.
    """
    objects = {0: root}
    for entry in log:
        result = getattr(objects[entry["on"]], entry["call"])(*_decode(entry["args"]), **_decode(entry["kwargs"]))
        if "result" in entry:
            objects[entry["result"]] = result
    return root


STARTED = time.time()  # when this process first imported the CLI: modules it loaded are at most this old


def source_key() -> str | None:
    """A hash of every source file of the package, the ats version and the Python version (the record's key); None
    when a source file changed after this process started, so its loaded modules may not be what the files say (a
    long test session while the code is edited): it then neither reads nor writes a record."""
    digest = hashlib.sha256(f"{__version__} {sys.version}".encode())
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.stat().st_mtime > STARTED:
            return None
        digest.update(str(path.relative_to(PACKAGE)).encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:32]


def cache_file(key: str) -> Path:
    """Where the record of `key` lives: `$ATS_CACHE/cli/parser-KEY.json` (default `~/.cache/ats`)."""
    return Path(os.environ.get("ATS_CACHE", Path.home() / ".cache" / "ats")) / "cli" / f"parser-{key}.json"


def _read(path: Path) -> list[dict] | None:
    try:
        log = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return log if isinstance(log, list) else None


def _write(path: Path, log: list[dict]) -> None:
    """Save `log` atomically and keep the KEEP newest records (several checkouts may share the cache folder); a
    folder that cannot be written only costs speed."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(log))
        os.replace(tmp, path)
        records = sorted(path.parent.glob("parser-*.json"), key=lambda p: p.stat().st_mtime, reverse=True)
        for old in records[KEEP:]:
            old.unlink(missing_ok=True)
    except OSError as err:
        logger.debug("parser record not saved (%s)", err)


def cached_parser(new_parser: Callable[[], argparse.ArgumentParser],
                  define: Callable[[argparse.ArgumentParser], None]) -> argparse.ArgumentParser:
    """The parser that `define(new_parser())` builds, replayed from the saved record when there is one.

    Args:
        new_parser: makes the bare root parser (no options yet).
        define: adds every option and sub-command to the parser it is given.

    Returns:
        The complete parser.
    """
    def built() -> argparse.ArgumentParser:
        parser = new_parser()
        define(parser)
        return parser

    key = source_key()
    if key is None:
        return built()
    path = cache_file(key)
    log = _read(path)
    if log is not None:
        try:
            return replay(new_parser(), log)
        except Exception as err:  # a damaged record: build anew
            logger.debug("parser record %s unusable (%s)", path, err)
    parser, log = new_parser(), []
    try:
        define(Recorder(parser, log))
    except NotCacheable as err:
        logger.debug("parser not recorded (%s)", err)
        return built()
    _write(path, log)
    return parser
