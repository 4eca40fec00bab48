"""What the token-level fitters share: one validated pass over logit chunks, and the top-1 confidences of the fitting
tokens at a scale s, from the source's scale summary when it has one (no pass), else from a pass over its chunks."""

from __future__ import annotations

from typing import Callable, Iterator

import numpy as np
import torch
from torch import Tensor

from ..errors import ATSError
from ..model.labels import IGNORE_INDEX
from ..model.scale_summary import SummaryView, scaled_ce_from_summary
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


def source_top1(source, temperature: float = 1.0) -> tuple[np.ndarray, np.ndarray]:
    """Top-1 confidence (N,) and correctness (N,), float64, of softmax(z / T) for every fitting token of `source`:
    from its scale summary rows when it has them and 1 / T is within their range (log p_top = -G(1 / T),
    correctness from the header: no pass over the vocabulary), else from one pass over its logit chunks
    (`collect_top1`).

    Args:
        source: a `FitSource`.
        temperature: T.

    Returns:
        (confidence in [0, 1], correct 1.0 / 0.0).

    Raises:
        ATSError: if a chunk is malformed or there is no fitting token.
    """
    summary = source.summary
    s = 1.0 / temperature
    if summary is not None and summary.shape[0] and s <= SummaryView(summary).spec.max_scale:
        rows = summary.double()
        log_p = scaled_ce_from_summary(rows, torch.full((rows.shape[0],), s, dtype=torch.float64)).log_p_top
        return log_p.exp().clamp(0.0, 1.0).numpy(), SummaryView(rows).correct.double().numpy()
    return collect_top1(source.logit_chunks, transform=None if temperature == 1.0 else (lambda z: z / temperature))
