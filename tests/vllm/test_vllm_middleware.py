"""ats's layer in vLLM's server (`ATSMiddleware`) around a stand-in for vLLM's routes that answers in vLLM's
format (plain and streamed, a stream's events split across writes as a network may split them) and records what it
was sent: the chat roles `ats serve` refuses get its 400, logprobs are asked for and the `ats` decision added to
each choice (hand-computed), on a stream to the chunk that finishes each choice, with the request's word on the
certified format; logprobs nobody asked for removed; echoed completions (their logprobs start with the prompt's)
and requests without the API key untouched; the playground's files are the page `ats serve` serves, its info route
needs the key. The slow server tests (test_vllm_server.py) run it in vLLM's real server."""

from __future__ import annotations

import asyncio
import json
import math
import threading

import pytest
from starlette.applications import Starlette
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route
from starlette.testclient import TestClient
from test_vllm_abstain import CERTIFIED

from ats.evaluation.threshold import Certificate
from ats.integrations.vllm import CONFIG_KEY, shutdown
from ats.integrations.vllm.abstain import CUT_SHORT, AnswerDecider
from ats.integrations.vllm.middleware import (
    EXPORT_ENV,
    MAX_REQUEST_BYTES_ENV,
    MODEL_NAME_ENV,
    ATSMiddleware,
    add_decisions,
)
from ats.integrations.vllm.stream import StreamDecisions
from ats.serving.api_errors import SHUTTING_DOWN
from ats.serving.playground import STATIC, page_file

TOKENS = [{"token": "Par", "logprob": -0.1, "top_logprobs": []}, {"token": "is", "logprob": -0.9, "top_logprobs": []},
          {"token": "<eos>", "logprob": -0.01, "top_logprobs": []}]


def stand_in(seen: list):
    """vLLM's two routes, as they answer: logprobs when asked for, finish_reason "stop" on the end token."""

    async def chat(request):
        body = await request.json()
        seen.append(body)
        logprobs = {"content": TOKENS} if body.get("logprobs") else None
        return JSONResponse({"object": "chat.completion", "choices": [
            {"index": 0, "message": {"role": "assistant", "content": "Paris"}, "logprobs": logprobs,
             "finish_reason": "stop"}]})

    async def completion(request):
        body = await request.json()
        seen.append(body)
        logprobs = None if body.get("logprobs") is None else {
            "tokens": [t["token"] for t in TOKENS], "token_logprobs": [t["logprob"] for t in TOKENS]}
        return JSONResponse({"object": "text_completion", "choices": [
            {"index": 0, "text": "Paris", "logprobs": logprobs, "finish_reason": "stop"}]})

    async def stream(request):
        body = await request.json()
        seen.append(body)
        return StreamingResponse(events(body, request.url.path.endswith("/chat/completions")),
                                 media_type="text/event-stream")

    async def route(request):
        body = await request.json()
        return await (stream(request) if body.get("stream") else
                      chat(request) if request.url.path.endswith("/chat/completions") else completion(request))

    return Starlette(routes=[Route("/v1/chat/completions", route, methods=["POST"]),
                             Route("/v1/completions", route, methods=["POST"])])


async def events(body: dict, chat: bool):
    """vLLM's stream: (chat) a role chunk, then one chunk per token, the last with finish_reason "stop", then
    [DONE]; written in pieces that cut events (and a JSON object) in two."""
    def chunk(i: int, token: dict | None, finish: str | None) -> dict:
        if chat:
            logprobs = {"content": [token]} if body.get("logprobs") and token else None
            delta = {"content": token["token"]} if token else {"role": "assistant", "content": ""}
            return {"object": "chat.completion.chunk", "choices": [
                {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}]}
        logprobs = None if body.get("logprobs") is None else {"tokens": [token["token"]],
                                                                "token_logprobs": [token["logprob"]]}
        return {"object": "text_completion", "choices": [
            {"index": 0, "text": token["token"], "logprobs": logprobs, "finish_reason": finish}]}

    chunks = ([chunk(0, None, None)] if chat else []) + [
        chunk(0, t, "stop" if i == len(TOKENS) - 1 else None) for i, t in enumerate(TOKENS)]
    text = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"
    for start in range(0, len(text), 37):
        yield text[start:start + 37]


