"""A certified answer-or-abstain threshold: the lowest confidence threshold whose error rate among the answered
questions is at most the target risk `alpha` (`target_risk` in files, options and responses) with probability at
least 1 - `delta` (Learn-then-Test, Angelopoulos et al. 2021).

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
starts. That start, like the candidates, depends on the confidences only, never on the correctness. A start
coverage s (`start_coverage`) moves it further, to the first threshold answering at least s x n: chosen before the
answers are judged, it keeps the guarantee, and a few wrong answers among the very most confident can no longer end
the sequence (at the price of never certifying a threshold answering fewer than that). The default s,
`DEFAULT_START_COVERAGE` = 0.3, was chosen on served answers that are never reported (`start_coverage` module); 0
starts at the Clopper-Pearson minimum alone.

Assumption: the calibration questions and the questions the threshold will be used on are exchangeable (drawn
independently from one distribution, with the same calibrator). Learn-then-Test proves the guarantee for a grid of
thresholds fixed in advance; here the grid is the calibration confidences, as in practice, and the guarantee is
checked by simulation (tests/evaluation/test_threshold.py). Nothing holds for questions of another kind (another
task, a shifted mix): measure the risk there.

What is reachable is known before scoring: answering with risk <= alpha when a fraction mu of all answers is wrong
means abstaining from at least (mu - alpha) / (1 - alpha) of the questions (`abstention_floor`: even a perfect
ranking must leave out that many wrong answers), and no threshold answering fewer than `min_certifiable_answers`
questions can be certified. `smallest_certifiable_risk` gives, after the fact, the lowest target risk that the same
answers would have certified.

`read_certificate` reads a calibrator folder's `threshold.json` with what it certifies (the answer format, the
calibrator's digest, the backbone, the question sets); `Certificate.check` refuses, in one line, a calibrator or
backbone other than the recorded one. Every place that applies a threshold calls it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..checks import check_number
from ..config import ConfigMixin, option
from ..errors import ATSError
from .inputs import to_array
from .selective import risk_coverage
from .start_coverage import DEFAULT_START_COVERAGE

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
    target_risk: float = option(0.1, "the highest error rate allowed among answered questions", cli=False,
                                **_OPEN_UNIT)
    delta: float = option(0.1, "the probability allowed that the certified risk is above target_risk", cli=False,
                          **_OPEN_UNIT)
    n: int = option(1, "labelled answers the threshold was certified on", cli=False, low=1)
    coverage: float = option(0.0, "fraction of those answered at the threshold", cli=False, **_UNIT)
    risk: float | None = option(None, "error rate among those answered (None: none answered)", cli=False, **_UNIT)
    bound: float | None = option(None, "upper (1 - delta) confidence bound on the risk at the threshold (None: none "
                                       "certified)", cli=False, **_UNIT)

    def validate(self) -> None:
        """The field checks, then consistency: an abstain-always record has no coverage, risk or bound; a
        certified one answers some questions with risk <= bound <= target_risk.

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
        if not self.risk <= self.bound <= self.target_risk:
            raise ATSError(f"bound: expected risk <= bound <= target_risk, got risk {self.risk!r}, bound "
                           f"{self.bound!r}, target_risk {self.target_risk!r}")

    @property
    def alpha(self) -> float:
        """The target risk under its old name (files written before the rename said "alpha")."""
        return self.target_risk

    @classmethod
    def from_dict(cls, data: dict, where: str = "threshold", *, ignore=()) -> "CertifiedThreshold":
        """The record from `to_dict`'s output; every field is required (a certificate has no defaults). A record
        written before the rename, with "alpha" for the target risk, is read too.

        Raises:
            ATSError: naming `where` and the key or value at fault.
        """
        if isinstance(data, dict) and "alpha" in data and "target_risk" not in data:
            data = {("target_risk" if k == "alpha" else k): v for k, v in data.items()}
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

    def decide(self, confidence: float | None) -> dict:
        """The decision on one answer as `ats serve`, `ats generate` and the vLLM client report it.

        Args:
            confidence: the answer's calibrated confidence; None or not finite (no answer tokens): abstain.

        Returns:
            {"answered": bool, "threshold", "target_risk", "delta"}.
        """
        usable = confidence is not None and bool(np.isfinite(confidence))
        return {"answered": usable and bool(self.answers([confidence])[0]), "threshold": self.threshold,
                "target_risk": self.target_risk, "delta": self.delta}


