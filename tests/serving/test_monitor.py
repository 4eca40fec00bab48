"""The served certificate's decisions, counted (`ats.serving.monitor`): counts by decision and format; the served
rate's confidence sequence against its mixture ratio written out here, its guarantee at every look simulated; the
alarm; and the Prometheus exposition read back with prometheus_client's own parser."""

from __future__ import annotations

import math

import numpy as np
import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from scipy.special import gammaln
from scipy.stats import beta

from ats.evaluation.threshold import CertifiedThreshold
from ats.serving.monitor import DecisionMonitor, rate_confidence_sequence, rate_interval, shift_alarm

CERTIFIED = CertifiedThreshold(threshold=0.6, target_risk=0.2, delta=0.1, n=400, coverage=0.5, risk=0.12, bound=0.18)


def log_ratio(p: float, answered: int, n: int) -> float:
    """log of the uniform mixture of Bernoulli likelihoods over the likelihood at p, written out: the mixture is
    the Beta function B(1 + answered, 1 + n - answered), from log-gamma."""
    mixture = math.lgamma(1 + answered) + math.lgamma(1 + n - answered) - math.lgamma(2 + n)
    at_p = (answered * math.log(p) if answered else 0.0) + ((n - answered) * math.log1p(-p) if n > answered else 0.0)
    return mixture - at_p


@pytest.mark.parametrize("answered, n", [(3, 10), (640, 2000), (0, 50), (50, 50), (1, 1)])
def test_the_confidence_sequence_is_where_the_mixture_ratio_stays_below_one_over_level(answered, n):
    level = 0.05
    low, high = rate_confidence_sequence(answered, n, level)
    assert low <= answered / n <= high
    for edge, end in ((low, 0.0), (high, 1.0)):
        if edge != end:  # an edge inside (0, 1) is where the ratio reaches 1 / level
            assert log_ratio(edge, answered, n) == pytest.approx(-math.log(level), abs=1e-8)
        else:  # an edge at 0 or 1: the ratio is below the bound all the way
            assert log_ratio(min(max(end, 1e-12), 1 - 1e-12), answered, n) < -math.log(level)
    assert rate_confidence_sequence(0, 0, level) == (0.0, 1.0)


def test_the_sequence_holds_at_every_look_where_one_look_intervals_do_not():
    """2000 seeded runs of 400 answers at rate 0.3, read after every answer: the true rate leaves the confidence
    sequence (by the ratio written out above) in at most `level` of the runs, while Clopper-Pearson intervals read
    after every answer miss it in more (why the monitor does not use them for the served rate)."""
    level, rate = 0.1, 0.3
    rng = np.random.default_rng(0)
    answered = (rng.uniform(size=(2000, 400)) < rate).cumsum(axis=1)  # (runs, looks)
    n = np.arange(1, 401)
    mixture = gammaln(1 + answered) + gammaln(1 + n - answered) - gammaln(2 + n)
    ratio = mixture - answered * math.log(rate) - (n - answered) * math.log1p(-rate)
    assert (ratio >= -math.log(level)).any(axis=1).mean() <= level
    low = np.where(answered > 0, beta.ppf(level / 2, answered, n - answered + 1), 0.0)
    high = np.where(answered < n, beta.ppf(1 - level / 2, answered + 1, n - answered), 1.0)
    assert ((rate < low) | (rate > high)).any(axis=1).mean() > 2 * level


def test_the_alarm_is_the_two_intervals_being_disjoint():
    """`shift_alarm` (the ratio read at the certified interval's nearer end, vectorised) against the intervals
    themselves (the sequence's edges found by root finding), on 1000 seeded random cases at three levels."""
    rng = np.random.default_rng(1)
    cases = []
    for _ in range(1000):
        n = int(rng.integers(0, 300))
        answered = int(rng.integers(0, n + 1)) if n else 0
        certified_n = int(rng.integers(20, 2000))
        level = float(rng.choice([0.025, 0.05, 0.1]))
        certified = rate_interval(int(rng.integers(0, certified_n + 1)), certified_n, level)
        low, high = rate_confidence_sequence(answered, n, level)
        cases.append((bool(shift_alarm(answered, n, certified, level)), high < certified[0] or certified[1] < low))
    alarms, disjoint = zip(*cases)
    assert alarms == disjoint and 100 < sum(alarms) < 900  # both kinds of case are there


