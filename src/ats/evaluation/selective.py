"""Answer or abstain: the risk-coverage curve of a confidence and the areas that score it (AURC, excess AURC, PRR,
error AUPRC), the measures of "knows when it is wrong" beside the calibration metrics.

A question is answered when its confidence is >= a threshold t, else the model abstains. coverage(t) is the fraction
of questions answered, risk(t) the error rate among them.

Ties: questions of equal confidence are answered or rejected together (no order among equals is invented), so the
curve has one point per distinct confidence, each the threshold that answers every question at or above it. Every
area below is a sum over those points; without ties they are the usual per-question definitions.

With N questions, E wrong, the distinct confidences t_1 > ... > t_K, and n_k answered, e_k wrong at t_k
(n_0 = e_0 = 0):

    AURC         sum_k (n_k - n_{k-1}) / N * e_k / n_k: the mean over questions i of risk(confidence_i), the area
                 under the risk-coverage step curve (Geifman & El-Yaniv's AURC when there are no ties).
    oracle AURC  the AURC of the ordering that answers the right answers first, one question at a time:
                 (1/N) sum_{i=C+1..N} (i - C) / i, with C = N - E right answers. No ordering does better.
    excess AURC  AURC - oracle AURC (>= 0; 0: every right answer above every wrong one, no ties across them).
    PRR          the prediction-rejection ratio as LM-Polygraph defines it: the prediction-rejection curve is the mean
                 quality of the kept answers (here correctness) against the fraction rejected, rejecting the least
                 confident first, over the whole range (max_rejection = 1); PRR = (area(method) - area(random)) /
                 (area(oracle) - area(random)). With 0/1 quality that area is 1 - AURC, and random rejection keeps the
                 accuracy on average (LM-Polygraph samples it; we use its expectation), so
                 PRR = (E/N - AURC) / (E/N - oracle AURC): 1 = oracle, 0 = random, < 0 worse than random; nan when
                 every answer is right or every one wrong (nothing to rank).
    error AUPRC  the average precision of finding the wrong answers with the score 1 - confidence (sklearn's
                 `average_precision_score`): rejecting from the least confident, at each distinct confidence,
                 sum_j (recall_j - recall_{j-1}) * precision_j; nan when no answer is wrong.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from .inputs import check_pairs

SELECTIVE_KEYS = ("aurc", "excess_aurc", "prr", "error_auprc")


@dataclass
class RiskCoverage:
    """The risk-coverage curve: one point per distinct confidence, highest first (ties answered together)."""

    thresholds: np.ndarray  # (K,) the distinct confidences, decreasing
    answered: np.ndarray  # (K,) int: questions with confidence >= threshold
    errors: np.ndarray  # (K,) int: wrong answers among them
    n: int  # N, all questions

    @property
    def coverage(self) -> np.ndarray:
        """(K,) fraction of the questions answered at each threshold."""
        return self.answered / self.n

    @property
    def risk(self) -> np.ndarray:
        """(K,) error rate among the answered questions at each threshold."""
        return self.errors / self.answered


def _curve(conf: np.ndarray, corr: np.ndarray) -> RiskCoverage:
    """The curve of validated arrays (N,), (N,): sort once, keep the last question of each run of equal confidence."""
    order = np.argsort(-conf, kind="stable")  # most confident first
    sorted_conf = conf[order]
    errors = np.cumsum(corr[order] == 0)  # (N,) wrong answers among the first i + 1
    last = np.flatnonzero(np.r_[sorted_conf[1:] != sorted_conf[:-1], True])  # (K,) end of each tie group
    return RiskCoverage(sorted_conf[last], last + 1, errors[last], int(conf.size))


def risk_coverage(confidence, correct) -> RiskCoverage:
    """The risk-coverage curve at every distinct confidence (see the module docstring for the tie rule).

    Args:
        confidence: (N,) top-1 confidences in [0, 1] (array, list or tensor; flattened).
        correct: (N,) correctness, 0/1 or bool.

    Returns:
        Thresholds (K,) decreasing, answered and wrong counts (K,) at each, and N.

    Raises:
        ATSError: if the inputs are empty, differ in length, a confidence is outside [0, 1] (or nan), or a
            correctness value is not 0/1.
    """
    return _curve(*check_pairs(confidence, correct))


def oracle_aurc(n: int, n_wrong: int) -> float:
    """The AURC of answering the N - E right answers first, one at a time: (1/N) sum_{i=C+1..N} (i - C) / i.

    Args:
        n: N, the questions.
        n_wrong: E, the wrong answers among them.

    Returns:
        The oracle AURC, in [0, 1].
    """
    right = n - n_wrong
    i = np.arange(right + 1, n + 1, dtype=np.float64)  # (E,) answered counts past the last right answer
    return float(np.sum((i - right) / i) / n)


def _areas(curve: RiskCoverage) -> dict[str, float]:
    """AURC, excess AURC, PRR and error AUPRC of one curve (the module docstring's formulas)."""
    n, answered, errors = curve.n, curve.answered, curve.errors
    wrong = int(errors[-1])
    aurc = float(np.sum(np.diff(answered, prepend=0) * errors / answered) / n)
    oracle = oracle_aurc(n, wrong)
    random = wrong / n
    prr = (random - aurc) / (random - oracle) if 0 < wrong < n else math.nan
    if wrong:
        # rejecting the least confident first: at each distinct confidence (increasing), everything at or below it
        rejected = (n - np.r_[0, answered[:-1]])[::-1]  # (K,) increasing
        found = (wrong - np.r_[0, errors[:-1]])[::-1]  # (K,) wrong answers among the rejected
        error_auprc = float(np.sum(np.diff(found, prepend=0) / wrong * found / rejected))
    else:
        error_auprc = math.nan
    return {"aurc": aurc, "excess_aurc": aurc - oracle, "prr": float(prr), "error_auprc": error_auprc}


def selective_metrics(confidence, correct) -> dict[str, float]:
    """AURC, excess AURC, PRR and error AUPRC from one sort (the keys of `SELECTIVE_KEYS`).

    Args:
        confidence: (N,) top-1 confidences in [0, 1] (array, list or tensor; flattened).
        correct: (N,) correctness, 0/1 or bool.

    Returns:
        {"aurc", "excess_aurc", "prr", "error_auprc"}: floats (PRR nan when every answer is right or every one wrong,
        error AUPRC nan when none is wrong).

    Raises:
        ATSError: as `risk_coverage`.
    """
    return _areas(risk_coverage(confidence, correct))


def aurc(confidence, correct) -> float:
    """Area under the risk-coverage curve, ties answered together (lower is better); see `selective_metrics`."""
    return selective_metrics(confidence, correct)["aurc"]


def excess_aurc(confidence, correct) -> float:
    """AURC minus the oracle ordering's AURC (>= 0, lower is better); see `selective_metrics`."""
    return selective_metrics(confidence, correct)["excess_aurc"]


def prr(confidence, correct) -> float:
    """LM-Polygraph's prediction-rejection ratio (1 = oracle, 0 = random, higher is better); see `selective_metrics`."""
    return selective_metrics(confidence, correct)["prr"]


def error_auprc(confidence, correct) -> float:
    """Area under the precision-recall curve of the wrong answers, scored by 1 - confidence; see `selective_metrics`."""
    return selective_metrics(confidence, correct)["error_auprc"]