def certify_threshold(confidence, correct, *, target_risk: float | None = None, delta: float,
                      alpha: float | None = None,
                      start_coverage: float = DEFAULT_START_COVERAGE) -> CertifiedThreshold:
    """The lowest confidence threshold certified to keep the selective risk <= `target_risk` with probability
    >= 1 - delta (the module docstring gives the method and its assumption).

    Args:
        confidence: (N,) calibrated confidences of labelled answers the calibrator was not fitted on.
        correct: (N,) their correctness, 0/1 or bool.
        target_risk: the target risk alpha, in (0, 1).
        delta: the probability allowed that the risk at the returned threshold exceeds the target, in (0, 1).
        alpha: the old name of `target_risk` (deprecated).
        start_coverage: the sequence starts at the first threshold answering at least this fraction of the answers
            (and the Clopper-Pearson minimum), so that a few wrong answers at the very top cannot end it; fixed in
            advance, like the order, it depends on no correctness and keeps the guarantee. 0: the minimum alone.
            Default `DEFAULT_START_COVERAGE`.

    Returns:
        The threshold with its coverage, empirical risk and bound on these answers; threshold None (abstain always)
        when no threshold is certified.

    Raises:
        ATSError: if the target risk or delta is outside (0, 1), or the inputs are invalid (see `risk_coverage`).
    """
    if (target_risk is None) == (alpha is None):
        raise ATSError("certify_threshold: give target_risk (alpha is its deprecated name), exactly once")
    target_risk = check_number("target_risk", alpha if target_risk is None else target_risk, **_OPEN_UNIT)
    delta = check_number("delta", delta, **_OPEN_UNIT)
    start_coverage = check_number("start_coverage", start_coverage, low=0.0, high=1.0)
    curve = risk_coverage(confidence, correct)
    bounds = clopper_pearson_upper(curve.errors, curve.answered, delta)  # (K,)
    fewest = max(min_certifiable_answers(target_risk, delta), int(np.ceil(start_coverage * curve.n - 1e-9)))
    testable = curve.answered >= fewest  # (K,)
    start = int(np.argmax(testable)) if testable.any() else curve.answered.size  # answered grows down the curve
    failed = np.flatnonzero(bounds[start:] > target_risk)
    stop = start + (int(failed[0]) if failed.size else bounds.size - start)  # the first failure, or past the end
    if stop == start:
        return CertifiedThreshold(threshold=None, target_risk=target_risk, delta=delta, n=curve.n)
    k = stop - 1  # the lowest threshold certified before the first failure
    risk = float(curve.errors[k] / curve.answered[k])
    return CertifiedThreshold(threshold=float(curve.thresholds[k]), target_risk=target_risk, delta=delta, n=curve.n,
                              coverage=float(curve.answered[k] / curve.n), risk=risk, bound=float(bounds[k]))


# --- what is reachable -----------------------------------------------------------------------------------------------
def min_certifiable_answers(target_risk: float, delta: float) -> int:
    """The fewest answered questions that can certify `target_risk` at `delta`: the smallest n whose Clopper-Pearson
    bound with 0 errors, 1 - delta^(1/n), is <= target_risk (n >= ln(delta) / ln(1 - target_risk); 22 at 0.1, 0.1).

    Raises:
        ATSError: if an argument is outside (0, 1).
    """
    target_risk = check_number("target_risk", target_risk, **_OPEN_UNIT)
    delta = check_number("delta", delta, **_OPEN_UNIT)
    n = max(1, int(np.ceil(np.log(delta) / np.log1p(-target_risk))))
    while n > 1 and clopper_pearson_upper([0], [n - 1], delta)[0] <= target_risk:  # the formula's rounding, both ways
        n -= 1
    while clopper_pearson_upper([0], [n], delta)[0] > target_risk:
        n += 1
    return n


def abstention_floor(error_rate: float, target_risk: float) -> float:
    """The least fraction of questions that must be abstained from to answer the rest with risk <= `target_risk`
    when a fraction `error_rate` (mu) of all answers is wrong: max(0, (mu - alpha) / (1 - alpha)), reached only when
    every abstention is a wrong answer (a perfect ranking)."""
    return max(0.0, (error_rate - target_risk) / (1.0 - target_risk))


