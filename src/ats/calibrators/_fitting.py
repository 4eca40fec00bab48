"""What the token-level fitters share: one validated pass over logit chunks, and the top-1 confidences of a pass."""

from __future__ import annotations

from typing import Callable, Iterator

import numpy as np
from torch import Tensor

from ..errors import ATSError
from ..model.backbone import IGNORE_INDEX
from .base import LogitChunks, top1_confidence


def iter_chunks(chunks: LogitChunks) -> Iterator[tuple[Tensor, Tensor]]:
    """One pass over validated chunks: logits (N, V) floating, labels (N,) in [0, V); -100 labels are dropped.

    Args:
        chunks: a `LogitChunks` callable; each call starts a new pass.

    Yields:
        (logits (n, V) floating, labels (n,) int64) per non-empty chunk, the ignored positions removed.

    Raises:
        ATSError: if `chunks` is not callable, a chunk's logits are not floating (N, V), its labels do not match
            them, or a label is outside [0, V).
    """
    try:
        iterator = chunks()
    except TypeError:
        raise ATSError(f"chunks: expected a callable returning an iterator, got {type(chunks).__name__}") from None
    for logits, labels in iterator:
        if logits.dim() != 2 or not logits.dtype.is_floating_point:
            raise ATSError(f"chunks: logits must be floating (N, V), got {logits.dtype} {tuple(logits.shape)}")
        if labels.shape != logits.shape[:1]:
            raise ATSError(f"chunks: labels shape {tuple(labels.shape)} does not match logits {tuple(logits.shape)}")
        keep = labels != IGNORE_INDEX
        if not bool(keep.all()):
            logits, labels = logits[keep], labels[keep]
        if labels.numel() == 0:
            continue
        bad = (labels < 0) | (labels >= logits.shape[1])
        if bool(bad.any()):
            raise ATSError(f"chunks: label {int(labels[bad][0])} outside the vocabulary [0, {logits.shape[1]})")
        yield logits, labels.long()


def collect_top1(chunks: LogitChunks, transform: Callable[[Tensor], Tensor] | None = None
                 ) -> tuple[np.ndarray, np.ndarray]:
    """Top-1 confidence (N,) float64 and correctness (N,) float64 of every fitting token, after `transform`.

    Args:
        chunks: a `LogitChunks` callable.
        transform: applied to each chunk's logits (n, V) before the softmax (e.g. division by a temperature), or
            None.

    Returns:
        (confidence (N,) in [0, 1], correct (N,) 1.0 where the argmax is the label, else 0.0), both float64.

    Raises:
        ATSError: if a chunk is malformed (see `iter_chunks`) or there is no fitting token.
    """
    confs, corrects = [], []
    for logits, labels in iter_chunks(chunks):
        if transform is not None:
            logits = transform(logits)
        conf, pred = top1_confidence(logits)
        confs.append(conf.double().clamp(0.0, 1.0).cpu().numpy())
        corrects.append((pred == labels).double().cpu().numpy())
    if not confs:
        raise ATSError("chunks: no fitting tokens (every chunk was empty)")
    return np.concatenate(confs), np.concatenate(corrects)


def source_top1(source) -> tuple[np.ndarray, np.ndarray]:
    """Top-1 confidence and correctness (N,) float64 of a fit source's tokens: from its `sketch` when it has one
    (the exact values, no pass), else by one pass over its logit chunks (`collect_top1`).

    Args:
        source: a `FitSource`.

    Returns:
        (confidence (N,), correct (N,)).

    Raises:
        ATSError: if a chunk is malformed or there is no fitting token.
    """
    sketch = getattr(source, "sketch", None)
    if sketch is None:
        return collect_top1(source.logit_chunks)
    return sketch.confidence.numpy(), sketch.correct.numpy()


def source_summary(source) -> Tensor | None:
    """The scale summary rows (N, D) of a fit source's tokens (`FitSource.summary`), or None when it has none.

    Args:
        source: a `FitSource`.

    Returns:
        (N, D) float32 rows aligned with the source's logit chunks, or None.
    """
    return getattr(source, "summary", None)


def vector_pair(tensors: dict[str, Tensor], first: str, second: str) -> tuple[np.ndarray, np.ndarray]:
    """Two saved equal-length, non-empty float64 vectors (bin edges and values, isotonic thresholds).

    Args:
        tensors: the tensors read from model.safetensors.
        first: the first vector's key.
        second: the second vector's key.

    Returns:
        (first (K,), second (K,)) as float64 arrays.

    Raises:
        ATSError: if a key is missing or the two are not equal-length, non-empty vectors.
    """
    for key in (first, second):
        if key not in tensors:
            raise ATSError(f"model.safetensors: tensor {key!r} missing")
    a, b = tensors[first].double().numpy(), tensors[second].double().numpy()
    if a.ndim != 1 or a.shape != b.shape or a.size == 0:
        raise ATSError(f"model.safetensors: tensors {first!r} {a.shape} and {second!r} {b.shape} "
                       "must be equal-length non-empty vectors")
    return a, b