def read_stream(response) -> list:
    """The data of each server-sent event of a response, JSON decoded ([DONE] as the string)."""
    data = [line.removeprefix("data: ") for line in response.text.split("\n\n") if line]
    return [d if d == "[DONE]" else json.loads(d) for d in data]


@pytest.fixture
def client_and_seen(monkeypatch):
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    seen: list = []
    app = ATSMiddleware(stand_in(seen), decider=AnswerDecider(CERTIFIED, frozenset({"<eos>"})))
    return TestClient(app), seen


DECISION = {"answer_confidence": pytest.approx((math.exp(-0.1) + math.exp(-0.9)) / 2), "answered": True,
            "threshold": 0.6, "target_risk": 0.2, "delta": 0.1}
CHAT = {"model": "m", "messages": [{"role": "user", "content": "capital of France?"}]}


def test_unknown_role_gets_ats_serves_400(client_and_seen):
    client, seen = client_and_seen
    out = client.post("/v1/chat/completions", json={**CHAT, "messages": [{"role": "wizard", "content": "hi"}]})
    assert out.status_code == 400 and not seen
    assert out.json() == {"error": {"message": "messages.0.role: Input should be 'system', 'developer', 'user' or "
                                               "'assistant' (got 'wizard')", "type": "invalid_request_error",
                                    "param": "messages.0.role", "code": None}}


@pytest.mark.parametrize("route, raw, param, words", [
    ("/v1/chat/completions", {**CHAT, "messages": [{"content": "hi"}]}, "messages.0.role", "Field required"),
    ("/v1/chat/completions", {**CHAT, "messages": ["hi"]}, "messages.0", "valid dictionary"),
    ("/v1/chat/completions", json.dumps(CHAT).replace("France", "\\ud800"), "messages.0.content",
     "lone surrogate '\\ud800' at character 11"),
    ("/v1/completions", json.dumps({"model": "m", "prompt": ["ok", "X"]}).replace("X", "\\udc00"), "prompt.1",
     "not valid Unicode"),
])
def test_requests_vllm_would_take_or_fail_on_get_ats_serves_400(client_and_seen, route, raw, param, words):
    """The same message as `ats serve`'s for the same body (its schemas make both)."""
    client, seen = client_and_seen
    out = (client.post(route, content=raw, headers={"Content-Type": "application/json"}) if isinstance(raw, str)
           else client.post(route, json=raw))
    assert out.status_code == 400 and not seen
    error = out.json()["error"]
    assert error["param"] == param and error["message"].startswith(param + ":") and words in error["message"]


def test_the_decision_is_added_and_logprobs_stay_as_asked(client_and_seen):
    client, seen = client_and_seen
    plain = client.post("/v1/chat/completions", json=CHAT).json()["choices"][0]
    assert seen[-1]["logprobs"] is True  # asked for on the client's behalf
    assert plain["ats"] == DECISION and plain["logprobs"] is None  # ... and not returned
    asked = client.post("/v1/chat/completions", json={**CHAT, "logprobs": True}).json()["choices"][0]
    assert asked["ats"] == DECISION and asked["logprobs"]["content"] == TOKENS
    completion = client.post("/v1/completions", json={"model": "m", "prompt": "Q"}).json()["choices"][0]
    assert seen[-1]["logprobs"] == 0 and completion["ats"] == DECISION and completion["logprobs"] is None
    echoed = {"model": "m", "prompt": "Q", "echo": True, "logprobs": 1}  # its logprobs start with the prompt's
    assert "ats" not in client.post("/v1/completions", json=echoed).json()["choices"][0] and seen[-1] == echoed