def unreachable(error_rate: float, n: int, target_risk: float, delta: float, *,
                start_coverage: float = DEFAULT_START_COVERAGE) -> str | None:
    """Why `target_risk` cannot be certified at `delta` on `n` questions of which a fraction `error_rate` is
    answered wrong, or None when it may be: even with a perfect ranking at most n x (1 - `abstention_floor`) are
    answered, and fewer than `min_certifiable_answers` (or a `start_coverage` of the n) certify nothing.

    Returns:
        A one-line reason naming the floor, the minimum and the size that would do, or None.
    """
    floor = abstention_floor(error_rate, target_risk)
    fewest = min_certifiable_answers(target_risk, delta)
    need = max(fewest, int(np.ceil(start_coverage * n - 1e-9)))
    most = n * (1.0 - floor)
    if most >= need:
        return None
    if floor >= 1.0 or start_coverage > 1.0 - floor:
        size = "no size will do" + (f" from a start coverage of {start_coverage:g}" if floor < 1.0 else "")
    else:
        size = f"at least {int(np.ceil(fewest / (1.0 - floor)))} questions"
    return (f"target risk {target_risk:g} cannot be certified at delta {delta:g} on {n} questions: with an error rate "
            f"of {error_rate:.3f} at least {100 * floor:.1f}% must be abstained from ((mu - alpha) / (1 - alpha)), "
            f"leaving at most {most:.0f} answered, and certifying needs {need} answered "
            + ("(the start coverage)" if need > fewest else "even with no error (Clopper-Pearson)")
            + f"; {size}, or a higher target risk")


def smallest_certifiable_risk(confidence, correct, delta: float, *,
                              start_coverage: float = DEFAULT_START_COVERAGE) -> float | None:
    """The lowest target risk that `certify_threshold` (with `start_coverage`) would certify a threshold for on these
    answers at `delta` (None: none below 1). Whether a target passes changes only where it crosses a bound of the
    risk-coverage curve or the zero-error bound of an answered count, so those values are the candidates, each
    tried."""
    curve = risk_coverage(confidence, correct)
    zero = clopper_pearson_upper(np.zeros_like(curve.answered), curve.answered, delta)
    candidates = np.unique(np.concatenate([clopper_pearson_upper(curve.errors, curve.answered, delta), zero]))
    for value in candidates[(candidates > 0) & (candidates < 1)]:  # increasing
        if certify_threshold(confidence, correct, target_risk=float(value), delta=delta,
                             start_coverage=start_coverage).threshold is not None:
            return float(value)
    return None


# --- the saved certificate -------------------------------------------------------------------------------------------
THRESHOLD_NAME = "threshold.json"  # a calibrator folder's certified threshold (`ats certify`), read by serve / generate


def template_digest(tokenizer) -> str | None:
    """A digest of a tokenizer's chat template, which shapes every served answer (None without one)."""
    from ..fingerprint import digest

    template = getattr(tokenizer, "chat_template", None)
    return None if not template else digest(str(template))


def backbone_identity(backbone) -> dict:
    """What a certificate records of a backbone, and what `Certificate.check` compares: `describe()` (name,
    revision, sizes) and its chat template's digest (`template_digest`)."""
    return {**backbone.describe(), "chat_template": template_digest(backbone.tokenizer)}


