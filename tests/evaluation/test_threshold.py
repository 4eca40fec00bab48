"""The certified threshold: Clopper-Pearson bounds against scipy, the fixed-sequence stop, hand-worked edge cases,
the saved record, and a seeded simulation in which the risk at the certified threshold exceeds alpha in about delta
of the calibration sets (and a threshold chosen on the empirical risk alone in half of them)."""

from __future__ import annotations

import json
import math
import re

import numpy as np
import pytest
from scipy.stats import beta, binom, binomtest

from ats.errors import ATSError
from ats.evaluation.threshold import (
    DEFAULT_START_COVERAGE,
    THRESHOLD_NAME,
    CertifiedThreshold,
    abstention_floor,
    certify_threshold,
    clopper_pearson_upper,
    min_certifiable_answers,
    read_certificate,
    smallest_certifiable_risk,
    unreachable,
)
from ats.io import write_json

FROM_FEWEST = {"start_coverage": 0.0}  # the sequence from the fewest answers that can certify: the method's own start


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
    cert = certify_threshold(conf, np.ones(22), target_risk=0.1, delta=0.1, **FROM_FEWEST)
    assert cert.threshold == 0.5 and cert.coverage == 1.0 and cert.risk == 0.0 and cert.n == 22
    assert cert.bound == pytest.approx(1 - 0.1 ** (1 / 22))
    none = certify_threshold(conf[1:], np.ones(21), target_risk=0.1, delta=0.1, **FROM_FEWEST)
    assert none == CertifiedThreshold(threshold=None, target_risk=0.1, delta=0.1, n=21, coverage=0.0, risk=None,
                                      bound=None)
    assert not none.answers([1.0, 0.0]).any()
    wrong = certify_threshold(np.linspace(0.1, 1.0, 500), np.zeros(500), target_risk=0.3, delta=0.1, **FROM_FEWEST)
    assert wrong.threshold is None and wrong.coverage == 0.0


def test_the_sequence_stops_at_the_first_failure():
    # 40 right at 0.9: bound 1 - 0.1^(1/40) = 0.056 <= 0.1, certified. Adding 10 wrong at 0.8: 10 of 50 wrong fails.
    # Adding 400 right at 0.7 would pass again (10 of 450 wrong), but the sequence stopped at 0.8.
    conf = [0.9] * 40 + [0.8] * 10 + [0.7] * 400
    correct = [1] * 40 + [0] * 10 + [1] * 400
    assert clopper_pearson_upper([10], [50], 0.1)[0] > 0.1 >= clopper_pearson_upper([10], [450], 0.1)[0]
    cert = certify_threshold(conf, correct, target_risk=0.1, delta=0.1, **FROM_FEWEST)
    assert cert.threshold == 0.9 and cert.coverage == pytest.approx(40 / 450) and cert.risk == 0.0
    assert cert.bound == pytest.approx(1 - 0.1 ** (1 / 40))
    assert cert.answers(conf).sum() == 40  # the tie group at 0.9 is answered whole, the 0.8 group not at all


