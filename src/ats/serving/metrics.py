"""`ats serve`'s serving metrics, in Prometheus's format at GET /metrics beside the certificate's decisions
(`monitor.py`): what an operator watches on vLLM's server, under ats's names, and the calibrator's share of decoding.

    ats_num_sequences_running                    gauge: sequences (choices) decoding now
    ats_num_waiting                              gauge: requests not started, and sequences waiting for a row
    ats_prompt_tokens_total                      counter: prompt tokens of the requests taken
    ats_generation_tokens_total                  counter: tokens generated, over all choices
    ats_choices_finished_total{finished_reason}  counter: choices finished, by "stop" or "length"
    ats_requests_total{outcome}                  counter: requests ended: "finished", "failed" (500), "shutting_down"
                                                 (503: the server's shutdown ended them), "cancelled" (client gone)
    ats_time_to_first_token_seconds              histogram: from a request's submission to its first token
    ats_e2e_request_latency_seconds              histogram: from a request's submission to its end (finished ones)
    ats_decode_seconds_total                     counter: time in decoding steps
    ats_calibrator_seconds_total                 counter: the calibrator's part of it

Counts start at zero with each server. Requests refused before they start (4xx, a full queue) are not counted.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from .engine import Engine

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0, 640.0)
OUTCOMES = ("finished", "failed", "shutting_down", "cancelled")


class ServingMetrics:
    """The metrics of one server over `engine`, in a registry of their own (`registry`: /metrics adds the
    certificate's collector to it); `Run` records each request through `started`, `generated` and `ended`."""

    def __init__(self, engine: Engine) -> None:
        self.registry = registry = CollectorRegistry()
        Gauge("ats_num_sequences_running", "Sequences (choices) decoding now", registry=registry).set_function(
            lambda: engine.stats()["running"])
        Gauge("ats_num_waiting", "Requests not started and sequences waiting for a row",
              registry=registry).set_function(lambda: engine.stats()["waiting"])
        self.prompt_tokens = Counter("ats_prompt_tokens", "Prompt tokens of the requests taken", registry=registry)
        self.generation_tokens = Counter("ats_generation_tokens", "Tokens generated, over all choices",
                                         registry=registry)
        self.choices = Counter("ats_choices_finished", "Choices finished, by finish reason", ["finished_reason"],
                               registry=registry)
        self.requests = Counter("ats_requests", "Requests ended, by outcome", ["outcome"], registry=registry)
        for outcome in OUTCOMES:
            self.requests.labels(outcome)  # every outcome exposed from the start, at 0
        self.time_to_first_token = Histogram("ats_time_to_first_token_seconds", "Seconds from a request's submission "
                                             "to its first generated token", buckets=LATENCY_BUCKETS,
                                             registry=registry)
        self.latency = Histogram("ats_e2e_request_latency_seconds", "Seconds from a request's submission to its end",
                                 buckets=LATENCY_BUCKETS, registry=registry)
        registry.register(_TimingCollector(engine))

    def started(self, prompt_tokens: int) -> None:
        """A request was taken, with `prompt_tokens` prompt tokens."""
        self.prompt_tokens.inc(prompt_tokens)

    def generated(self, tokens: int, finish_reason: str | None, first: bool, seconds: float) -> None:
        """A choice released `tokens` tokens (its last event when `finish_reason` is set); `first`: the request's
        first tokens, `seconds` after it was submitted."""
        self.generation_tokens.inc(tokens)
        if finish_reason is not None:
            self.choices.labels(finish_reason).inc()
        if first:
            self.time_to_first_token.observe(seconds)

    def ended(self, outcome: str, seconds: float) -> None:
        """A request ended with `outcome` (`OUTCOMES`), `seconds` after it was submitted."""
        self.requests.labels(outcome).inc()
        if outcome == "finished":
            self.latency.observe(seconds)


class _TimingCollector:
    """The engine's decoding timers, read at each scrape."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def collect(self):
        from prometheus_client.core import CounterMetricFamily

        timing = dict(self.engine.timing)
        yield CounterMetricFamily("ats_decode_seconds", "Seconds spent in decoding steps", value=timing["decode_s"])
        yield CounterMetricFamily("ats_calibrator_seconds", "Seconds of decoding spent in the calibrator",
                                  value=timing["head_s"])