def test_a_stream_carries_the_decision_on_the_chunk_that_finishes_the_choice(client_and_seen):
    client, seen = client_and_seen
    chat = read_stream(client.post("/v1/chat/completions", json={**CHAT, "stream": True}))
    assert seen[-1]["logprobs"] is True and chat[-1] == "[DONE]" and len(chat) == 1 + len(TOKENS) + 1
    *middle, last = [c["choices"][0] for c in chat[:-1]]
    assert last["finish_reason"] == "stop" and last["ats"] == DECISION  # as ats serve's stream places it
    assert all("ats" not in c and c["logprobs"] is None for c in middle) and last["logprobs"] is None
    assert "".join(c["delta"]["content"] for c in [*middle, last]) == "Paris<eos>"  # the text as vLLM sent it
    asked = read_stream(client.post("/v1/chat/completions", json={**CHAT, "stream": True, "logprobs": True}))
    assert [t for c in asked[1:-1] for t in c["choices"][0]["logprobs"]["content"]] == TOKENS
    assert asked[-2]["choices"][0]["ats"] == DECISION
    completion = read_stream(client.post("/v1/completions", json={"model": "m", "prompt": "Q", "stream": True}))
    assert seen[-1]["logprobs"] == 0 and completion[-2]["choices"][0]["ats"] == DECISION
    assert all(c["choices"][0]["logprobs"] is None for c in completion[:-1])


def certificate(max_tokens: int = 64) -> Certificate:
    """A certificate of greedy answers through the chat template, at most `max_tokens` new tokens."""
    return Certificate(CERTIFIED, {"format": {"chat_template": True, "max_tokens": max_tokens}, "calibrator": None,
                                   "backbone": {}}, [], "cal/threshold.json")


@pytest.mark.parametrize("request_, reason", [
    ({"max_tokens": 64, "temperature": 0}, None),
    ({"max_completion_tokens": 64, "temperature": 0.0, "stream": True}, None),
    ({"max_tokens": 64}, "this one is sampled"),  # vLLM's default temperature: 1
    ({"max_tokens": 64, "temperature": "hot"}, "this one is sampled"),  # no crash here: vLLM answers its 400
    ({"max_tokens": 64, "temperature": 0, "stop": ["\n"]}, "cut by stop strings"),
    ({"max_tokens": 64, "temperature": 0, "ignore_eos": True}, "run past end-of-sequence (ignore_eos)"),
    ({"max_tokens": 32, "temperature": 0}, "at most 64 new tokens, and this one may have 32"),
    ({"temperature": 0}, "and this one may have up to the context length"),
    ({"max_tokens": 64, "temperature": 0, "chat_template": "{{ x }}"}, "made without it"),
    ({"max_tokens": 64, "temperature": 0, "min_tokens": 5}, "this one is steered by min_tokens"),
    ({"max_tokens": 64, "temperature": 0, "repetition_penalty": 1.2}, "steered by repetition_penalty"),
    ({"max_tokens": 64, "temperature": 0, "response_format": {"type": "json_object"}}, "steered by response_format"),
    ({"max_tokens": 64, "temperature": 0, "repetition_penalty": 1, "logit_bias": {"5": 0},
      "response_format": {"type": "text"}, "min_tokens": 0}, None),  # every option at its neutral value
])
def test_the_decision_says_whether_the_request_is_in_the_certified_format(monkeypatch, request_, reason):
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    decider = AnswerDecider(CERTIFIED, frozenset({"<eos>"}), certificate())
    client = TestClient(ATSMiddleware(stand_in([]), decider=decider))
    out = client.post("/v1/chat/completions", json={**CHAT, **request_})
    ats = (read_stream(out)[-2] if request_.get("stream") else out.json())["choices"][0]["ats"]
    outside = ats.pop("outside_certificate")
    assert ats == {**DECISION, "certified_format": reason is None}
    if reason is None:
        assert outside is None
    else:
        assert outside.startswith("cal/threshold.json certifies ") and reason in outside
    completion = client.post("/v1/completions", json={"model": "m", "prompt": "Q", "max_tokens": 64,
                                                       "temperature": 0}).json()["choices"][0]["ats"]
    assert completion["outside_certificate"].endswith("through the chat template, and this one is made without it")


