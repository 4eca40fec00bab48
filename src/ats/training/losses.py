"""Calibration losses for a head's per-token scale `s` (calibrated logits `q = z * s`), on N response tokens.

The per-token quantities (CE to the label, CE to uniform, the calibrated top-1 log-probability, correctness) come from
the tokens' scale summaries when the caller passes them (the route `ats.model.token_ce.summary_route` chose; no
vocabulary-sized work), or else from one chunked pass over the logits (the exact route), so (N, V) logits never exist
at once (`ats.model.token_ce.token_ce`). Both give the same `ScaledCE`, so every loss below is written once. A token
is correct when argmax z == y (the same as argmax q, since s > 0). alpha is the smoothing weight (the reference
code's `smooth_loss_weight`).

Loss types:
- "selective" (the paper's): correct tokens get (1 - alpha) CE(q, y), wrong tokens alpha CE(q, u): sharpen where the
  model is right, flatten towards uniform where it is wrong. Not a proper scoring rule: at a token accuracy of ~0.6
  its optimum confidence is far below 0.6, so it lowers confidence everywhere (see docs/method.md). Two weightings:
  - "token": every response token counts once; mean over all tokens.
  - "reference": the authors' `SelectiveSmoothingLoss(weighted_average=True)` exactly, including how it treats
    positions labelled -100 (prompt and padding, which the authors' collator never drops): argmax z never equals -100,
    so they count as *wrong* tokens, in the group weights and in the smoothing mean, where they add zeros
    (`CrossEntropyLoss` gives 0 at ignored positions). With n = N + ignored positions, n_c correct and
    n_w = n - n_c "wrong" (ignored included):
        w_c = (1 - alpha) n_w / n,  w_w = alpha n_c / n
        loss = (w_c * mean_correct CE(q, y) + w_w * sum_wrong CE(q, u) / n_w) / (w_c + w_w)
    Pass `ignored` (the number of -100 positions among the batch's B x (T - 1) shifted positions). A batch with no
    correct token, or one whose every position is correct, has loss 0 and no gradient, as in the authors' code.
- "none": plain CE(q, y) on all tokens (NLL; the ablation without smoothing).
- "full": label smoothing on every token, (1 - alpha) CE(q, y) + alpha CE(q, u).
- "top-label": the log loss of the calibrated top-1 confidence p = softmax(q)[argmax z] as a forecast of whether the
  top token is right, -[c log p + (1 - c) log(1 - p)] (`ats.log_loss`, the clipping of every log loss here): a proper
  scoring rule for exactly the confidence that token-level ECE measures (our objective beyond the paper; alpha is
  unused).

The answer losses score the confidence of a whole answer as the tasks compute it (`ats.training.answers`), against
whether the answer is right (docs/method.md, "Heads trained on answers"): a proper scoring rule back-propagated
through the calibrator's scale at the answer's positions.
- "answer-log": -[c log p + (1 - c) log(1 - p)], p the answer's confidence, c whether the answer is right;
- "answer-brier": (p - c)^2.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ..checks import check_choice, check_nonnegative_int, check_number, check_positive_int
from ..errors import ATSError
from ..log_loss import binary_log_loss, binary_log_loss_of_log
from ..model.scaled_ce import LogitsFn
from ..model.token_ce import token_ce
from .config import ANSWER_LOSSES, LOSS_TYPES, WEIGHTINGS


@dataclass
class LossOutput:
    """The loss (scalar, with grad w.r.t. scale) and counts for logging."""

    loss: Tensor
    n_correct: int  # tokens with argmax z == y
    n_tokens: int
    nll: float  # mean CE(q, y) of the calibrated logits, for logging


def _group_mean(values: Tensor, mask: Tensor) -> Tensor:
    """Mean of values[mask]; 0 (still in the graph) for an empty group."""
    return (values * mask).sum() / mask.sum().clamp(min=1)


def reference_selective(ce_y: Tensor, ce_u: Tensor, correct: Tensor, alpha: float, ignored: int) -> Tensor:
    """The authors' weighted selective loss, -100 positions counted as wrong tokens with zero smoothing loss.

    Args:
        ce_y: (N,) CE(q, y) per token.
        ce_u: (N,) CE(q, uniform) per token.
        correct: (N,) bool, argmax z == y.
        alpha: the smoothing weight.
        ignored: the number of -100 positions counted as wrong tokens.

    Returns:
        The scalar loss of the module docstring's "reference" weighting; 0 (in the graph) when both group weights
        vanish.
    """
    c = correct.to(ce_y.dtype)  # (N,)
    n = c.numel() + ignored
    n_correct = c.sum()
    n_wrong = n - n_correct  # ignored positions included
    w_c = (1 - alpha) * n_wrong / n
    w_w = alpha * n_correct / n
    total = w_c + w_w
    if float(total) == 0.0:  # one group weight is 0 and the other group empty
        return ce_y.sum() * 0.0
    smooth = (ce_u * (1 - c)).sum() / n_wrong.clamp(min=1)  # ignored positions add zeros to this mean
    return (w_c * _group_mean(ce_y, c) + w_w * smooth) / total


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
    ignored: int = 0,
    summary: Tensor | None = None,  # (N, D) scale summary rows, or None: the exact route
) -> LossOutput:
    """The head's training loss on N response tokens (see the module docstring for loss types and weightings).

    Args:
        hidden: (N, H) response-token hidden states, no grad.
        scale: (N,) s = exp(tau) clamped, > 0; the only input with a gradient.
        labels: (N,) next-token ids.
        logits_fn: the output layer, h (n, H) -> z (n, V), run without gradients.
        loss_type: one of `LOSS_TYPES`.
        alpha: the smoothing weight, in [0, 1].
        weighting: "token" or "reference"; used by the selective loss only.
        chunk_size: tokens per logits chunk.
        ignored: positions labelled -100 in the batch; only the reference weighting uses it.
        summary: (N, D) the tokens' scale summary rows (`ats.model.scale_summary`): the loss is computed from them,
            without `hidden` and `logits_fn`; None: the exact full-vocabulary route.

    Returns:
        The scalar loss (with grad w.r.t. `scale`) and counts; N == 0 gives a zero loss still in the graph.

    Raises:
        ATSError: if an option is invalid or the shapes do not match.
    """
    if loss_type in ANSWER_LOSSES:
        raise ATSError(f"loss {loss_type!r} scores answers, not tokens: train it on answers (ats train --on answers)")
    check_choice("loss_type", loss_type, LOSS_TYPES)
    check_choice("weighting", weighting, WEIGHTINGS)
    a = check_number("alpha", alpha, low=0.0, high=1.0)
    check_positive_int("chunk_size", chunk_size)
    check_nonnegative_int("ignored", ignored)
    if hidden.dim() != 2 or scale.dim() != 1 or labels.dim() != 1 or not (
            hidden.shape[0] == scale.shape[0] == labels.shape[0]):
        raise ATSError(f"calibration_loss: expected hidden (N, H), scale (N,), labels (N,), got "
                       f"{tuple(hidden.shape)}, {tuple(scale.shape)}, {tuple(labels.shape)}")
    N = scale.shape[0]
    if N == 0:
        return LossOutput(loss=scale.sum() * 0.0, n_correct=0, n_tokens=0, nll=0.0)

    out = token_ce(hidden, scale, labels, logits_fn, chunk_size=chunk_size, summary=summary)  # (N,) each
    ce_y, ce_u, correct = out.ce_label, out.ce_uniform, out.correct
    if loss_type == "none":
        loss = ce_y.mean()
    elif loss_type == "full":
        loss = ((1 - a) * ce_y + a * ce_u).mean()
    elif loss_type == "top-label":
        loss = binary_log_loss_of_log(out.log_p_top, correct).mean()
    elif weighting == "token":
        loss = torch.where(correct, (1 - a) * ce_y, a * ce_u).mean()
    else:
        loss = reference_selective(ce_y, ce_u, correct, a, ignored)
    return LossOutput(loss=loss, n_correct=int(correct.sum()), n_tokens=N, nll=float(ce_y.detach().mean()))


def answer_loss(confidence: Tensor, correct: Tensor, loss_type: str) -> Tensor:
    """Mean proper score of the answers' confidence (Q,) against their correctness (Q,) bool.

    Args:
        confidence: (Q,) answer confidences in (0, 1], differentiable.
        correct: (Q,) bool.
        loss_type: "answer-log" or "answer-brier".

    Returns:
        The scalar loss.

    Raises:
        ATSError: if the loss type is unknown.
    """
    if loss_type == "answer-log":
        return binary_log_loss(confidence, correct).mean().to(confidence.dtype)
    if loss_type == "answer-brier":
        return ((confidence - correct.to(confidence.dtype)) ** 2).mean()
    raise ATSError(f"answer loss must be one of {', '.join(ANSWER_LOSSES)}, got {loss_type!r}")
