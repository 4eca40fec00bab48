"""A served certificate's decisions, counted: how many answers a server decided, how many it answered, inside the
certified format and outside it, as JSON (`GET /v1/ats/monitor`) and as Prometheus metrics (`GET /metrics`). Both
servers keep one (`ats serve`, and vLLM's through `ats serve --engine vllm`).

Why watch them. A certificate (`ats certify`) holds for questions drawn like its certification mix and answered in
its format. Drawn so, an in-format answer clears the threshold with the probability p the certification answers
cleared it with, which their coverage estimates from n answers. A served answer rate far from it says the traffic
is not that mix, and the guarantee's premise fails. The monitor is read again and again as traffic arrives, so its
test must hold at every look, not at one: the served rate gets a confidence sequence (the Beta(1, 1) mixture of
Bernoulli likelihood ratios; by Ville's inequality it holds at every count at once with probability >= 1 - delta/2),
the certified coverage its Clopper-Pearson interval (1 - delta/2), and `alarm` is raised when the two are disjoint:
under the premise that happens with probability at most delta over the server's whole life, whenever it is read.
The converse does not hold: no alarm does not show that the mix is the same (another mix can be answered as often).

    ats_answers_total{answered="true"|"false", certified_format="true"|"false"|"unknown"}   counter
    ats_certified_coverage, ats_certified_answers, ats_target_risk, ats_delta, ats_threshold  gauges (the file's)
    ats_coverage_shift_alarm                                                                  gauge: 1 raised, 0 not
"""

from __future__ import annotations

import math
import threading
from collections import Counter

import numpy as np

from ..evaluation.threshold import CertifiedThreshold

MONITOR_PATH = "/v1/ats/monitor"  # the JSON report's route on both servers
FORMATS = ("true", "false", "unknown")  # the certified_format label: as certified, not, no word (no certificate)


def _format_label(ats: dict) -> str:
    value = ats.get("certified_format")
    return "unknown" if value is None else "true" if value else "false"


def log_mixture_ratio(p, answered, n):
    """log of the Beta(1, 1) mixture of Bernoulli likelihoods over the likelihood at rate p, for `answered` of `n`
    (numbers or arrays, broadcast): the log-wealth whose bound makes the confidence sequence. Convex in p, least at
    p = answered / n, where it is <= 0 (the mixture never beats the maximum likelihood)."""
    from scipy.special import betaln, xlog1py, xlogy

    return betaln(1 + answered, 1 + n - answered) - xlogy(answered, p) - xlog1py(n - answered, -p)


def shift_alarm(answered, n, certified: tuple[float, float], level: float) -> np.ndarray:
    """Whether the served rate's confidence sequence at `level` (`rate_confidence_sequence`) misses the certified
    interval, for `answered` of `n` (arrays: one entry per look): the ratio is at least 1 / level all over the
    interval, which, the ratio being convex with its least value at answered / n, is read at the interval's end
    nearer to that rate. No answers, no alarm."""
    answered, n = np.asarray(answered, dtype=np.float64), np.asarray(n, dtype=np.float64)
    low, high = certified
    rate = answered / np.maximum(n, 1.0)
    nearer = np.clip(rate, low, high)
    outside = (rate < low) | (rate > high)
    with np.errstate(divide="ignore"):  # log 0 at an end of [0, 1]: an infinite ratio, read as such
        return (n > 0) & outside & (log_mixture_ratio(nearer, answered, n) >= -math.log(level))


def rate_confidence_sequence(answered: int, n: int, level: float) -> tuple[float, float]:
    """The rates p whose mixture ratio (`log_mixture_ratio`) stays below 1 / level: an interval that holds the true
    rate at every n at once with probability >= 1 - level (Ville's inequality), however often it is read."""
    if n == 0:
        return 0.0, 1.0
    from scipy.optimize import brentq

    bound = -math.log(level)
    rate = answered / n  # the ratio is at most 1 here (the mixture never beats the maximum likelihood): inside

    def edge(end: float) -> float:
        if log_mixture_ratio(end, answered, n) < bound:
            return end
        return brentq(lambda p: log_mixture_ratio(p, answered, n) - bound, *sorted((rate, end)), xtol=1e-12)

    return edge(0.0), edge(1.0)


def rate_interval(answered: int, n: int, level: float) -> tuple[float, float]:
    """The two-sided Clopper-Pearson interval of a rate, `answered` of `n`, at confidence 1 - level."""
    from scipy.stats import binomtest

    ci = binomtest(answered, n).proportion_ci(confidence_level=1 - level, method="exact")
    return float(ci.low), float(ci.high)


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
        level = t.delta / 2  # each side's share: the alarm is false with probability <= delta
        served_interval = rate_confidence_sequence(inside["answered"], inside["answers"], level)
        certified_interval = rate_interval(certified_answered, t.n, level)
        alarm = bool(shift_alarm(inside["answered"], inside["answers"], certified_interval, level))
        return {"threshold_file": self.source,
                "certified": {"threshold": t.threshold, "target_risk": t.target_risk, "delta": t.delta,
                              "answers": t.n, "answered": certified_answered, "coverage": t.coverage,
                              "coverage_interval": list(certified_interval)},
                "served": {fmt: {**s, "coverage": s["answered"] / s["answers"] if s["answers"] else None}
                           for fmt, s in served.items()},
                "shift": {"alarm": alarm, "served_interval": list(served_interval),
                          "test": f"the in-format answer rate's confidence sequence (every look) and the certified "
                                  f"coverage's Clopper-Pearson interval, each at {1 - level:g}: disjoint raises "
                                  f"the alarm, false with probability <= delta ({t.delta:g})"}}

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

        report = self.monitor.report()  # one snapshot: the counter and the alarm read the same counts
        answers = CounterMetricFamily("ats_answers", "Answers decided against the certified threshold",
                                      labels=["answered", "certified_format"])
        for fmt, served in report["served"].items():
            answers.add_metric(["true", fmt], served["answered"])
            answers.add_metric(["false", fmt], served["answers"] - served["answered"])
        yield answers
        certified = report["certified"]
        gauges = {"ats_certified_coverage": ("Fraction of the certification answers answered", "coverage"),
                  "ats_certified_answers": ("Labelled answers the threshold was certified on", "answers"),
                  "ats_target_risk": ("The certified target risk", "target_risk"),
                  "ats_delta": ("The certificate's delta", "delta"),
                  "ats_threshold": ("The certified threshold (absent: abstain always)", "threshold")}
        for name, (text, key) in gauges.items():
            if certified[key] is not None:
                yield GaugeMetricFamily(name, text, value=certified[key])
        yield GaugeMetricFamily("ats_coverage_shift_alarm", "1 when the served in-format answer rate is not the "
                                "certified one (at every look, false with probability <= delta)",
                                value=float(report["shift"]["alarm"]))


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
