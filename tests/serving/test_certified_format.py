"""`ats serve` with a certified threshold says per request whether its answers are made as the certified ones were
(greedy, through the chat template, at most the certified number of new tokens, stopped only by end-of-sequence):
`certified_format` and `outside_certificate` beside the decision, in plain and streamed chats and in completions.

A real server on the tiny model with the head and a certificate written as `ats certify` writes it; the expected
word is the certificate file's own (`read_certificate(...).outside`, read here), the decision the threshold's."""

from __future__ import annotations

import json

import httpx
import pytest

from ats.confidence import ANSWER_MAX_TOKENS
from ats.evaluation.threshold import read_certificate

from helpers import certified_copy
from server_process import API_KEY, MODEL_NAME, Server

MESSAGES = [{"role": "user", "content": "Name a colour."}]


@pytest.fixture(scope="module")
def certified(model_dir, head_dir, calibrator, backbone, tmp_path_factory):
    """(the server, the certificate it serves)."""
    root = tmp_path_factory.mktemp("certified")
    head = certified_copy(head_dir, root / "head", calibrator, backbone, seed=2)
    srv = Server(["--model", str(model_dir), "--calibrator", str(head), "--served-model-name", MODEL_NAME],
                 root / "log", api_key=API_KEY)
    yield srv, read_certificate(head)
    srv.stop()


def post(server, route: str, body: dict) -> httpx.Response:
    response = httpx.post(server.url + route, json={"model": MODEL_NAME, **body}, headers=server.headers(), timeout=60)
    response.raise_for_status()
    return response


def finished_ats(response: httpx.Response) -> dict:
    """The `ats` field of the stream's chunk that finishes its choice."""
    chunks = [json.loads(line[6:]) for line in response.text.splitlines()
              if line.startswith("data: ") and line != "data: [DONE]"]
    (ats,) = [c["choices"][0]["ats"] for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    return ats


@pytest.mark.parametrize("request_, format_", [
    ({"max_tokens": ANSWER_MAX_TOKENS, "temperature": 0}, {}),
    ({"max_completion_tokens": ANSWER_MAX_TOKENS, "temperature": 0, "stream": True}, {}),
    ({"max_tokens": ANSWER_MAX_TOKENS}, {"sampled": True}),  # temperature 1 by default, as OpenAI's
    ({"max_tokens": ANSWER_MAX_TOKENS, "temperature": 0, "stop": ["e"]}, {"stops": True}),
    ({"max_tokens": ANSWER_MAX_TOKENS, "temperature": 0, "ignore_eos": True}, {"ignore_eos": True}),
    ({"max_tokens": 8, "temperature": 0, "stream": True}, {"max_tokens": 8}),
    ({"temperature": 0}, {"max_tokens": None}),  # up to the context length
    ({"max_tokens": ANSWER_MAX_TOKENS, "temperature": 0, "min_tokens": 3}, {"steered": "min_tokens"}),
    ({"max_tokens": ANSWER_MAX_TOKENS, "temperature": 0, "min_tokens": 0, "top_k": 5}, {}),  # neutral; greedy
])
def test_a_chat_says_whether_it_is_in_the_certified_format(certified, request_, format_):
    server, certificate = certified
    response = post(server, "/v1/chat/completions", {"messages": MESSAGES, **request_})
    ats = finished_ats(response) if request_.get("stream") else response.json()["choices"][0]["ats"]
    want = certificate.outside(**{"max_tokens": ANSWER_MAX_TOKENS, "chat_template": True, **format_})
    assert (want is None) == (format_ == {})  # the certificate's own word: inside exactly for the greedy 64 tokens
    assert ats["outside_certificate"] == want and ats["certified_format"] is (want is None)
    assert {k: ats[k] for k in ("answered", "threshold", "target_risk", "delta")} == \
        certificate.threshold.decide(ats["answer_confidence"])


def test_a_completion_is_outside_a_chat_certificate(certified, backbone):
    server, certificate = certified
    assert certificate.served["format"]["chat_template"] is bool(backbone.is_chat) is True
    ats = post(server, "/v1/completions", {"prompt": "Name a colour.", "max_tokens": ANSWER_MAX_TOKENS,
                                           "temperature": 0}).json()["choices"][0]["ats"]
    assert ats["certified_format"] is False
    assert ats["outside_certificate"] == certificate.outside(max_tokens=ANSWER_MAX_TOKENS, chat_template=False)
    assert ats["outside_certificate"].endswith("through the chat template, and this one is made without it")


def counts(report: dict) -> dict:
    """(certified_format label, answered) -> answers, from a `/v1/ats/monitor` report."""
    return {(fmt, answered): s["answered"] if answered else s["answers"] - s["answered"]
            for fmt, s in report["served"].items() for answered in (True, False)}


def test_the_monitor_counts_what_the_server_decided(certified):
    """Before and after four requests (five choices), in and outside the certified format, plain and streamed: the
    report's counts grow by the decisions the responses carried, and /metrics (open, no key) says the same."""
    from prometheus_client.parser import text_string_to_metric_families

    server, certificate = certified
    monitor = server.url + "/v1/ats/monitor"
    assert httpx.get(monitor, timeout=30).status_code == 401  # the report needs the key, as /v1 does
    before = counts(httpx.get(monitor, headers=server.headers(), timeout=30).json())
    greedy = {"max_tokens": ANSWER_MAX_TOKENS, "temperature": 0}

    def choices(route: str, body: dict) -> list[dict]:
        return [c["ats"] for c in post(server, route, body).json()["choices"]]

    fields = choices("/v1/chat/completions", {"messages": MESSAGES, **greedy})
    fields.append(finished_ats(post(server, "/v1/chat/completions", {"messages": MESSAGES, "stream": True, **greedy})))
    fields += choices("/v1/chat/completions", {"messages": MESSAGES, "n": 2, "max_tokens": 8})
    fields += choices("/v1/completions", {"prompt": "Name a colour.", **greedy})
    assert [f["certified_format"] for f in fields] == [True, True, False, False, False]
    report = httpx.get(monitor, headers=server.headers(), timeout=30).json()
    grown = {key: n - before[key] for key, n in counts(report).items()}
    want = {(fmt, answered): sum(str(f["certified_format"]).lower() == fmt and f["answered"] is answered
                                 for f in fields)
            for fmt in ("true", "false", "unknown") for answered in (True, False)}
    assert grown == want
    assert report["certified"]["coverage"] == certificate.threshold.coverage
    assert report["threshold_file"] == certificate.path
    metrics = httpx.get(server.url + "/metrics", timeout=30)
    assert metrics.status_code == 200 and metrics.headers["content-type"].startswith("text/plain")
    exposed = {(s.labels["certified_format"], s.labels["answered"] == "true"): s.value
               for family in text_string_to_metric_families(metrics.text) for s in family.samples
               if s.name == "ats_answers_total"}
    assert exposed == counts(report)


def test_a_server_without_a_threshold_has_no_monitor(server):
    response = httpx.get(server.url + "/v1/ats/monitor", headers=server.headers(), timeout=30)
    assert response.status_code == 404 and "threshold.json" in response.json()["error"]["message"]
    metrics = httpx.get(server.url + "/metrics", timeout=30)  # the serving metrics, no decisions
    assert metrics.status_code == 200 and "ats_generation_tokens_total" in metrics.text
    assert "ats_answers_total" not in metrics.text