def test_by_default_the_sequence_starts_at_30_percent_and_passes_over_a_wrong_band_above_it():
    # The case above: 0.9 answers 40 of 450 (9%), 0.8 answers 50 (11%), both below 30% (135), so the default start
    # is the first threshold answering at least 135: 0.7, all 450 with 10 wrong, bound 0.034 <= 0.1.
    conf = [0.9] * 40 + [0.8] * 10 + [0.7] * 400
    correct = [1] * 40 + [0] * 10 + [1] * 400
    assert DEFAULT_START_COVERAGE == 0.3
    cert = certify_threshold(conf, correct, target_risk=0.1, delta=0.1)
    assert cert == certify_threshold(conf, correct, target_risk=0.1, delta=0.1, start_coverage=0.3)
    assert cert.threshold == 0.7 and cert.coverage == 1.0 and cert.risk == pytest.approx(10 / 450)
    assert cert.bound == pytest.approx(beta.ppf(0.9, 11, 440))
    assert smallest_certifiable_risk(conf, correct, 0.1) == pytest.approx(beta.ppf(0.9, 11, 440))
    # a perfect ranking that only its top 20% can meet: the default start certifies nothing, the fewest does
    top = [1] * 40 + [0] * 160
    assert certify_threshold(np.linspace(1, 0, 200), top, target_risk=0.1, delta=0.1).threshold is None
    fewest = certify_threshold(np.linspace(1, 0, 200), top, target_risk=0.1, delta=0.1, **FROM_FEWEST)
    assert fewest.coverage == 41 / 200  # the 40 right and 1 wrong: bound 0.092; 2 wrong of 42 fail (0.125)
    assert beta.ppf(0.9, 2, 40) <= 0.1 < beta.ppf(0.9, 3, 40)
    assert unreachable(0.8, 200, 0.1, 0.1) is not None and unreachable(0.8, 200, 0.1, 0.1, **FROM_FEWEST) is None


def test_thresholds_too_high_to_certify_are_not_tested_and_ties_go_together():
    # One wrong answer at 0.99 and one right at 0.98: 1 or 2 answers could never be certified at alpha = 0.15 (even
    # without errors), so they do not end the sequence; the first tested threshold, 0.9, answers them with 30 right
    # ones: 1 wrong of 32, bound = Beta(0.9; 2, 31) quantile. The tie group at 0.8 (20 answers, 8 wrong) then fails.
    conf = [0.99, 0.98] + [0.9] * 30 + [0.8] * 20 + [0.7] * 300
    correct = [0, 1] + [1] * 30 + [1] * 12 + [0] * 8 + [1] * 300
    cert = certify_threshold(conf, correct, target_risk=0.15, delta=0.1, **FROM_FEWEST)
    assert cert.threshold == 0.9 and cert.risk == pytest.approx(1 / 32)
    assert cert.coverage == pytest.approx(32 / 352) and cert.bound == pytest.approx(beta.ppf(0.9, 2, 31))
    # the 0.8 group is rejected whole (no order among equals), whatever the order of its rows
    shuffled = certify_threshold(conf[::-1], correct[::-1], target_risk=0.15, delta=0.1, **FROM_FEWEST)
    assert shuffled == cert


def test_a_start_coverage_keeps_a_few_wrong_answers_at_the_top_from_ending_the_sequence():
    # alpha 0.5, delta 0.1: 4 answers are the fewest that can certify (0.5^4 <= 0.1 < 0.5^3). The 4 most confident
    # answers are wrong, one per threshold: the first tested threshold, 0.96, has 4 of 4 wrong and ends the sequence.
    # Started at half the answers, it first tests 0.9: 24 wrong of 100, bound Beta(0.9; 25, 76) <= 0.5, certified.
    conf = [0.99, 0.98, 0.97, 0.96] + [0.9] * 96
    correct = [0] * 4 + [1] * 76 + [0] * 20
    assert certify_threshold(conf, correct, target_risk=0.5, delta=0.1, **FROM_FEWEST).threshold is None
    cert = certify_threshold(conf, correct, target_risk=0.5, delta=0.1, start_coverage=0.5)
    assert cert.threshold == 0.9 and cert.coverage == 1.0 and cert.risk == pytest.approx(0.24)
    assert cert.bound == pytest.approx(beta.ppf(0.9, 25, 76))
    assert smallest_certifiable_risk(conf, correct, 0.1, start_coverage=0.5) == pytest.approx(beta.ppf(0.9, 25, 76))
    assert certify_threshold(conf, correct, target_risk=0.5, delta=0.1) == cert  # the default start, 30%, too
    with pytest.raises(ATSError, match="start_coverage"):
        certify_threshold(conf, correct, target_risk=0.5, delta=0.1, start_coverage=1.5)


