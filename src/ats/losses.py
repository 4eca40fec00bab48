"""Calibration losses for the ATS head, computed in chunks over tokens so that (N, V) logits never exist at once.

Per training step we have, for N response tokens: hidden states `h (N, H)` from the frozen backbone, the output layer
`logits_fn(h) -> z (n, V)`, the head's scale `s = exp(tau).clamp(max=...) (N,)` (the only tensor with grad), and the
next-token labels `y (N,)`. Calibrated logits are `q = z * s`.

For a target distribution t over the vocabulary, CE(q, t) = logsumexp(q) - sum_j t_j q_j and

    d CE / d s = sum_j p_j z_j - sum_j t_j z_j,      p = softmax(q),

so one no-grad pass over chunks gives each token's CE and its exact derivative w.r.t. s; the backward pass only
multiplies the saved (N,) derivatives by the incoming gradient. No second logits pass and nothing of size (N, V) is kept:
peak memory is about two (chunk_size, V) float32 buffers (plus what `logits_fn` allocates), e.g. 2 GiB for
chunk_size 1024 and a 262k vocabulary.

Targets: one-hot y (CE(q, y)) and uniform (CE(q, u) = logsumexp(q) - mean_j q_j). A token is correct when
argmax z == y (the same as argmax q, since s > 0).

Loss types (alpha is the smoothing weight, the reference code's `smooth_loss_weight`):
- "selective" (the paper's): correct tokens get (1 - alpha) * CE(q, y), wrong tokens alpha * CE(q, u), i.e. sharpen
  where the model is right and flatten towards uniform where it is wrong. Two weightings:
  - "token": every response token counts once; mean over all tokens.
  - "reference": as the authors' code (`SelectiveSmoothingLoss(weighted_average=True)`): each group's mean is weighted
    by the *other* group's share of tokens, and the two weights are normalised to sum to 1:
        w_c = (1 - alpha) * n_wrong / n,  w_w = alpha * n_correct / n
        loss = (w_c * mean_correct CE(q, y) + w_w * mean_wrong CE(q, u)) / (w_c + w_w)
    So the rarer group is upweighted: when the model is mostly wrong, the few correct tokens dominate the loss (and vice
    versa), balancing the two pulls on the temperature. Unlike "token" weighting, a batch whose tokens are all correct
    (or all wrong) has loss 0 and no gradient, as in the reference code.
- "none": plain CE(q, y) on all tokens (mean).
- "full": label smoothing on every token, (1 - alpha) * CE(q, y) + alpha * CE(q, u) (mean).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor

from .errors import ATSError
from .numerics import logsumexp, softmax_

LOSS_TYPES = ("selective", "none", "full")
WEIGHTINGS = ("token", "reference")

LogitsFn = Callable[[Tensor], Tensor]  # h (n, H) -> z (n, V)


@dataclass
class LossOutput:
    """The loss (scalar, with grad w.r.t. scale) and counts for logging."""

    loss: Tensor
    n_correct: int  # tokens with argmax z == y
    n_tokens: int
    nll: float  # mean CE(q, y) of the calibrated logits, for logging


class _ChunkedCE(torch.autograd.Function):
    """Per-token CE(q, y), CE(q, uniform) and correctness, q = logits_fn(h) * scale, computed chunk by chunk.

    forward(scale (N,), hidden (N, H), labels (N,), logits_fn, chunk_size) -> ce_y (N,), ce_u (N,), correct (N,) bool.
    Only `scale` gets a gradient; backward uses the derivatives saved during the forward pass.
    """

    @staticmethod
    def forward(ctx, scale: Tensor, hidden: Tensor, labels: Tensor, logits_fn: LogitsFn, chunk_size: int):
        N = scale.shape[0]
        out_dtype = torch.float64 if scale.dtype == torch.float64 else torch.float32
        ce_y = torch.empty(N, dtype=out_dtype, device=scale.device)
        ce_u = torch.empty_like(ce_y)
        d_y = torch.empty_like(ce_y)
        d_u = torch.empty_like(ce_y)
        correct = torch.empty(N, dtype=torch.bool, device=scale.device)
        for start in range(0, N, chunk_size):
            sl = slice(start, min(start + chunk_size, N))
            z = logits_fn(hidden[sl])  # (n, V)
            if z.dtype != torch.float64:
                z = z.float()  # float32 at least; float64 stays (exact gradient checks)
            y = labels[sl].to(z.device)  # (n,)
            V = z.shape[-1]
            if start == 0 and (bool((labels < 0).any()) or bool((labels >= V).any())):
                bad = labels[(labels < 0) | (labels >= V)][0].item()
                raise ATSError(f"labels: id {bad} is outside the vocabulary [0, {V}) (pass response tokens only)")
            s = scale[sl].to(z.dtype)[:, None]  # (n, 1)
            q = z * s  # (n, V)
            lse = logsumexp(q, dim=-1)  # (n,)
            p = softmax_(q, lse)  # (n, V) softmax(q), in place of q
            ez = p.mul_(z).sum(-1)  # (n,) E_p[z]
            z_y = z.gather(1, y[:, None]).squeeze(1)  # (n,)
            z_mean = z.mean(-1)  # (n,)
            s = s.squeeze(1)
            ce_y[sl] = lse - s * z_y
            ce_u[sl] = lse - s * z_mean
            d_y[sl] = ez - z_y
            d_u[sl] = ez - z_mean
            correct[sl] = z.argmax(-1) == y
            del z, q, p
        ctx.save_for_backward(d_y, d_u)
        ctx.scale_dtype = scale.dtype
        ctx.mark_non_differentiable(correct)
        return ce_y, ce_u, correct

    @staticmethod
    def backward(ctx, grad_y: Tensor | None, grad_u: Tensor | None, _grad_correct):
        d_y, d_u = ctx.saved_tensors
        grad = torch.zeros_like(d_y)
        if grad_y is not None:
            grad = grad + grad_y * d_y
        if grad_u is not None:
            grad = grad + grad_u * d_u
        return grad.to(ctx.scale_dtype), None, None, None, None


def chunked_cross_entropy(
    hidden: Tensor, scale: Tensor, labels: Tensor, logits_fn: LogitsFn, chunk_size: int = 1024,
) -> tuple[Tensor, Tensor, Tensor]:
    """Per-token CE(q, y) (N,), CE(q, uniform) (N,) and correctness (N,) bool for q = logits_fn(hidden) * scale.

    The CE vectors are float32 (float64 if scale is) and differentiable w.r.t. `scale` only.
    """
    return _ChunkedCE.apply(scale, hidden, labels, logits_fn, chunk_size)


def _group_mean(values: Tensor, mask: Tensor) -> Tensor:
    """Mean of values[mask]; 0 (still in the graph) for an empty group."""
    return (values * mask).sum() / mask.sum().clamp(min=1)


def calibration_loss(
    hidden: Tensor,  # (N, H) response-token hidden states, no grad
    scale: Tensor,  # (N,) exp(tau) clamped, > 0, with grad
    labels: Tensor,  # (N,) next-token ids
    logits_fn: LogitsFn,  # h (n, H) -> z (n, V), no grad
    *,
    loss_type: str = "selective",
    alpha: float = 0.5,
    weighting: str = "token",
    chunk_size: int = 1024,
) -> LossOutput:
    """The ATS training loss on N response tokens (see the module docstring for the loss types and weightings)."""
    if loss_type not in LOSS_TYPES:
        raise ATSError(f"loss_type: unknown loss type {loss_type!r}; known: {', '.join(LOSS_TYPES)}")
    if weighting not in WEIGHTINGS:
        raise ATSError(f"weighting: unknown weighting {weighting!r}; known: {', '.join(WEIGHTINGS)}")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not 0.0 <= alpha <= 1.0:
        raise ATSError(f"alpha: expected a number in [0, 1], got {alpha!r}")
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ATSError(f"chunk_size: expected a positive integer, got {chunk_size!r}")
    if hidden.dim() != 2 or scale.dim() != 1 or labels.dim() != 1 or not (
            hidden.shape[0] == scale.shape[0] == labels.shape[0]):
        raise ATSError(f"calibration_loss: expected hidden (N, H), scale (N,), labels (N,), got "
                       f"{tuple(hidden.shape)}, {tuple(scale.shape)}, {tuple(labels.shape)}")

    N = scale.shape[0]
    if N == 0:
        return LossOutput(loss=scale.sum() * 0.0, n_correct=0, n_tokens=0, nll=0.0)

    ce_y, ce_u, correct = chunked_cross_entropy(hidden, scale, labels, logits_fn, chunk_size)  # (N,) each
    a = float(alpha)
    if loss_type == "none":
        loss = ce_y.mean()
    elif loss_type == "full":
        loss = ((1 - a) * ce_y + a * ce_u).mean()
    elif weighting == "token":
        loss = torch.where(correct, (1 - a) * ce_y, a * ce_u).mean()
    else:  # selective, reference weighting
        c = correct.to(ce_y.dtype)  # (N,)
        n_correct = c.sum()
        w_c = (1 - a) * (N - n_correct) / N  # weight of the correct group: the wrong tokens' share
        w_w = a * n_correct / N  # weight of the wrong group: the correct tokens' share
        total = (w_c + w_w).clamp(min=torch.finfo(ce_y.dtype).tiny)  # 0 only if a group weight is 0 and the other empty
        loss = (w_c * _group_mean(ce_y, c) + w_w * _group_mean(ce_u, 1 - c)) / total
    return LossOutput(loss=loss, n_correct=int(correct.sum()), n_tokens=N, nll=float(ce_y.detach().mean()))