@dataclass(frozen=True)
class Certificate:
    """A saved threshold with what it certifies: `served` = {"format": how the answers were produced and judged,
    "calibrator": the calibrator's digest (None: the uncalibrated model), "backbone": `backbone_identity`}, and the
    question sets it was certified on (`sets`). `path` is its file."""

    threshold: CertifiedThreshold
    served: dict
    sets: list
    path: str

    def check(self, *, backbone: dict, calibrator: str | None) -> None:
        """Refuse to apply the threshold with another calibrator or backbone than it was certified for.

        Args:
            backbone: the backbone in use, as `backbone_identity` gives it (only its keys are compared: a caller
                that cannot see the chat template leaves it out).
            calibrator: the digest of the calibrator in use (`Calibrator.digest()`), None for none.

        Raises:
            ATSError: one line naming the file, the field, the recorded and the actual value.
        """
        recorded = self.served.get("calibrator")
        if recorded != calibrator:
            raise ATSError(f"{self.path}: field served.calibrator is {recorded!r} but the calibrator in use has digest "
                           f"{calibrator!r}: the threshold holds only for the calibrator it was certified with; "
                           f"re-run ats certify")
        for key, actual in backbone.items():
            value = (self.served.get("backbone") or {}).get(key)
            if value != actual:
                raise ATSError(f"{self.path}: field served.backbone.{key} is {value!r} but the backbone in use has "
                               f"{actual!r}: the threshold holds only for the backbone it was certified on; re-run "
                               f"ats certify")


    def check_loaded(self, backbone, calibrator) -> CertifiedThreshold:
        """`check` against a loaded backbone and calibrator (None: none); returns the threshold to apply."""
        self.check(backbone=backbone_identity(backbone), calibrator=None if calibrator is None else calibrator.digest())
        return self.threshold

    def outside(self, *, max_tokens: int | None, chat_template: bool, sampled: bool = False,
                stops: bool = False, ignore_eos: bool = False, steered: str | None = None) -> str | None:
        """Why answers made with `max_tokens` (None: up to the context length), with or without the chat template,
        sampled or greedy, with or without stop strings, run past end-of-sequence or not, steered by a request
        option or not (`steered`: its name, e.g. "min_tokens"), are not in the certified format (None: they are, as
        far as these go)."""
        fmt = self.served.get("format") or {}
        if sampled or stops or ignore_eos or steered:
            how = ("sampled" if sampled else "cut by stop strings" if stops
                   else "run past end-of-sequence (ignore_eos)" if ignore_eos else f"steered by {steered}")
            return (f"{self.path} certifies greedy answers stopped only by end-of-sequence, and this one is {how}: "
                    f"outside what it certifies")
        if bool(fmt.get("chat_template")) and not chat_template:
            return f"{self.path} certifies answers through the chat template, and this one is made without it"
        if fmt.get("max_tokens") != max_tokens:
            limit = "up to the context length" if max_tokens is None else max_tokens
            return (f"{self.path} certifies answers of at most {fmt.get('max_tokens')} new tokens, and this one may "
                    f"have {limit}: answers cut at another length are outside what it certifies")
        return None

    def format_fields(self, **request) -> dict:
        """The `ats` field's per-request word on the format (`outside`'s arguments): {"certified_format": whether
        the answer is made as the certified ones were, "outside_certificate": why not, in one line, or None}. Both
        servers (`ats serve`, and vLLM's through `ats serve --engine vllm`) report it beside the decision, which
        holds only inside."""
        reason = self.outside(**request)
        return {"certified_format": reason is None, "outside_certificate": reason}


def read_certificate(folder) -> Certificate | None:
    """The certificate saved in a calibrator folder (`threshold.json`, written by `ats certify`), or None when the
    folder has none.

    Raises:
        ATSError: naming the file, if it is not a valid record, or was written before certificates recorded what
            they certify (the served answer format, the calibrator, the backbone): re-run `ats certify`.
    """
    from pathlib import Path

    from ..io import read_json

    path = Path(folder) / THRESHOLD_NAME
    if not path.exists():
        return None
    record = read_json(path)  # a folder in its place is named, not taken for no certificate
    if not isinstance(record, dict) or "threshold" not in record:
        raise ATSError(f"{path}: missing key 'threshold' (write it with ats certify)")
    threshold = CertifiedThreshold.from_dict(record["threshold"], where=f"{path}: threshold")
    served = record.get("served")
    if not isinstance(served, dict) or not all(k in served for k in ("format", "calibrator", "backbone")):
        raise ATSError(f"{path}: missing key 'served' (the answer format, calibrator and backbone it certifies): "
                       f"written by an older ats certify on few-shot answers, not served ones; re-run ats certify "
                       f"--overwrite")
    return Certificate(threshold, served, list(record.get("sets") or []), str(path))


def read_threshold(folder) -> CertifiedThreshold | None:
    """The certified threshold saved in a calibrator folder (`read_certificate`'s), or None when it has none."""
    certificate = read_certificate(folder)
    return None if certificate is None else certificate.threshold