def test_the_page_is_ats_serves_and_its_info_needs_the_key(monkeypatch, tmp_path):
    export = tmp_path / "export"
    export.mkdir()
    (export / "config.json").write_text(json.dumps({CONFIG_KEY: {"calibrator": None, "base_model": "tiny-base"}}))
    monkeypatch.setenv("VLLM_API_KEY", "k")
    monkeypatch.setenv(EXPORT_ENV, str(export))
    monkeypatch.setenv(MODEL_NAME_ENV, "tiny")
    seen: list = []
    client = TestClient(ATSMiddleware(stand_in(seen), decider=AnswerDecider(None, frozenset({"<eos>"}))))
    page = client.get("/")
    assert page.status_code == 200 and page.text == page_file("index.html")
    for name, media in STATIC.items():
        served = client.get(f"/static/{name}")
        assert served.text == page_file(name) and served.headers["content-type"] == media
    refused = client.get("/v1/playground")
    assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"
    info = client.get("/v1/playground", headers={"Authorization": "Bearer k"}).json()
    assert info["model"] == "tiny" and info["engine"] == "vllm" and info["served"] == "uncalibrated"
    assert set(info["unavailable"]) == {"raw", "tau", "rescore", "evaluation"} and info["evaluation"] is None
    assert info["certified_format"] is None  # no certificate in this export
    assert info["calibrators"][0]["threshold"] is None and "tiny-base" in info["calibrators"][0]["make_evaluation"]
    assert client.get("/static/other.js").status_code == 404 and not seen  # not the page's: vLLM's (here a 404)


def test_requests_without_the_key_pass_through(monkeypatch):
    seen: list = []
    monkeypatch.setenv("VLLM_API_KEY", "k")
    client = TestClient(ATSMiddleware(stand_in(seen), decider=AnswerDecider(CERTIFIED, frozenset({"<eos>"}))))
    bad = {**CHAT, "messages": [{"role": "wizard", "content": "hi"}]}
    assert client.post("/v1/chat/completions", json=bad).status_code == 200  # vLLM's auth answers it (401) there
    assert "ats" not in client.post("/v1/chat/completions", json=CHAT).json()["choices"][0]
    unkeyed = read_stream(client.post("/v1/chat/completions", json={**CHAT, "stream": True}))
    assert all("ats" not in c["choices"][0] for c in unkeyed[:-1]) and seen[-1] == {**CHAT, "stream": True}
    assert client.post("/v1/chat/completions", json=bad, headers={"Authorization": "Bearer k"}).status_code == 400
    assert json.loads(json.dumps(seen))  # the stand-in saw JSON bodies throughout


def test_a_body_over_the_limit_gets_ats_serves_413_and_never_reaches_vllm(monkeypatch):
    seen: list = []
    monkeypatch.setenv("VLLM_API_KEY", "k")
    monkeypatch.setenv(MAX_REQUEST_BYTES_ENV, "1000")
    client = TestClient(ATSMiddleware(stand_in(seen), decider=AnswerDecider(CERTIFIED, frozenset({"<eos>"}))))
    key = {"Authorization": "Bearer k", "Content-Type": "application/json"}
    big = json.dumps({**CHAT, "user": "x" * 1000}).encode()
    expected = {"error": {"message": "the request body is over this server's limit of 1000 bytes (ats serve "
                                     "--max-request-bytes)", "type": "invalid_request_error", "param": None,
                          "code": "request_too_large"}}
    declared = client.post("/v1/chat/completions", content=big, headers=key)  # Content-Length: refused at once
    assert (declared.status_code, declared.json()) == (413, expected)
    chunked = client.post("/v1/completions", content=iter([big[:600], big[600:]]), headers=key)  # when it passes
    assert (chunked.status_code, chunked.json()) == (413, expected)
    assert seen == []
    unkeyed = client.post("/v1/chat/completions", content=big, headers={"Content-Type": "application/json"})
    assert unkeyed.status_code == 200 and len(seen) == 1  # to vLLM's auth (its 401 there), whatever the size
    within = client.post("/v1/chat/completions", json=CHAT, headers=key)
    assert within.json()["choices"][0]["ats"] == DECISION