def test_record_round_trips_through_json_and_is_validated():
    cert = certify_threshold([0.9] * 40 + [0.5] * 10, [1] * 40 + [0] * 10, target_risk=0.1, delta=0.05, **FROM_FEWEST)
    data = json.loads(json.dumps(cert.to_dict()))
    assert CertifiedThreshold.from_dict(data) == cert
    assert set(data) == {"threshold", "target_risk", "delta", "n", "coverage", "risk", "bound"}
    old = {("alpha" if k == "target_risk" else k): v for k, v in data.items()}  # written before the rename
    assert CertifiedThreshold.from_dict(old) == cert and cert.alpha == cert.target_risk == 0.1
    with pytest.raises(ATSError, match="threshold.json: missing key 'bound'"):
        CertifiedThreshold.from_dict({k: v for k, v in data.items() if k != "bound"}, "threshold.json")
    with pytest.raises(ATSError, match="unknown key 'thresold'"):
        CertifiedThreshold.from_dict({**data, "thresold": 0.5})
    with pytest.raises(ATSError, match=r"target_risk: expected a value in \(0.0, 1.0\), got 1.5"):
        CertifiedThreshold.from_dict({**data, "target_risk": 1.5})
    with pytest.raises(ATSError, match="bound: expected risk <= bound <= target_risk"):
        CertifiedThreshold.from_dict({**data, "bound": 0.2})
    with pytest.raises(ATSError, match="coverage: expected 0 when threshold is null"):
        CertifiedThreshold.from_dict({**data, "threshold": None, "risk": None, "bound": None})
    with pytest.raises(ATSError, match="risk: expected null when threshold is null"):
        CertifiedThreshold.from_dict({**data, "threshold": None, "coverage": 0.0})
    with pytest.raises(ATSError, match="n: expected"):
        CertifiedThreshold.from_dict({**data, "n": True})


@pytest.mark.parametrize("field, kwargs", [("target_risk", {"target_risk": 0.0, "delta": 0.1}),
                                           ("delta", {"target_risk": 0.1, "delta": 1.0}),
                                           ("target_risk", {"target_risk": math.nan, "delta": 0.1}),
                                           ("target_risk", {"alpha": 1.0, "delta": 0.1})])  # its old name
def test_bad_targets_are_named(field, kwargs):
    with pytest.raises(ATSError, match=f"{field}: expected"):
        certify_threshold([0.5], [1], **kwargs)
    with pytest.raises(ATSError, match="confidence: value 1.5 outside"):
        certify_threshold([1.5], [1], target_risk=0.1, delta=0.1)


@pytest.mark.parametrize("start_coverage", [0.0, 0.2])
def test_realised_risk_exceeds_alpha_in_about_delta_of_calibration_sets(start_coverage):
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
        cert = certify_threshold(conf, correct, target_risk=alpha, delta=delta, start_coverage=start_coverage)
        if cert.threshold is not None:
            certified += 1
            coverage.append(cert.coverage)
            exceeded += risk(cert.threshold) > alpha
            assert cert.answers(conf).mean() == cert.coverage and cert.bound <= alpha
            assert cert.coverage >= start_coverage
        empirical_ok = [t for t in np.unique(conf) if np.mean(~correct[conf >= t]) <= alpha]
        naive_exceeded += bool(empirical_ok) and risk(min(empirical_ok)) > alpha
    assert exceeded <= binom.ppf(0.999, 200, delta) == 34
    assert naive_exceeded >= 70  # the same test catches a threshold that is not certified
    assert certified >= 180 and np.mean(coverage) > 0.4  # and is not passed by abstaining


