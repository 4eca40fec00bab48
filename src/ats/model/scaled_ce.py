"""Per-token cross-entropies of scaled logits `q = z * s`, differentiable in the scale `s` alone, chunk by chunk.

Training a calibration head (ATS, the global-temperature control, Thermometer) needs, for N tokens, quantities of
`q = logits_fn(h) * s` with `s (N,)` the only tensor carrying a gradient. For a target distribution t,

    CE(q, t) = logsumexp(q) - sum_j t_j q_j,        d CE / d s = E_p[z] - E_t[z],        p = softmax(q),

and for the top token k = argmax z (the same as argmax q, since s > 0), log p_k = s z_k - logsumexp(q) with
d log p_k / d s = z_k - E_p[z]. One no-grad pass over chunks gives every value and its exact derivative; the backward
pass only multiplies the saved (N,) derivatives by the incoming gradient. Nothing of size (N, V) is kept: peak memory
is about two (chunk_size, V) float32 buffers (plus what `logits_fn` allocates), 2 GiB at chunk_size 1024 and a
262k vocabulary.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from ..errors import ATSError
from .numerics import logsumexp, softmax_

LogitsFn = Callable[[Tensor], Tensor]  # h (n, H) -> z (n, V)


@dataclass
class ScaledCE:
    """Per-token values (N,) of q = z * s; the float ones are differentiable w.r.t. s."""

    ce_label: Tensor  # CE(q, y)
    ce_uniform: Tensor  # CE(q, uniform) = logsumexp(q) - mean_j q_j
    log_p_top: Tensor  # log softmax(q)[argmax z]: the log of the calibrated top-1 confidence
    correct: Tensor  # bool: argmax z == y


class _ScaledCEFunction(torch.autograd.Function):
    """forward(scale (N,), hidden (N, H), labels (N,), logits_fn, chunk_size) -> ce_y, ce_u, log_p_top, correct."""

    @staticmethod
    def forward(ctx, scale: Tensor, hidden: Tensor, labels: Tensor, logits_fn: LogitsFn, chunk_size: int):
        N = scale.shape[0]
        out_dtype = torch.float64 if scale.dtype == torch.float64 else torch.float32
        values = torch.empty(3, N, dtype=out_dtype, device=scale.device)  # ce_y, ce_u, log_p_top
        derivs = torch.empty_like(values)  # their derivatives w.r.t. s
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
            s = scale[sl].to(z.dtype)  # (n,)
            z_top, top = z.max(-1)  # (n,) each
            z_y = z.gather(1, y[:, None]).squeeze(1)  # (n,)
            z_mean = z.mean(-1)  # (n,)
            q = z * s[:, None]  # (n, V)
            lse = logsumexp(q, dim=-1)  # (n,)
            ez = softmax_(q, lse).mul_(z).sum(-1)  # (n,) E_p[z]; softmax in place of q
            values[0, sl], derivs[0, sl] = lse - s * z_y, ez - z_y
            values[1, sl], derivs[1, sl] = lse - s * z_mean, ez - z_mean
            values[2, sl], derivs[2, sl] = s * z_top - lse, z_top - ez
            correct[sl] = top == y
            del z, q
        ctx.save_for_backward(derivs)
        ctx.scale_dtype = scale.dtype
        ctx.mark_non_differentiable(correct)
        return values[0], values[1], values[2], correct

    @staticmethod
    def backward(ctx, grad_y: Tensor | None, grad_u: Tensor | None, grad_top: Tensor | None, _grad_correct):
        (derivs,) = ctx.saved_tensors
        grad = torch.zeros_like(derivs[0])
        for g, d in zip((grad_y, grad_u, grad_top), derivs):
            if g is not None:
                grad = grad + g * d
        return grad.to(ctx.scale_dtype), None, None, None, None


def scaled_cross_entropy(hidden: Tensor, scale: Tensor, labels: Tensor, logits_fn: LogitsFn,
                         chunk_size: int = 1024) -> ScaledCE:
    """CE(q, y), CE(q, uniform), log p_top (N,) each and correctness (N,) bool for q = logits_fn(hidden) * scale.

    The logits are computed chunk by chunk and never all kept: memory is O(chunk_size x V), not O(N x V).

    Args:
        hidden: (N, H) hidden states, without grad.
        scale: (N,) > 0, with grad.
        labels: (N,) token ids in [0, V).
        logits_fn: h (n, H) -> z (n, V), e.g. `Backbone.logits`.
        chunk_size: positions per call of `logits_fn`.

    Returns:
        `ScaledCE`: float results float32 (float64 if `scale` is), differentiable w.r.t. `scale` only.

    Raises:
        ATSError: if a label is outside [0, V).
    """
    ce_y, ce_u, log_p_top, correct = _ScaledCEFunction.apply(scale, hidden, labels, logits_fn, chunk_size)
    return ScaledCE(ce_label=ce_y, ce_uniform=ce_u, log_p_top=log_p_top, correct=correct)
