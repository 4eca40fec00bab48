"""The binary log loss of a confidence p against correctness c, -[c log p + (1 - c) log(1 - p)]: the one clipping rule
of every place that scores a confidence by it (the evaluation's NLL, the answer loss, the top-label training loss).

p is clipped to [EPS, 1 - EPS], so a confident wrong answer costs -log(EPS) ~ 27.6 nats instead of inf. 1 - EPS is not
a float32 number (it rounds to 1), so the loss is computed in float64 from p, or in log space from log p (where
log(1 - EPS) ~ -EPS is an ordinary float32 number). Torch-free at import: tensors are recognised by their methods.
"""

from __future__ import annotations

import math

import numpy as np

EPS = 1e-12
LOG_EPS, LOG_ONE_MINUS_EPS = math.log(EPS), math.log1p(-EPS)  # the same clip on log p


def binary_log_loss(confidence, correct):
    """Elementwise binary log loss of `confidence` against `correct`, p clipped to [EPS, 1 - EPS], in float64.

    Args:
        confidence: p in [0, 1], a numpy array (or array-like) or a torch tensor (differentiable).
        correct: 0/1 or bool, the same shape and kind.

    Returns:
        The per-element losses: a float64 array, or a float64 tensor for tensor input.
    """
    if hasattr(confidence, "clamp"):  # a torch tensor
        p = confidence.double().clamp(EPS, 1.0 - EPS)
        c = correct.double()
        return -(c * p.log() + (1.0 - c) * (-p).log1p())
    p = np.clip(np.asarray(confidence, dtype=np.float64), EPS, 1.0 - EPS)
    c = np.asarray(correct, dtype=np.float64)
    return -(c * np.log(p) + (1.0 - c) * np.log1p(-p))


def binary_log_loss_of_log(log_p, correct):
    """`binary_log_loss` from log p (a torch tensor of any float dtype, kept): the same clip, applied to log p, and
    log(1 - p) = log(-expm1(log p)), accurate near p = 1.

    Args:
        log_p: (N,) log of the confidence, <= 0.
        correct: (N,) bool.

    Returns:
        (N,) -log p where correct, -log(1 - p) elsewhere.
    """
    log_p = log_p.clamp(LOG_EPS, LOG_ONE_MINUS_EPS)
    return -log_p.where(correct, (-log_p.expm1()).log())