@pytest.mark.parametrize("target, delta, n", [(0.1, 0.1, 22), (0.05, 0.05, 59), (0.2, 0.1, 11), (0.01, 0.1, 230)])
def test_min_certifiable_answers_is_the_first_zero_error_bound_at_or_below_the_target(target, delta, n):
    # n >= ln(delta) / ln(1 - target): 21.85 -> 22, 58.40 -> 59, 10.32 -> 11, 229.1 -> 230; scipy's Beta quantile
    # (the Clopper-Pearson bound with 0 errors) crosses the target between n - 1 and n
    assert min_certifiable_answers(target, delta) == n == math.ceil(math.log(delta) / math.log(1 - target))
    assert beta.ppf(1 - delta, 1, n) <= target < beta.ppf(1 - delta, 1, n - 1)


def test_a_start_coverage_above_what_a_perfect_ranking_keeps_is_unreachable_at_any_size():
    # 80% wrong, target 0.7: at least (0.8 - 0.7) / 0.3 = 1/3 must be abstained from, so at most 400 of 600 answered;
    # started at 5% (30 answers) that may pass, started at 80% (480 answers) it cannot, however many questions
    assert abstention_floor(0.8, 0.7) == pytest.approx(1 / 3)
    assert unreachable(0.8, 600, 0.7, 0.1, start_coverage=0.05) is None
    why = unreachable(0.8, 600, 0.7, 0.1, start_coverage=0.8)
    assert "leaving at most 400 answered, and certifying needs 480 answered (the start coverage)" in why
    assert "no size will do from a start coverage of 0.8" in why


def test_abstention_floor_and_unreachable_targets_by_hand():
    assert abstention_floor(0.4, 0.1) == pytest.approx(1 / 3)  # (0.4 - 0.1) / 0.9
    assert abstention_floor(0.05, 0.1) == 0.0 and abstention_floor(1.0, 0.1) == 1.0
    # 100 questions, 40% wrong, target 0.1: at most 100 x 2/3 = 66.7 answered >= 22, so it may be reachable
    assert unreachable(0.4, 100, 0.1, 0.1, **FROM_FEWEST) is None
    # 30 questions: at most 20 answered < 22; ceil(22 / (2/3)) = 33 questions would do
    why = unreachable(0.4, 30, 0.1, 0.1, **FROM_FEWEST)
    assert "33.3% must be abstained from" in why and "at most 20 answered" in why and "needs 22" in why
    assert "at least 33 questions" in why
    assert "no size will do" in unreachable(1.0, 1000, 0.1, 0.1, **FROM_FEWEST)
    assert unreachable(0.0, 22, 0.1, 0.1, **FROM_FEWEST) is None
    assert unreachable(0.0, 21, 0.1, 0.1, **FROM_FEWEST) is not None


def test_smallest_certifiable_risk_by_hand_and_by_search():
    # 40 right at 0.9 then 10 wrong at 0.5: the bound of the 40 (0 errors) is 1 - 0.1^(1/40) = 0.0559; a lower
    # target needs more than 40 answers without error, which these answers do not have
    conf, correct = [0.9] * 40 + [0.5] * 10, [1] * 40 + [0] * 10
    best = smallest_certifiable_risk(conf, correct, 0.1, **FROM_FEWEST)
    assert best == pytest.approx(1 - 0.1 ** (1 / 40))
    assert certify_threshold(conf, correct, target_risk=best, delta=0.1, **FROM_FEWEST).threshold == 0.9
    assert certify_threshold(conf, correct, target_risk=best * (1 - 1e-9), delta=0.1, **FROM_FEWEST).threshold is None
    # random answers: no target on a fine grid below the result passes, the result does
    rng = np.random.default_rng(1)
    conf = rng.uniform(size=300)
    correct = rng.uniform(size=300) < conf
    best = smallest_certifiable_risk(conf, correct, 0.2, **FROM_FEWEST)
    assert certify_threshold(conf, correct, target_risk=best, delta=0.2, **FROM_FEWEST).threshold is not None
    grid = np.linspace(1e-4, best, 400, endpoint=False)
    assert all(certify_threshold(conf, correct, target_risk=a, delta=0.2, **FROM_FEWEST).threshold is None
               for a in grid)
    assert smallest_certifiable_risk([0.5] * 5, [1] * 5, 0.1, **FROM_FEWEST) == pytest.approx(1 - 0.1 ** (1 / 5))
    assert smallest_certifiable_risk([0.5] * 5, [0] * 5, 0.1, **FROM_FEWEST) is None  # all wrong: nothing below 1