def test_clopper_pearson_interval():
    low, high = rate_interval(3, 10, 0.05)
    assert low == pytest.approx(beta.ppf(0.025, 3, 8)) and high == pytest.approx(beta.ppf(0.975, 4, 7))


def decisions() -> list[dict]:
    """Three in-format answers (two answered), two outside (one answered), one with no word on the format, and a
    field without a decision (a server without a threshold: not counted)."""
    return [{"answered": True, "certified_format": True}, {"answered": True, "certified_format": True},
            {"answered": False, "certified_format": True}, {"answered": True, "certified_format": False},
            {"answered": False, "certified_format": False}, {"answered": False},
            {"answer_confidence": 0.7}]


def test_the_report_counts_decisions_by_format():
    monitor = DecisionMonitor(CERTIFIED, "cal/threshold.json")
    for ats in decisions():
        monitor.record(ats)
    report = monitor.report()
    assert report["threshold_file"] == "cal/threshold.json"
    certified_interval = report["certified"].pop("coverage_interval")
    assert report["certified"] == {"threshold": 0.6, "target_risk": 0.2, "delta": 0.1, "answers": 400,
                                   "answered": 200, "coverage": 0.5}
    assert report["served"] == {"true": {"answers": 3, "answered": 2, "coverage": pytest.approx(2 / 3)},
                                "false": {"answers": 2, "answered": 1, "coverage": 0.5},
                                "unknown": {"answers": 1, "answered": 0, "coverage": 0.0}}
    low, high = rate_confidence_sequence(2, 3, 0.05)  # the in-format answers only, at delta / 2 each side
    assert report["shift"]["served_interval"] == [low, high] and low < 0.5 < high
    assert certified_interval == list(rate_interval(200, 400, 0.05))
    assert report["shift"]["alarm"] is False


def test_an_answer_rate_far_from_the_certified_one_raises_the_alarm():
    """Certified: 200 of 400 answered (Clopper-Pearson 0.45-0.55 at 0.95); served in format: 5 of 100 (the sequence
    reaches about 0.13): disjoint. 45 of 100 overlaps."""
    far, near = DecisionMonitor(CERTIFIED), DecisionMonitor(CERTIFIED)
    for i in range(100):
        far.record({"answered": i < 5, "certified_format": True})
        near.record({"answered": i < 45, "certified_format": True})
    assert far.report()["shift"]["served_interval"][1] < 0.2 and far.report()["shift"]["alarm"] is True
    assert near.report()["shift"]["alarm"] is False


def test_prometheus_exposition_carries_the_counts_and_the_certificate():
    monitor = DecisionMonitor(CERTIFIED)
    for ats in decisions():
        monitor.record(ats)
    registry = CollectorRegistry()
    registry.register(monitor.collector())
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for family in text_string_to_metric_families(generate_latest(registry).decode())
               for s in family.samples}
    answers = {labels: v for (name, labels), v in samples.items() if name == "ats_answers_total"}
    assert answers == {(("answered", a), ("certified_format", f)): n for (a, f), n in {
        ("true", "true"): 2, ("false", "true"): 1, ("true", "false"): 1, ("false", "false"): 1,
        ("true", "unknown"): 0, ("false", "unknown"): 1}.items()}
    assert samples["ats_certified_coverage", ()] == 0.5 and samples["ats_certified_answers", ()] == 400
    assert samples["ats_threshold", ()] == 0.6 and samples["ats_target_risk", ()] == 0.2
    assert samples["ats_coverage_shift_alarm", ()] == 0.0


def test_abstain_always_has_no_threshold_gauge():
    never = CertifiedThreshold(threshold=None, target_risk=0.2, delta=0.1, n=50, coverage=0.0)
    monitor = DecisionMonitor(never)
    monitor.record({"answered": False, "certified_format": True})
    registry = CollectorRegistry()
    registry.register(monitor.collector())
    names = {f.name for f in text_string_to_metric_families(generate_latest(registry).decode())}
    assert "ats_threshold" not in names and "ats_certified_coverage" in names
    assert monitor.report()["shift"]["alarm"] is False  # none answered there, none here
