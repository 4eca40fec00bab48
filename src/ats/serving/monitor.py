"""A served certificate's decisions, counted: how many answers a server decided, how many it answered, inside the
certified format and outside it, as JSON (`GET /v1/ats/monitor`) and as Prometheus metrics (`GET /metrics`). Both
servers keep one (`ats serve`, and vLLM's through `ats serve --engine vllm`).

Why watch them. A certificate (`ats certify`) holds for questions drawn like its certification mix and answered in
its format. Drawn so, an in-format answer clears the threshold with the probability the certification answers
cleared it with (their coverage, an estimate from n answers). A served answer rate far from that says the traffic
is not that mix, and the guarantee's premise fails; `shift_p_value` is Fisher's exact test, two-sided, of equal
answer rates among the certification answers and the served in-format ones. The converse does not hold: an equal
rate does not show that the mix is the same. The p-value is that of one look: read again and again as traffic
arrives, it falls below a fixed level by chance more often than the level says.

    ats_answers_total{answered="true"|"false", certified_format="true"|"false"|"unknown"}   counter
    ats_certified_coverage, ats_certified_answers, ats_target_risk, ats_delta, ats_threshold  gauges (the file's)
    ats_coverage_shift_p_value                                                                gauge (as above)
"""

from __future__ import annotations

import threading
from collections import Counter

from ..evaluation.threshold import CertifiedThreshold

MONITOR_PATH = "/v1/ats/monitor"  # the JSON report's route on both servers
FORMATS = ("true", "false", "unknown")  # the certified_format label: as certified, not, no word (no certificate)


def _format_label(ats: dict) -> str:
    value = ats.get("certified_format")
    return "unknown" if value is None else "true" if value else "false"


def shift_p_value(certified_answered: int, certified_n: int, served_answered: int, served_n: int) -> float:
    """Fisher's exact two-sided p-value of equal answer rates in two samples (1.0 when either is empty)."""
    if certified_n == 0 or served_n == 0:
        return 1.0
    from scipy.stats import fisher_exact  # scipy comes with scikit-learn; imported only here

    table = [[certified_answered, certified_n - certified_answered], [served_answered, served_n - served_answered]]
    return float(fisher_exact(table, alternative="two-sided").pvalue)


class DecisionMonitor:
    """Counts of the `ats` fields a server sends that carry a decision, against the threshold they were decided by.

    Args:
        threshold: the served certified threshold.
        source: where it was read (the threshold file), reported beside the counts.
    """

    def __init__(self, threshold: CertifiedThreshold, source: str | None = None) -> None:
        self.threshold, self.source = threshold, source
        self._counts: Counter[tuple[bool, str]] = Counter()  # (answered, certified_format label) -> answers
        self._lock = threading.Lock()

    def record(self, ats: dict) -> None:
        """Count one choice's `ats` field; a field without a decision ("answered") is not counted."""
        if "answered" not in ats:
            return
        with self._lock:
            self._counts[bool(ats["answered"]), _format_label(ats)] += 1

    def counts(self) -> dict[tuple[bool, str], int]:
        """(answered, certified_format label) -> answers, every pair present."""
        with self._lock:
            return {(answered, fmt): self._counts[answered, fmt] for answered in (True, False) for fmt in FORMATS}

    def report(self) -> dict:
        """What `GET /v1/ats/monitor` answers: the certificate's figures, the served counts and the shift test."""
        t, counts = self.threshold, self.counts()
        certified_answered = round(t.coverage * t.n)  # coverage is answered / n, so this is exact
        served = {fmt: {"answers": counts[True, fmt] + counts[False, fmt], "answered": counts[True, fmt]}
                  for fmt in FORMATS}
        inside = served["true"]
        return {"threshold_file": self.source,
                "certified": {"threshold": t.threshold, "target_risk": t.target_risk, "delta": t.delta,
                              "answers": t.n, "answered": certified_answered, "coverage": t.coverage},
                "served": {fmt: {**s, "coverage": s["answered"] / s["answers"] if s["answers"] else None}
                           for fmt, s in served.items()},
                "shift_p_value": shift_p_value(certified_answered, t.n, inside["answered"], inside["answers"]),
                "shift_test": "Fisher's exact, two-sided: the certified answer rate against the served in-format "
                              "one (one look)"}

    def collector(self) -> "MonitorCollector":
        """A Prometheus collector of these counts (register it in a `prometheus_client` registry)."""
        return MonitorCollector(self)


class MonitorCollector:
    """A `prometheus_client` custom collector: the monitor's figures at each scrape (see the module docstring);
    nothing while its monitor is None."""

    def __init__(self, monitor: DecisionMonitor | None) -> None:
        self.monitor = monitor

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        if self.monitor is None:
            return

        answers = CounterMetricFamily("ats_answers", "Answers decided against the certified threshold",
                                      labels=["answered", "certified_format"])
        for (answered, fmt), n in self.monitor.counts().items():
            answers.add_metric(["true" if answered else "false", fmt], n)
        yield answers
        report = self.monitor.report()
        certified = report["certified"]
        gauges = {"ats_certified_coverage": ("Fraction of the certification answers answered", "coverage"),
                  "ats_certified_answers": ("Labelled answers the threshold was certified on", "answers"),
                  "ats_target_risk": ("The certified target risk", "target_risk"),
                  "ats_delta": ("The certificate's delta", "delta"),
                  "ats_threshold": ("The certified threshold (absent: abstain always)", "threshold")}
        for name, (text, key) in gauges.items():
            if certified[key] is not None:
                yield GaugeMetricFamily(name, text, value=certified[key])
        yield GaugeMetricFamily("ats_coverage_shift_p_value", "Fisher's exact two-sided p-value of the served "
                                "in-format answer rate against the certified one", value=report["shift_p_value"])


_DEFAULT_COLLECTOR: MonitorCollector | None = None


def report_in_default_registry(monitor: DecisionMonitor | None) -> None:
    """Report `monitor` through prometheus_client's default registry, the one vLLM's /metrics serves (with one API
    server process; with several, vLLM gathers only its own metrics across them): one collector per process, which
    reports the monitor last given (None: nothing)."""
    global _DEFAULT_COLLECTOR
    if _DEFAULT_COLLECTOR is None:
        from prometheus_client import REGISTRY

        _DEFAULT_COLLECTOR = MonitorCollector(monitor)
        REGISTRY.register(_DEFAULT_COLLECTOR)
    _DEFAULT_COLLECTOR.monitor = monitor