def test_the_monitor_counts_each_decision_and_joins_vllms_metrics(monkeypatch, tmp_path):
    """Plain and streamed chats, in and outside the certified format, and an echoed completion (no decision): the
    report at /v1/ats/monitor (with the key) counts each decided choice by its format, and prometheus_client's
    default registry (vLLM's /metrics with one API server) carries the same counts."""
    from prometheus_client import REGISTRY, generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    export = tmp_path / "export"
    export.mkdir()
    monkeypatch.setenv("VLLM_API_KEY", "k")
    monkeypatch.setenv(EXPORT_ENV, str(export))
    app = ATSMiddleware(stand_in([]), decider=AnswerDecider(CERTIFIED, frozenset({"<eos>"}), certificate()))
    client, key = TestClient(app), {"Authorization": "Bearer k"}
    greedy = {**CHAT, "max_tokens": 64, "temperature": 0}
    fields = [client.post("/v1/chat/completions", json=greedy, headers=key).json()["choices"][0]["ats"],
              read_stream(client.post("/v1/chat/completions", json={**greedy, "stream": True},
                                      headers=key))[-2]["choices"][0]["ats"],
              client.post("/v1/chat/completions", json=CHAT, headers=key).json()["choices"][0]["ats"]]
    client.post("/v1/completions", json={"model": "m", "prompt": "Q", "echo": True, "logprobs": 1}, headers=key)
    assert [f["certified_format"] for f in fields] == [True, True, False] and all(f["answered"] for f in fields)
    assert client.get("/v1/ats/monitor").status_code == 401
    report = client.get("/v1/ats/monitor", headers=key).json()
    assert report["served"] == {"true": {"answers": 2, "answered": 2, "coverage": 1.0},
                                "false": {"answers": 1, "answered": 1, "coverage": 1.0},
                                "unknown": {"answers": 0, "answered": 0, "coverage": None}}
    assert report["certified"]["coverage"] == CERTIFIED.coverage and report["threshold_file"] == "cal/threshold.json"
    exposed = {(s.labels["answered"], s.labels["certified_format"]): s.value
               for family in text_string_to_metric_families(generate_latest(REGISTRY).decode())
               for s in family.samples if s.name == "ats_answers_total"}
    assert exposed == {("true", "true"): 2, ("true", "false"): 1, ("false", "true"): 0, ("false", "false"): 0,
                       ("true", "unknown"): 0, ("false", "unknown"): 0}
    without = TestClient(ATSMiddleware(stand_in([]), decider=AnswerDecider(None, frozenset({"<eos>"}))))
    assert without.get("/v1/ats/monitor", headers=key).status_code == 404
    assert "ats_answers_total" not in generate_latest(REGISTRY).decode()  # the default registry's: the last one's