CERT = CertifiedThreshold(threshold=0.6, target_risk=0.2, delta=0.1, n=400, coverage=0.5, risk=0.12, bound=0.18)
BACKBONE = {"base_model": "tiny", "revision": "local", "hidden_size": 64, "vocab_size": 1024, "chat_template": "ab"}


def test_certificate_refuses_another_calibrator_or_backbone_in_one_line(tmp_path):
    served = {"format": {"max_tokens": 64, "chat_template": True}, "calibrator": "c0ffee", "backbone": BACKBONE}
    write_json(tmp_path / THRESHOLD_NAME, {"threshold": CERT.to_dict(), "served": served, "sets": [], "tasks": {}})
    cert = read_certificate(tmp_path)
    assert cert.threshold == CERT
    cert.check(backbone=BACKBONE, calibrator="c0ffee")
    cert.check(backbone={"base_model": "tiny"}, calibrator="c0ffee")  # only the keys given are compared
    path = re.escape(str(tmp_path / THRESHOLD_NAME))
    with pytest.raises(ATSError, match=rf"^{path}: field served.calibrator is 'c0ffee' but the calibrator in use has "
                                       r"digest 'beef'.*re-run ats certify$"):
        cert.check(backbone=BACKBONE, calibrator="beef")
    with pytest.raises(ATSError, match=rf"^{path}: field served.calibrator is 'c0ffee' .* has digest None"):
        cert.check(backbone=BACKBONE, calibrator=None)
    with pytest.raises(ATSError, match=r"field served.backbone.revision is 'local' but the backbone in use has 'v2'"):
        cert.check(backbone={**BACKBONE, "revision": "v2"}, calibrator="c0ffee")
    with pytest.raises(ATSError, match=r"field served.backbone.chat_template is 'ab' .* has None"):
        cert.check(backbone={**BACKBONE, "chat_template": None}, calibrator="c0ffee")
    assert cert.outside(max_tokens=64, chat_template=True) is None
    assert "at most 64 new tokens" in cert.outside(max_tokens=128, chat_template=True)
    assert "through the chat template" in cert.outside(max_tokens=64, chat_template=False)
    assert "sampled" in cert.outside(max_tokens=64, chat_template=True, sampled=True)
    assert "this one is steered by min_tokens" in cert.outside(max_tokens=64, chat_template=True, steered="min_tokens")


def test_a_threshold_file_from_before_certificates_is_refused_with_the_way_out(tmp_path):
    old = {("alpha" if k == "target_risk" else k): v for k, v in CERT.to_dict().items()}
    write_json(tmp_path / THRESHOLD_NAME, {"threshold": old, "tasks": {}, "fingerprint": {}})
    path = re.escape(str(tmp_path / THRESHOLD_NAME))
    with pytest.raises(ATSError, match=rf"^{path}: missing key 'served' .*re-run ats certify --overwrite$"):
        read_certificate(tmp_path)
    assert read_certificate(tmp_path / "nowhere") is None


def test_a_folder_where_threshold_json_belongs_is_named_not_taken_for_no_certificate(tmp_path):
    assert read_certificate(tmp_path) is None  # no threshold.json: uncertified
    (tmp_path / THRESHOLD_NAME).mkdir()
    with pytest.raises(ATSError, match=rf"^{re.escape(str(tmp_path / THRESHOLD_NAME))}: a folder, not a JSON file$"):
        read_certificate(tmp_path)
