"""Vocabulary-sized exponentials without subnormal numbers.

`exp(x)` for x below about -87.3 is a float32 subnormal, and x86 CPUs compute subnormal results through a
microcode assist, about 50x slower than a normal `exp` (measured here: `exp` of (8, 49152) values takes 4.1 ms when
13% of the results are subnormal, 0.07 ms when none are). A confident next-token distribution puts most of the
vocabulary more than 87 nats below its top token, so a plain `torch.logsumexp` or softmax over the vocabulary can cost
more than the calibration head itself during generation and dominates the loss on CPU.

Clamping the shifted exponent at `exp_floor` (-87 for float32, -700 for float64) keeps every result normal
(e^-87 = 1.6e-38; the smallest normal float32 is 1.2e-38). Each clamped term adds at most 1.6e-38 to a sum that
contains the top term 1, so even 262k clamped terms change it by less than 5e-33, far below float32 resolution
(6e-8): the results equal the unclamped ones to the last bit (tests compare them with `torch.logsumexp`).
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["chosen_log_probs", "exp_floor", "logsumexp", "softmax_", "token_log_probs"]


def exp_floor(dtype: torch.dtype) -> float:
    """A low exponent whose `exp` is still a normal number: -700 for float64, -87 for float32 and narrower types.

    Args:
        dtype: the dtype the exponentials are computed in.

    Returns:
        The floor.
    """
    return -700.0 if dtype == torch.float64 else -87.0


def _floor_(shifted: Tensor, lowest: Tensor) -> Tensor:
    """Clamp `shifted` (exponents <= 0) in place at `exp_floor` when any entry of `lowest` (the rows' lowest
    exponents) is below it: checking is a small reduction, the clamp a full pass, so it runs only when needed.
    CPU only; callers skip it elsewhere (GPUs compute subnormals at full speed)."""
    floor = exp_floor(shifted.dtype)
    if bool((lowest < floor).any()):
        shifted.clamp_(min=floor)
    return shifted


def logsumexp(x: Tensor, dim: int = -1) -> Tensor:
    """`torch.logsumexp(x, dim)` for finite x (logits), with every exponent >= `exp_floor` (see the module doc);
    off the CPU this is `torch.logsumexp`.

    Args:
        x: finite values, e.g. logits (..., V).
        dim: the axis reduced.

    Returns:
        `x`'s shape without `dim`, `x`'s dtype.
    """
    if x.device.type != "cpu":
        return torch.logsumexp(x, dim)
    top = x.amax(dim, keepdim=True)  # (amax and amin are each ~10x faster than torch.aminmax on CPU)
    shifted = _floor_(x - top, x.amin(dim, keepdim=True) - top)
    return (shifted.exp_().sum(dim, keepdim=True).log_() + top).squeeze(dim)


def softmax_(x: Tensor, lse: Tensor) -> Tensor:
    """softmax of finite x (n, V) in place, given its log-normaliser `lse` (n,): exp(x - lse) with the floor.

    Args:
        x: (n, V) finite values; overwritten.
        lse: (n,) `logsumexp(x, -1)`.

    Returns:
        `x` itself, now the (n, V) probabilities.
    """
    x = x.sub_(lse[:, None])
    if x.device.type == "cpu":
        _floor_(x, x.amin(-1))
    return x.exp_()


def chosen_log_probs(z: Tensor, scale: Tensor, tokens: Tensor) -> tuple[Tensor, Tensor]:
    """The uncalibrated and calibrated log-probabilities of chosen tokens, log softmax(z)[token] and
    log softmax(z * scale)[token], from one shared shift: `token_log_probs` with one token per row.

    Args:
        z: (..., V) finite logits.
        scale: (...) > 0, the calibrated temperature's inverse per row.
        tokens: (...) long token ids.

    Returns:
        (logp_z, logp_q), (...) each.
    """
    logp_z, logp_q = token_log_probs(z, scale, tokens[..., None])
    return logp_z[..., 0], logp_q[..., 0]


def token_log_probs(z: Tensor, scale: Tensor, tokens: Tensor) -> tuple[Tensor, Tensor]:
    """log softmax(z) and log softmax(z * scale) at token ids `tokens` (..., K), for logits z (..., V) and scale (...)
    > 0: (..., K) each, e.g. the chosen token and the top-k alternatives of each row.

    Since scale > 0, max(z * scale) = scale * max(z), so one max over z shifts both: z - top and scale * (z - top)
    are exponentiated in one (2, ..., V) buffer (floored as in `logsumexp`).

    Args:
        z: (..., V) finite logits.
        scale: (...) > 0, multiplies each row's logits.
        tokens: (..., K) long token ids.

    Returns:
        (logp_z, logp_q), (..., K) each.
    """
    top = z.amax(-1, keepdim=True)  # (..., 1)
    shifted = torch.empty((2, *z.shape), dtype=z.dtype, device=z.device)  # (2, ..., V)
    torch.sub(z, top, out=shifted[0])
    torch.mul(shifted[0], scale[..., None], out=shifted[1])
    if z.device.type == "cpu":
        spread = z.amin(-1) - top[..., 0]  # (...) <= 0, the lowest exponent of the z rows
        _floor_(shifted, torch.minimum(spread, spread * scale))
    lse = shifted.exp_().sum(-1, keepdim=True).log_()  # (2, ..., 1) log-normalisers of the shifted rows
    chosen = z.gather(-1, tokens) - top  # (..., K) z[token] - top
    return chosen - lse[0], chosen * scale[..., None] - lse[1]
