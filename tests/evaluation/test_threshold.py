"""The certified threshold: Clopper-Pearson bounds against scipy, the fixed-sequence stop, hand-worked edge cases,
the saved record, and a seeded simulation in which the risk at the certified threshold exceeds alpha in about delta
of the calibration sets (and a threshold chosen on the empirical risk alone in half of them)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from scipy.stats import beta, binom, binomtest

from ats.errors import ATSError
from ats.evaluation.threshold import CertifiedThreshold, certify_threshold, clopper_pearson_upper


@pytest.mark.parametrize("delta", [0.05, 0.1, 0.3])
def test_bound_is_scipys_clopper_pearson(delta):
    errors = np.array([0, 1, 3, 10, 49, 0, 7])
    answered = np.array([1, 5, 20, 100, 50, 400, 7])
    bounds = clopper_pearson_upper(errors, answered, delta)
    for e, n, u in zip(errors, answered, bounds):
        if e == n:
            assert u == 1.0
            continue
        assert u == pytest.approx(beta.ppf(1 - delta, e + 1, n - e), rel=1e-10)
        # the one-sided (1 - delta) bound is the upper end of the two-sided exact (1 - 2 delta) interval
        assert u == pytest.approx(binomtest(int(e), int(n)).proportion_ci(1 - 2 * delta, method="exact").high,
                                  rel=1e-8)
        assert binom.cdf(e, n, u) == pytest.approx(delta, rel=1e-8)  # its definition
    assert clopper_pearson_upper([0], [0], delta).tolist() == [1.0]  # nothing answered: no evidence


def test_all_right_needs_enough_answers_and_all_wrong_abstains():
    # No errors among n answers: the bound is 1 - delta^(1/n), <= 0.1 at delta = 0.1 from n = 22 (0.0994) on;
    # n = 21 gives 0.1038, so nothing is certified.
    assert 1 - 0.1 ** (1 / 22) < 0.1 < 1 - 0.1 ** (1 / 21)
    conf = np.linspace(0.5, 0.9, 22)
    cert = certify_threshold(conf, np.ones(22), alpha=0.1, delta=0.1)
    assert cert.threshold == 0.5 and cert.coverage == 1.0 and cert.risk == 0.0 and cert.n == 22
    assert cert.bound == pytest.approx(1 - 0.1 ** (1 / 22))
    none = certify_threshold(conf[1:], np.ones(21), alpha=0.1, delta=0.1)
    assert none == CertifiedThreshold(threshold=None, alpha=0.1, delta=0.1, n=21, coverage=0.0, risk=None,
                                      bound=None)
    assert not none.answers([1.0, 0.0]).any()
    wrong = certify_threshold(np.linspace(0.1, 1.0, 500), np.zeros(500), alpha=0.3, delta=0.1)
    assert wrong.threshold is None and wrong.coverage == 0.0


def test_the_sequence_stops_at_the_first_failure():
    # 40 right at 0.9: bound 1 - 0.1^(1/40) = 0.056 <= 0.1, certified. Adding 10 wrong at 0.8: 10 of 50 wrong fails.
    # Adding 400 right at 0.7 would pass again (10 of 450 wrong), but the sequence stopped at 0.8.
    conf = [0.9] * 40 + [0.8] * 10 + [0.7] * 400
    correct = [1] * 40 + [0] * 10 + [1] * 400
    assert clopper_pearson_upper([10], [50], 0.1)[0] > 0.1 >= clopper_pearson_upper([10], [450], 0.1)[0]
    cert = certify_threshold(conf, correct, alpha=0.1, delta=0.1)
    assert cert.threshold == 0.9 and cert.coverage == pytest.approx(40 / 450) and cert.risk == 0.0
    assert cert.bound == pytest.approx(1 - 0.1 ** (1 / 40))
    assert cert.answers(conf).sum() == 40  # the tie group at 0.9 is answered whole, the 0.8 group not at all


def test_thresholds_too_high_to_certify_are_not_tested_and_ties_go_together():
    # One wrong answer at 0.99 and one right at 0.98: 1 or 2 answers could never be certified at alpha = 0.15 (even
    # without errors), so they do not end the sequence; the first tested threshold, 0.9, answers them with 30 right
    # ones: 1 wrong of 32, bound = Beta(0.9; 2, 31) quantile. The tie group at 0.8 (20 answers, 8 wrong) then fails.
    conf = [0.99, 0.98] + [0.9] * 30 + [0.8] * 20 + [0.7] * 300
    correct = [0, 1] + [1] * 30 + [1] * 12 + [0] * 8 + [1] * 300
    cert = certify_threshold(conf, correct, alpha=0.15, delta=0.1)
    assert cert.threshold == 0.9 and cert.risk == pytest.approx(1 / 32)
    assert cert.coverage == pytest.approx(32 / 352) and cert.bound == pytest.approx(beta.ppf(0.9, 2, 31))
    # the 0.8 group is rejected whole (no order among equals), whatever the order of its rows
    shuffled = certify_threshold(conf[::-1], correct[::-1], alpha=0.15, delta=0.1)
    assert shuffled == cert


def test_record_round_trips_through_json_and_is_validated():
    cert = certify_threshold([0.9] * 40 + [0.5] * 10, [1] * 40 + [0] * 10, alpha=0.1, delta=0.05)
    data = json.loads(json.dumps(cert.to_dict()))
    assert CertifiedThreshold.from_dict(data) == cert
    assert set(data) == {"threshold", "alpha", "delta", "n", "coverage", "risk", "bound"}
    with pytest.raises(ATSError, match="threshold.json: missing key 'bound'"):
        CertifiedThreshold.from_dict({k: v for k, v in data.items() if k != "bound"}, "threshold.json")
    with pytest.raises(ATSError, match="unknown key 'thresold'"):
        CertifiedThreshold.from_dict({**data, "thresold": 0.5})
    with pytest.raises(ATSError, match=r"alpha: expected a value in \(0.0, 1.0\), got 1.5"):
        CertifiedThreshold.from_dict({**data, "alpha": 1.5})
    with pytest.raises(ATSError, match="bound: expected risk <= bound <= alpha"):
        CertifiedThreshold.from_dict({**data, "bound": 0.2})
    with pytest.raises(ATSError, match="coverage: expected 0 when threshold is null"):
        CertifiedThreshold.from_dict({**data, "threshold": None, "risk": None, "bound": None})
    with pytest.raises(ATSError, match="risk: expected null when threshold is null"):
        CertifiedThreshold.from_dict({**data, "threshold": None, "coverage": 0.0})
    with pytest.raises(ATSError, match="n: expected"):
        CertifiedThreshold.from_dict({**data, "n": True})


@pytest.mark.parametrize("field, kwargs", [("alpha", {"alpha": 0.0, "delta": 0.1}),
                                           ("delta", {"alpha": 0.1, "delta": 1.0}),
                                           ("alpha", {"alpha": math.nan, "delta": 0.1})])
def test_bad_targets_are_named(field, kwargs):
    with pytest.raises(ATSError, match=f"{field}: expected"):
        certify_threshold([0.5], [1], **kwargs)
    with pytest.raises(ATSError, match="confidence: value 1.5 outside"):
        certify_threshold([1.5], [1], alpha=0.1, delta=0.1)


def test_realised_risk_exceeds_alpha_in_about_delta_of_calibration_sets():
    """200 seeded calibration sets of 500 answers from a known distribution: 40 confidence values (so ties), the
    probability of a wrong answer falling with the confidence except for a worse band (the risk is not monotone in
    the threshold). The exact risk R(t) = P(wrong | confidence >= t) at each certified threshold exceeds alpha in
    at most delta of the sets up to the binomial 99.9% quantile (34 of 200 at delta = 0.1; seeded, so the count is
    fixed); picking the lowest threshold whose empirical risk is <= alpha fails in about half."""
    alpha, delta, n = 0.2, 0.1, 500
    values = np.linspace(0.3, 0.99, 40)
    weight = np.linspace(1, 3, 40) / np.linspace(1, 3, 40).sum()  # P(confidence = value)
    p_wrong = 0.8 * (1 - values)
    p_wrong[24:28] += 0.3

    def risk(t: float) -> float:
        above = values >= t
        return float(np.sum(weight[above] * p_wrong[above]) / np.sum(weight[above]))

    rng = np.random.default_rng(0)
    exceeded = naive_exceeded = certified = 0
    coverage = []
    for _ in range(200):
        idx = rng.choice(40, size=n, p=weight)
        conf, correct = values[idx], rng.uniform(size=n) >= p_wrong[idx]
        cert = certify_threshold(conf, correct, alpha=alpha, delta=delta)
        if cert.threshold is not None:
            certified += 1
            coverage.append(cert.coverage)
            exceeded += risk(cert.threshold) > alpha
            assert cert.answers(conf).mean() == cert.coverage and cert.bound <= alpha
        empirical_ok = [t for t in np.unique(conf) if np.mean(~correct[conf >= t]) <= alpha]
        naive_exceeded += bool(empirical_ok) and risk(min(empirical_ok)) > alpha
    assert exceeded <= binom.ppf(0.999, 200, delta) == 34
    assert naive_exceeded >= 70  # the same test catches a threshold that is not certified
    assert certified >= 180 and np.mean(coverage) > 0.4  # and is not passed by abstaining
