"""The served certificate's decisions, counted (`ats.serving.monitor`): counts by decision and format, the shift
test against Fisher's exact test computed here from the hypergeometric law, and the Prometheus exposition read back
with prometheus_client's own parser."""

from __future__ import annotations

import math

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from ats.evaluation.threshold import CertifiedThreshold
from ats.serving.monitor import DecisionMonitor, shift_p_value

CERTIFIED = CertifiedThreshold(threshold=0.6, target_risk=0.2, delta=0.1, n=400, coverage=0.5, risk=0.12, bound=0.18)


def fisher_by_hand(a: int, n1: int, c: int, n2: int) -> float:
    """Two-sided Fisher p-value of a of n1 against c of n2: the hypergeometric probability of every table with the
    same margins at most as likely as the observed one."""
    total, ones = n1 + n2, a + c

    def prob(x: int) -> float:
        return math.comb(n1, x) * math.comb(n2, ones - x) / math.comb(total, ones)

    observed = prob(a)
    tables = range(max(0, ones - n2), min(n1, ones) + 1)
    return min(1.0, sum(prob(x) for x in tables if prob(x) <= observed * (1 + 1e-7)))


@pytest.mark.parametrize("table", [(200, 400, 5, 10), (200, 400, 2, 30), (200, 400, 28, 30), (0, 50, 3, 9),
                                   (7, 12, 1, 11)])
def test_shift_p_value_is_fishers_exact_test(table):
    assert shift_p_value(*table) == pytest.approx(fisher_by_hand(*table), rel=1e-9)


def test_no_served_answers_is_no_evidence():
    assert shift_p_value(200, 400, 0, 0) == 1.0


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
    assert report["certified"] == {"threshold": 0.6, "target_risk": 0.2, "delta": 0.1, "answers": 400,
                                   "answered": 200, "coverage": 0.5}
    assert report["served"] == {"true": {"answers": 3, "answered": 2, "coverage": pytest.approx(2 / 3)},
                                "false": {"answers": 2, "answered": 1, "coverage": 0.5},
                                "unknown": {"answers": 1, "answered": 0, "coverage": 0.0}}
    assert report["shift_p_value"] == pytest.approx(fisher_by_hand(200, 400, 2, 3))


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
    assert samples["ats_coverage_shift_p_value", ()] == pytest.approx(fisher_by_hand(200, 400, 2, 3))


def test_abstain_always_has_no_threshold_gauge():
    never = CertifiedThreshold(threshold=None, target_risk=0.2, delta=0.1, n=50, coverage=0.0)
    monitor = DecisionMonitor(never)
    monitor.record({"answered": False, "certified_format": True})
    registry = CollectorRegistry()
    registry.register(monitor.collector())
    names = {f.name for f in text_string_to_metric_families(generate_latest(registry).decode())}
    assert "ats_threshold" not in names and "ats_certified_coverage" in names
    assert monitor.report()["shift_p_value"] == 1.0  # none answered there, none here
