"""A certified answer-or-abstain threshold: the lowest confidence threshold whose error rate among the answered
questions is at most `alpha` with probability at least 1 - `delta` (Learn-then-Test, Angelopoulos et al. 2021).

On n labelled answers the calibrator was NOT fitted on, each candidate threshold t (a distinct confidence, questions
of equal confidence answered together: the tie rule of selective.py) answers n_t of them with e_t wrong. The
Clopper-Pearson upper bound u_t on the selective risk R(t) = P(wrong | confidence >= t) of a new question is the u
with P(Binomial(n_t, u) <= e_t) = delta, so u_t <= alpha exactly when the binomial test of "R(t) > alpha" rejects at
level delta. The candidates are tested from the highest threshold down (fixed-sequence testing); the first that
fails ends the sequence, and the lowest threshold certified before it is returned. Because it stops at the first
failure, the sequence needs no correction for the number of thresholds tried: with probability >= 1 - delta over
the calibration answers, R(returned threshold) <= alpha.

Thresholds that answer so few questions that no outcome could certify them (u_t > alpha even with e_t = 0, i.e.
n_t < ln(delta) / ln(1 - alpha): 22 at alpha = delta = 0.1) are not tested: they would end the sequence before it
starts. That start, like the candidates, depends on the confidences only, never on the correctness.

Assumption: the calibration questions and the questions the threshold will be used on are exchangeable (drawn
independently from one distribution, with the same calibrator). Learn-then-Test proves the guarantee for a grid of
thresholds fixed in advance; here the grid is the calibration confidences, as in practice, and the guarantee is
checked by simulation (tests/evaluation/test_threshold.py). Nothing holds for questions of another kind (another
task, a shifted mix): measure the risk there.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..checks import check_number
from ..config import ConfigMixin, option
from ..errors import ATSError
from .inputs import to_array
from .selective import risk_coverage

_UNIT = {"low": 0.0, "high": 1.0}
_OPEN_UNIT = {"low": 0.0, "high": 1.0, "low_open": True, "high_open": True}


def clopper_pearson_upper(errors, answered, delta: float) -> np.ndarray:
    """One-sided (1 - delta) Clopper-Pearson upper bounds on binomial error rates: the u with
    P(Binomial(n, u) <= e) = delta, i.e. the (1 - delta) quantile of Beta(e + 1, n - e); 1 when e = n (n = 0 too).

    Args:
        errors: (K,) wrong answers e.
        answered: (K,) answered questions n >= e.
        delta: the probability that the bound is too low, in (0, 1).

    Returns:
        (K,) float64 upper bounds in [0, 1].
    """
    from scipy.special import betaincinv  # scipy comes with scikit-learn; imported only here

    e = np.asarray(errors, dtype=np.float64)
    n = np.asarray(answered, dtype=np.float64)
    below = e < n
    out = np.ones(np.broadcast(e, n).shape)
    out[below] = betaincinv(e[below] + 1.0, n[below] - e[below], 1.0 - delta)
    return out


@dataclass
class CertifiedThreshold(ConfigMixin):
    """An answer-or-abstain threshold and what certified it (JSON with `to_dict` / `from_dict`, validated).

    threshold None means abstain always: no threshold was certified.
    """

    threshold: float | None = option(None, "answer when the confidence is >= this; None: abstain always", cli=False,
                                     **_UNIT)
    alpha: float = option(0.1, "target risk: the highest error rate allowed among answered questions", cli=False,
                          **_OPEN_UNIT)
    delta: float = option(0.1, "the probability allowed that the certified risk is above alpha", cli=False,
                          **_OPEN_UNIT)
    n: int = option(1, "labelled answers the threshold was certified on", cli=False, low=1)
    coverage: float = option(0.0, "fraction of those answered at the threshold", cli=False, **_UNIT)
    risk: float | None = option(None, "error rate among those answered (None: none answered)", cli=False, **_UNIT)
    bound: float | None = option(None, "upper (1 - delta) confidence bound on the risk at the threshold (None: none "
                                       "certified)", cli=False, **_UNIT)

    def validate(self) -> None:
        """The field checks, then consistency: an abstain-always record has no coverage, risk or bound; a
        certified one answers some questions with risk <= bound <= alpha.

        Raises:
            ATSError: naming the first field that fails.
        """
        super().validate()
        if self.threshold is None:
            for name in ("risk", "bound"):
                if getattr(self, name) is not None:
                    raise ATSError(f"{name}: expected null when threshold is null (abstain always), got "
                                   f"{getattr(self, name)!r}")
            if self.coverage != 0.0:
                raise ATSError(f"coverage: expected 0 when threshold is null (abstain always), got {self.coverage!r}")
            return
        if self.coverage == 0.0 or self.risk is None or self.bound is None:
            raise ATSError("threshold: a certified threshold needs coverage > 0, a risk and a bound; got coverage "
                           f"{self.coverage!r}, risk {self.risk!r}, bound {self.bound!r}")
        if not self.risk <= self.bound <= self.alpha:
            raise ATSError(f"bound: expected risk <= bound <= alpha, got risk {self.risk!r}, bound {self.bound!r}, "
                           f"alpha {self.alpha!r}")

    @classmethod
    def from_dict(cls, data: dict, where: str = "threshold", *, ignore=()) -> "CertifiedThreshold":
        """The record from `to_dict`'s output; every field is required (a certificate has no defaults).

        Raises:
            ATSError: naming `where` and the key or value at fault.
        """
        if isinstance(data, dict):
            missing = [name for name in cls.__dataclass_fields__ if name not in data and name not in set(ignore)]
            if missing:
                raise ATSError(f"{where}: missing key {missing[0]!r}")
        return super().from_dict(data, where, ignore=ignore)

    def answers(self, confidence) -> np.ndarray:
        """Whether each question is answered: confidence >= threshold (never, when abstaining always).

        Args:
            confidence: (N,) confidences (array, list or tensor; flattened).

        Returns:
            (N,) bool.
        """
        conf = to_array(confidence, "confidence")
        if self.threshold is None:
            return np.zeros(conf.shape, dtype=bool)
        return conf >= self.threshold


def certify_threshold(confidence, correct, *, alpha: float, delta: float) -> CertifiedThreshold:
    """The lowest confidence threshold certified to keep the selective risk <= alpha with probability >= 1 - delta
    (the module docstring gives the method and its assumption).

    Args:
        confidence: (N,) calibrated confidences of labelled answers the calibrator was not fitted on.
        correct: (N,) their correctness, 0/1 or bool.
        alpha: the target risk, in (0, 1).
        delta: the probability allowed that the risk at the returned threshold exceeds alpha, in (0, 1).

    Returns:
        The threshold with its coverage, empirical risk and bound on these answers; threshold None (abstain always)
        when no threshold is certified.

    Raises:
        ATSError: if alpha or delta is outside (0, 1), or the inputs are invalid (see `risk_coverage`).
    """
    alpha = check_number("alpha", alpha, **_OPEN_UNIT)
    delta = check_number("delta", delta, **_OPEN_UNIT)
    curve = risk_coverage(confidence, correct)
    bounds = clopper_pearson_upper(curve.errors, curve.answered, delta)  # (K,)
    testable = clopper_pearson_upper(np.zeros_like(curve.answered), curve.answered, delta) <= alpha  # (K,)
    start = int(np.argmax(testable)) if testable.any() else curve.answered.size  # answered grows down the curve
    failed = np.flatnonzero(bounds[start:] > alpha)
    stop = start + (int(failed[0]) if failed.size else bounds.size - start)  # the first failure, or past the end
    if stop == start:
        return CertifiedThreshold(threshold=None, alpha=alpha, delta=delta, n=curve.n)
    k = stop - 1  # the lowest threshold certified before the first failure
    risk = float(curve.errors[k] / curve.answered[k])
    return CertifiedThreshold(threshold=float(curve.thresholds[k]), alpha=alpha, delta=delta, n=curve.n,
                              coverage=float(curve.answered[k] / curve.n), risk=risk, bound=float(bounds[k]))


THRESHOLD_NAME = "threshold.json"  # a calibrator folder's certified threshold (`ats certify`), read by serve / generate


def read_threshold(folder) -> CertifiedThreshold | None:
    """The certified threshold saved in a calibrator folder (`threshold.json`, written by `ats certify`), or None
    when the folder has none.

    Raises:
        ATSError: naming the file, if it is not a valid record.
    """
    from pathlib import Path

    from ..io import read_json

    path = Path(folder) / THRESHOLD_NAME
    if not path.is_file():
        return None
    record = read_json(path)
    if not isinstance(record, dict) or "threshold" not in record:
        raise ATSError(f"{path}: missing key 'threshold' (write it with ats certify)")
    return CertifiedThreshold.from_dict(record["threshold"], where=f"{path}: threshold")
