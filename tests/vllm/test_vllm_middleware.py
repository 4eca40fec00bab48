"""ats's layer in vLLM's server (`ATSMiddleware`) around a stand-in for vLLM's routes that answers in vLLM's
format and records what it was sent: the chat roles `ats serve` refuses get its 400, logprobs are asked for and
the `ats` decision added to each choice (hand-computed), logprobs nobody asked for removed; streams, echoed
completions (their logprobs start with the prompt's) and requests without the API key untouched. The slow server
test (test_vllm_cli.py) runs it in vLLM's real server."""

from __future__ import annotations

import json
import math

import pytest
from starlette.applications import Starlette
from starlette.responses import JSONResponse
from starlette.routing import Route
from starlette.testclient import TestClient
from test_vllm_abstain import CERTIFIED

from ats.integrations.vllm.abstain import AnswerDecider
from ats.integrations.vllm.middleware import ATSMiddleware

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

    return Starlette(routes=[Route("/v1/chat/completions", chat, methods=["POST"]),
                             Route("/v1/completions", completion, methods=["POST"])])


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


def test_streams_and_requests_without_the_key_pass_through(monkeypatch):
    seen: list = []
    monkeypatch.setenv("VLLM_API_KEY", "k")
    client = TestClient(ATSMiddleware(stand_in(seen), decider=AnswerDecider(CERTIFIED, frozenset({"<eos>"}))))
    bad = {**CHAT, "messages": [{"role": "wizard", "content": "hi"}]}
    assert client.post("/v1/chat/completions", json=bad).status_code == 200  # vLLM's auth answers it (401) there
    assert "ats" not in client.post("/v1/chat/completions", json=CHAT).json()["choices"][0]
    keyed = client.post("/v1/chat/completions", json={**CHAT, "stream": True},
                        headers={"Authorization": "Bearer k"}).json()["choices"][0]
    assert "ats" not in keyed and seen[-1] == {**CHAT, "stream": True}
    assert client.post("/v1/chat/completions", json=bad, headers={"Authorization": "Bearer k"}).status_code == 400
    assert json.loads(json.dumps(seen))  # the stand-in saw JSON bodies throughout
