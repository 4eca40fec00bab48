"""`ats serve`'s /metrics against what the responses themselves say: over a few requests (chat and completions,
plain and streamed, n > 1, one stream its client closes), the token counters grow by the responses' usage, the
finish-reason counter by their choices' finish reasons, each request ends once with its outcome, the latency
histograms get one observation per request, and the calibrator's seconds are a part of the decoding seconds."""

from __future__ import annotations

import json
import time
from collections import Counter

import httpx
from prometheus_client.parser import text_string_to_metric_families

from server_process import MODEL_NAME


def scrape(server) -> dict:
    """(sample name, labels) -> value of every sample at GET /metrics (open: no key)."""
    text = httpx.get(server.url + "/metrics", timeout=30).text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def post(server, route: str, body: dict) -> dict:
    response = httpx.post(server.url + route, json={"model": MODEL_NAME, **body}, headers=server.headers(),
                          timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


def streamed(server, route: str, body: dict) -> list[dict]:
    with httpx.stream("POST", server.url + route, json={"model": MODEL_NAME, "stream": True, **body},
                      headers=server.headers(), timeout=120) as response:
        lines = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    return [json.loads(line) for line in lines if line != "[DONE]"]


def test_metrics_agree_with_the_responses(server):
    before = scrape(server)
    messages = [{"role": "user", "content": "Name a colour."}]
    plain = [post(server, "/v1/chat/completions", {"messages": messages, "n": 2, "max_tokens": 6}),
             post(server, "/v1/completions", {"prompt": ["Hello", "The sea"], "max_tokens": 5, "temperature": 0,
                                              "stop": [" "]})]
    chunks = streamed(server, "/v1/chat/completions", {"messages": messages, "max_tokens": 7, "temperature": 0,
                                                       "stream_options": {"include_usage": True}})
    with httpx.stream("POST", server.url + "/v1/completions", headers=server.headers(), timeout=120,
                      json={"model": MODEL_NAME, "prompt": "Hi", "max_tokens": 1500, "stream": True,
                            "ignore_eos": True}) as response:  # closed after its first chunk: cancelled
        next(response.iter_lines())
    usages = [r["usage"] for r in plain] + [chunks[-1]["usage"]]
    reasons = Counter(c["finish_reason"] for r in plain for c in r["choices"])
    reasons += Counter(c["choices"][0]["finish_reason"] for c in chunks[:-1] if c["choices"][0]["finish_reason"])
    cancelled = ("ats_requests_total", (("outcome", "cancelled"),))
    for _ in range(200):  # the server learns of the closed stream when it next writes to it
        if scrape(server)[cancelled] > before[cancelled]:
            break
        time.sleep(0.05)
    after = scrape(server)

    def grown(name: str, **labels) -> float:
        key = (name, tuple(sorted(labels.items())))
        return after[key] - before.get(key, 0.0)

    cancelled_stream_tokens = grown("ats_generation_tokens_total") - sum(u["completion_tokens"] for u in usages)
    assert 1 <= cancelled_stream_tokens < 1500  # the closed stream's tokens, generated before it was cancelled
    assert grown("ats_prompt_tokens_total") == sum(u["prompt_tokens"] for u in usages) + len(
        httpx.post(server.url + "/tokenize", json={"prompt": "Hi"}, headers=server.headers(), timeout=30).json()[
            "tokens"])
    assert {reason: grown("ats_choices_finished_total", finished_reason=reason) for reason in reasons} == reasons
    assert grown("ats_requests_total", outcome="finished") == 3
    assert grown("ats_requests_total", outcome="cancelled") == 1
    assert grown("ats_requests_total", outcome="failed") == grown("ats_requests_total", outcome="shutting_down") == 0
    assert grown("ats_e2e_request_latency_seconds_count") == 3  # finished requests only
    # one first token per request that generated any (a stop string can end both choices before their first)
    assert grown("ats_time_to_first_token_seconds_count") == sum(u["completion_tokens"] > 0 for u in usages) + 1
    assert after[("ats_num_sequences_running", ())] == 0 and after[("ats_num_waiting", ())] == 0
    assert 0 < grown("ats_calibrator_seconds_total") < grown("ats_decode_seconds_total")
