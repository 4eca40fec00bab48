"""The answer-confidence rules: how one number in [0, 1] is read off a model's scores for an answer. One place, so
that evaluation (the tasks' scoring), training (answer-level losses, differentiated), generation and serving (the
`answer_confidence` of a generated answer) compute the same confidence.

- Multiple choice: the softmax over the choices' scores, at its argmax (`softmax_confidence`).
- Free-form: the mean of the answer tokens' probabilities (`mean_token_confidence`).

Both work on torch tensors (differentiable); `mean_token_confidence` also on numpy arrays. `ANSWER_MAX_TOKENS` is
the default length of a generated answer (`ats generate`, and the answers `ats certify` certifies), whose mean
token confidence it bounds. The module imports nothing heavy, so the command line can read that default at once.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch import Tensor

ANSWER_MAX_TOKENS = 64  # new tokens at most of `ats generate` and of the answers `ats certify` certifies


def softmax_confidence(scores: Tensor) -> tuple[Tensor, Tensor]:
    """(confidence, prediction) of a multiple-choice answer: the softmax over its choices' scores, at its argmax.

    The one rule of both multiple-choice scorings (letters: the calibrated letter logits; likelihood: the summed
    calibrated log-likelihoods; `ats.evaluation.tasks.scoring`), and of answer-level training, where it is
    differentiated.

    Args:
        scores: (B, n) one row per question; -inf on absent choices (rows with fewer choices).

    Returns:
        (confidence (B,), prediction (B,) long).
    """
    return scores.softmax(dim=-1).max(dim=-1)


def mean_token_confidence(p, valid):
    """A free-form answer's confidence: the mean of its token probabilities `p` (..., K) where `valid` (..., K);
    tensors or numpy arrays."""
    return (p * valid).sum(-1) / valid.sum(-1)
