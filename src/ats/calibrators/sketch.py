"""A compact per-token summary of full-vocabulary logits, built in one pass, from which the global-temperature
methods are fitted without another full-vocabulary pass.

Temperature scaling needs, per token and for any inverse temperature s, logsumexp(s z) (V terms); Newton's method
asks for it at several s, and the exact fit re-reads all logits on every step. The sketch keeps, per token:

- the K largest logits exactly (they carry almost all the probability at s >= 1);
- the other V - K logits in B equal-width bins over [min z, K-th largest], each as (count n, mean m, variance v);
  a bin contributes n * exp(s m + s^2 v / 2) (its exact value when the logits in it are Gaussian; the error is of
  the order of s^4 * width^4 and the bins hold a vanishing share of the mass when s is large);
- the label's logit, the exact top-1 confidence at s = 1 and whether the argmax is the label.

So logsumexp(s z) costs K + B terms instead of V, and every Newton step, scaling-binning's confidences and the
binning methods' confidences come from memory. `tests/calibrators/test_sketch.py` bounds the error against the exact
logsumexp over a range of s.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch
from torch import Tensor

from ..errors import ATSError
from ._fitting import iter_chunks
from .base import LogitChunks, top1_confidence

TOP_K = 64
TAIL_BINS = 32


@dataclass
class LogitSketch:
    """Per-token logit summaries (see the module docstring); N tokens, K exact logits, B tail bins."""

    top: Tensor  # (N, K) float32, largest logits, descending
    tail_log_count: Tensor  # (N, B) float32 log n per bin (-inf for empty bins)
    tail_mean: Tensor  # (N, B) float32
    tail_var: Tensor  # (N, B) float32, within-bin variance
    label_logit: Tensor  # (N,) float32 z_y
    confidence: Tensor  # (N,) float64 exact top-1 confidence at s = 1 (as `collect_top1` gives it)
    correct: Tensor  # (N,) float64 1.0 where the argmax is the label

    def __len__(self) -> int:
        return self.top.shape[0]

    @classmethod
    def from_chunks(cls, chunks: LogitChunks, *, top_k: int = TOP_K, tail_bins: int = TAIL_BINS) -> "LogitSketch":
        """Summarise every fitting token of one pass over `chunks`.

        Args:
            chunks: a `LogitChunks` callable yielding logits (N, V) and labels (N,).
            top_k: logits kept exactly per token (at most V).
            tail_bins: bins for the rest.

        Returns:
            The sketch of all non-ignored tokens, in chunk order.

        Raises:
            ATSError: if a chunk is malformed or there is no fitting token.
        """
        parts = []
        for logits, labels in iter_chunks(chunks):
            parts.append(_summarise(logits.float(), labels, top_k, tail_bins))
        if not parts:
            raise ATSError("chunks: no fitting tokens (every chunk was empty)")
        return cls(*(torch.cat(column) for column in zip(*parts)))

    def select(self, rows: Tensor) -> "LogitSketch":
        """The sketch of the given rows (N',) only."""
        return LogitSketch(*(getattr(self, f.name)[rows] for f in fields(self)))

    def log_terms(self, s: Tensor | float) -> Tensor:
        """The K + B terms whose logsumexp approximates logsumexp(s z) per token.

        Args:
            s: the inverse temperature, a scalar or (N,) (differentiable); the terms take its dtype if wider.

        Returns:
            (N, K + B) terms.
        """
        s = torch.as_tensor(s, dtype=self.top.dtype) if not isinstance(s, Tensor) else s
        dtype = torch.promote_types(s.dtype, self.top.dtype)  # float64 s: the terms in float64
        s = s.reshape(-1, 1) if s.dim() else s
        tail = (self.tail_log_count.to(dtype) + s * self.tail_mean.to(dtype)
                + 0.5 * s * s * self.tail_var.to(dtype))  # (N, B)
        return torch.cat([s * self.top.to(dtype), tail], dim=1)

    def logsumexp(self, s: Tensor | float) -> Tensor:
        """logsumexp(s z) per token, (N,)."""
        return torch.logsumexp(self.log_terms(s), dim=1)

    def nll(self, s: Tensor | float) -> Tensor:
        """-log softmax(s z)[y] per token, (N,)."""
        s = torch.as_tensor(s, dtype=self.top.dtype) if not isinstance(s, Tensor) else s
        return self.logsumexp(s) - s * self.label_logit

    def top1_confidence(self, s: float) -> Tensor:
        """softmax(s z).max() per token, (N,) float64 in [0, 1]."""
        return torch.exp(s * self.top[:, 0] - self.logsumexp(s)).double().clamp(0.0, 1.0)


def _summarise(z: Tensor, labels: Tensor, top_k: int, tail_bins: int, rows: int = 64) -> tuple[Tensor, ...]:
    """One chunk's columns of a `LogitSketch` from logits z (n, V) and labels (n,).

    Works on `rows` tokens at a time: the (rows, V) temporaries then stay small enough to be reused by the allocator
    instead of being mapped afresh (which costs more than the arithmetic at V ~ 50k).
    """
    if z.shape[0] > rows:
        parts = [_summarise(z[a:a + rows], labels[a:a + rows], top_k, tail_bins, rows)
                 for a in range(0, z.shape[0], rows)]
        return tuple(torch.cat(column) for column in zip(*parts))
    n, vocab = z.shape
    k = min(top_k, vocab)
    top, top_idx = z.topk(k, dim=1)  # (n, k) descending
    conf, pred = top1_confidence(z)  # exact, computed as every other fitter computes it
    label_logit = z.gather(1, labels[:, None]).squeeze(1)
    log_count = torch.full((n, tail_bins), float("-inf"))
    mean = torch.zeros(n, tail_bins)
    var = torch.zeros(n, tail_bins)
    if vocab > k:
        lo = z.min(dim=1, keepdim=True).values  # (n, 1)
        width = ((top[:, -1:] - lo) / tail_bins).clamp_min(1e-6)  # (n, 1)
        pos = (z - lo).div_(width)  # (n, V) position in bin widths, >= 0
        idx = pos.long().clamp_(max=tail_bins - 1)  # truncation == floor here
        offset = pos.sub_(idx).sub_(0.5)  # (n, V) offset from the bin centre, in widths: small, so var is accurate
        idx.scatter_(1, top_idx, tail_bins)  # the exact top-k go to an overflow bin, dropped below
        count = torch.zeros(n, tail_bins + 1).scatter_add_(1, idx, torch.ones(1).expand(n, vocab))[:, :tail_bins]
        sum_d = torch.zeros(n, tail_bins + 1).scatter_add_(1, idx, offset)[:, :tail_bins]
        sum_d2 = torch.zeros(n, tail_bins + 1).scatter_add_(1, idx, offset.square_())[:, :tail_bins]
        safe = count.clamp_min(1)
        mean_d = sum_d / safe
        centre = lo + (torch.arange(tail_bins, dtype=z.dtype) + 0.5) * width  # (n, B)
        mean = centre + mean_d * width
        var = (sum_d2 / safe - mean_d.square()).clamp_min(0.0) * width.square()
        log_count = torch.where(count > 0, count.log(), log_count)
    return (top, log_count, mean, var, label_logit, conf.double().clamp(0.0, 1.0),
            (pred == labels).double())
