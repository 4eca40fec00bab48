"""Fingerprints: a record of everything that determines a reusable result, so a rerun never returns a stale one.

Every step that can be reused (features, a head, a fitted baseline, a task's results) stores a fingerprint beside its
output: the backbone's identity and revision, the data and its checksum, and every option that changes the result,
plus the library version. A rerun computes the fingerprint of what it is asked for and

- reuses the stored result when the two are equal, saying so in one line ("reusing features from ... (same
  options)");
- refuses, naming the options that differ and the two ways out (`--overwrite`, or another `--out`), when they are
  not; with `overwrite=True` the old result is replaced instead.

A fingerprint is a JSON object; nested objects are compared key by key (`training.lr: 0.001 -> 0.01`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
from pathlib import Path

from . import __version__
from .errors import ATSError
from .io import read_json, write_json

logger = logging.getLogger(__name__)

FINGERPRINT_NAME = "fingerprint.json"


def make_fingerprint(kind: str, **parts) -> dict:
    """A fingerprint of `kind` ("features", "head", ...) from JSON-ready parts, with the library version.

    Args:
        kind: what the result is ("features", "head", ...).
        **parts: the things that determine the result (backbone, data, options); values that are not JSON-ready
            are stored as their `str`.

    Returns:
        The fingerprint: a JSON-ready dict with sorted keys, including "kind" and "library_version".
    """
    return json.loads(json.dumps({"kind": kind, "library_version": __version__, **parts}, sort_keys=True,
                                 default=str))


def result_options(config, *, leave_out: tuple[str, ...] = ()) -> dict:
    """A config's options that can change a result: `to_dict()` less the fields marked `option(..., result=False)`.

    The one rule of what a fingerprint records of a config (data, training, heads).

    Args:
        config: a `ConfigMixin` dataclass.
        leave_out: further fields to leave out (recorded another way by the caller).

    Returns:
        {field name: value}, JSON-ready, in declaration order.
    """
    dropped = set(leave_out)
    kept = {f.name for f in dataclasses.fields(config) if f.metadata.get("result", True) and f.name not in dropped}
    return {k: v for k, v in config.to_dict().items() if k in kept}


def digest(value) -> str:
    """A short, stable hash of a JSON-ready value (or of bytes).

    Args:
        value: bytes, or a JSON-ready value (hashed as JSON with sorted keys).

    Returns:
        The first 16 hex digits of its sha256.
    """
    data = value if isinstance(value, bytes) else json.dumps(value, sort_keys=True, default=str).encode()
    return hashlib.sha256(data).hexdigest()[:16]


def file_digest(path: str | Path) -> str:
    """sha256 of a file's bytes (first 16 hex digits).

    Args:
        path: the file.

    Returns:
        The first 16 hex digits of the sha256 of its bytes.
    """
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()[:16]


def flatten(value, prefix: str = "") -> dict:
    """{"a": {"b": 1}} -> {"a.b": 1}; lists and scalars are leaves.

    Args:
        value: a nested dict, or a leaf.
        prefix: the dotted key of `value` itself ("" at the top).

    Returns:
        {dotted key: leaf value}.
    """
    if not isinstance(value, dict):
        return {prefix: value}
    out = {}
    for key, item in value.items():
        out.update(flatten(item, f"{prefix}.{key}" if prefix else str(key)))
    return out


def differences(old: dict, new: dict, *, limit: int = 4) -> str:
    """The differing options as one line: "training.lr 0.001 -> 0.01, head.head_type 'linear' -> 'mlp'".

    Args:
        old: the stored fingerprint.
        new: the fingerprint asked for.
        limit: how many differences to name; the rest are counted ("and 2 more").

    Returns:
        The differences, comma-separated, keys in sorted order; a key missing on one side shows as '<unset>'.
    """
    a, b = flatten(old), flatten(new)
    keys = [k for k in sorted(set(a) | set(b)) if a.get(k, "<unset>") != b.get(k, "<unset>")]
    parts = [f"{k} {a.get(k, '<unset>')!r} -> {b.get(k, '<unset>')!r}" for k in keys[:limit]]
    if len(keys) > limit:
        parts.append(f"and {len(keys) - limit} more")
    return ", ".join(parts)


def stored_fingerprint(directory: str | Path) -> dict | None:
    """The fingerprint stored in `directory`, if any.

    Args:
        directory: the result's folder.

    Returns:
        The contents of its `fingerprint.json`, or None when there is none.

    Raises:
        ATSError: if the file is not valid JSON.
    """
    path = Path(directory) / FINGERPRINT_NAME
    return read_json(path) if path.is_file() else None


def write_fingerprint(directory: str | Path, fingerprint: dict) -> None:
    """Store `fingerprint` as `fingerprint.json` in `directory` (atomically).

    Args:
        directory: the result's folder (created if missing).
        fingerprint: the fingerprint, from `make_fingerprint`.
    """
    write_json(Path(directory) / FINGERPRINT_NAME, fingerprint)


def refusal(where: str | Path, what: str, old: dict | None, new: dict, *,
            keep: str = "choose another --out") -> ATSError:
    """The one-line error for a result made with other options.

    Args:
        where: the result's location, quoted first.
        what: what the result is ("features", "head", ...).
        old: the stored fingerprint, or None for a result made before fingerprints were stored.
        new: the fingerprint asked for.
        keep: the way to keep the stored result, said after --overwrite.

    Returns:
        The error (not raised), naming the differing options and the ways out (--overwrite, `keep`).
    """
    why = "no record of the options that made it (an older version)" if old is None else \
        f"made with other options: {differences(old, new)}"
    return ATSError(f"{where}: {what} {why}; rerun with --overwrite to replace it, or {keep}")


def check_reuse(where: str | Path, what: str, old: dict | None, new: dict, *, overwrite: bool,
                keep: str = "choose another --out") -> bool:
    """True: reuse the result at `where` (same fingerprint; said in one line). False: recompute (overwrite).
    Raises the refusal when the fingerprints differ and `overwrite` is False.

    Args:
        where: the result's location, for the log line and the error.
        what: what the result is ("features", "head", ...).
        old: the stored fingerprint, or None when none is stored.
        new: the fingerprint asked for.
        overwrite: replace a result made with other options instead of refusing.
        keep: the way to keep the stored result, said in the refusal.

    Returns:
        True to reuse the stored result, False to recompute it.

    Raises:
        ATSError: the `refusal`, if the fingerprints differ and `overwrite` is False.
    """
    if old == new:
        logger.info("reusing %s from %s (same options)", what, where)
        return True
    if overwrite:
        logger.info("replacing %s in %s (--overwrite; it was %s)", what, where,
                    "unrecorded" if old is None else differences(old, new))
        return False
    raise refusal(where, what, old, new, keep=keep)