def test_an_answer_the_server_cut_short_is_outside_the_certificate():
    decider = AnswerDecider(CERTIFIED, frozenset({"<eos>"}), certificate())
    fields = certificate().format_fields(max_tokens=64, chat_template=True)
    assert fields == {"certified_format": True, "outside_certificate": None}
    response = {"choices": [{"index": 0, "logprobs": {"content": TOKENS[:2]}, "finish_reason": "abort"},
                            {"index": 1, "logprobs": {"content": TOKENS}, "finish_reason": "stop"}]}
    cut, whole = (c["ats"] for c in add_decisions(response, decider, False, fields)["choices"])
    assert cut == {**DECISION, "certified_format": False, "outside_certificate": CUT_SHORT}
    assert whole == {**DECISION, **fields}
    stream = StreamDecisions(decider, False, fields)  # a stream's choice cut short, on the chunk that ends it
    stream.edit({"choices": [{"index": 0, "delta": {"content": "Par"}, "logprobs": {"content": TOKENS[:1]},
                              "finish_reason": None}]})
    last = stream.edit({"choices": [{"index": 0, "delta": {"content": "is"}, "logprobs": {"content": TOKENS[1:2]},
                                     "finish_reason": "abort"}]})
    assert last["choices"][0]["ats"] == {**DECISION, "certified_format": False, "outside_certificate": CUT_SHORT}
    assert add_decisions(None, decider, False, fields) is None  # vLLM's `null` body for a request it gave up on


def engine_stand_in(answer_after_stop: bool):
    """vLLM's app with ats's layer inside it (as `--middleware` puts it) and an engine client whose `errored` the
    test sets: its routes run until the engine stops, a stream after one chunk; then they answer vLLM's 500 (vLLM's
    engine that died of an error) or, as vLLM 0.32's at shutdown, never."""
    from types import SimpleNamespace

    from starlette.middleware import Middleware

    engine = SimpleNamespace(errored=False)

    async def until_stopped():
        while not engine.errored:
            await asyncio.sleep(0.01)
        if not answer_after_stop:
            await asyncio.Event().wait()  # never answered

    async def plain(request):
        await request.json()
        await until_stopped()
        return JSONResponse({"error": {"message": "EngineDeadError", "code": 500}}, status_code=500)

    async def stream(request):
        await request.json()

        async def chunks():
            first = {"object": "text_completion", "choices": [{"index": 0, "text": "Par", "finish_reason": None}]}
            yield f"data: {json.dumps(first)}\n\n"
            await until_stopped()
            yield 'data: {"error": {"message": "EngineDeadError", "code": 500}}\n\n'

        return StreamingResponse(chunks(), media_type="text/event-stream")

    app = Starlette(routes=[Route("/v1/completions", plain, methods=["POST"]),
                            Route("/v1/chat/completions", stream, methods=["POST"])],
                    middleware=[Middleware(ATSMiddleware, decider=AnswerDecider(CERTIFIED, frozenset({"<eos>"})))])
    app.state.engine_client = engine
    return app, engine


@pytest.mark.parametrize("answer_after_stop", [False, True])
def test_a_request_the_stopped_engine_leaves_unanswered_ends_with_ats_serves_shutdown_error(monkeypatch,
                                                                                          answer_after_stop):
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    monkeypatch.setattr(shutdown, "POLL", 0.05)
    monkeypatch.setattr(shutdown, "GRACE", 0.5)
    app, engine = engine_stand_in(answer_after_stop)
    threading.Timer(0.3, lambda: setattr(engine, "errored", True)).start()
    with TestClient(app) as client:
        plain = client.post("/v1/completions", json={"model": "m", "prompt": "Q"})
        if answer_after_stop:  # vLLM answered within the grace period: its answer goes through
            assert plain.status_code == 500 and plain.json()["error"]["message"] == "EngineDeadError"
        else:
            assert plain.status_code == 503 and plain.json()["error"]["code"] == SHUTTING_DOWN
            assert plain.json()["error"]["message"].startswith("the server shut down before this request finished")
        engine.errored = False
        threading.Timer(0.3, lambda: setattr(engine, "errored", True)).start()
        events = read_stream(client.post("/v1/chat/completions", json={**CHAT, "stream": True}))
    assert events[0]["choices"][0]["text"] == "Par" and len(events) == 2
    error = events[-1]["error"]  # the stream's last event: an error the openai client raises
    assert error["message"] == "EngineDeadError" if answer_after_stop else error["code"] == SHUTTING_DOWN
