"""Bad requests get the right status and an OpenAI-format message and the server keeps serving; clients that leave
or read slowly never hold the others back; `ats serve` refuses bad options before the model loads."""

from __future__ import annotations

import json
import socket
import time

import httpx
import openai
import pytest

from ats.cli.main import main
from ats.serving.api_errors import MAX_REQUEST_BYTES

from server_process import API_KEY, MODEL_NAME

CHAT = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "temperature": 0}


def post(server, path: str, body=None, *, content: str | None = None, key: str | None = API_KEY) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    if content is not None:
        headers["Content-Type"] = "application/json"
        return httpx.post(server.url + path, content=content, headers=headers, timeout=30)
    return httpx.post(server.url + path, json=body, headers=headers, timeout=30)


def error(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    body = response.json()["error"]
    assert set(body) == {"message", "type", "param", "code"} and body["message"]
    return body


def wait_for(condition, timeout: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.1)
    return False


@pytest.mark.parametrize("body,param,words", [
    ({**CHAT, "max_tokens": -1}, "max_tokens", "greater than or equal to 1"),
    ({**CHAT, "top_p": 1.5}, "top_p", "less than or equal to 1"),
    ({**CHAT, "temperature": -0.5}, "temperature", "greater than or equal to 0"),
    ({**CHAT, "n": 0}, "n", "greater than or equal to 1"),
    ({**CHAT, "messages": []}, "messages", "at least 1 item"),
    ({**CHAT, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages.0.content", "only text content is supported"),
    ({**CHAT, "top_logprobs": 3}, None, "top_logprobs requires logprobs"),
    ({**CHAT, "frequency_penalty": 0.5}, "frequency_penalty", "not supported by this server; leave it out or send 0 "
                                                             "(got 0.5)"),
    ({key: v for key, v in CHAT.items() if key != "model"}, "model", "Field required"),
    ({**CHAT, "seed": 2 ** 64}, "seed", "less than or equal to 18446744073709551615"),  # once: a request never answered
    ({**CHAT, "stop": ["a", 7]}, "stop.1", "Input should be a valid string (got 7)"),  # the bad item, not 'not a str'
    ({**CHAT, "messages": [{"role": "user", "content": [{"type": "text"}]}]}, "messages.0.content.0.text",
     "Field required"),
    ({**CHAT, "response_format": {"type": "json_object"}}, "response_format", 'send {"type": "text"}'),
    ({**CHAT, "tool_choice": "required"}, "tool_choice", 'send "none" or "auto"'),
    ({**CHAT, "repetition_penalty": 1.3}, "repetition_penalty", "send 1 (got 1.3)"),
    ({**CHAT, "min_p": 0.1}, "min_p", "not supported by this server"),
    ({**CHAT, "max_tokens": 4, "min_tokens": 5}, "min_tokens", "5 is more than max_tokens (4)"),
    ({**CHAT, "top_k": -2}, "top_k", "greater than or equal to -1"),
])
def test_bad_chat_fields_are_400_naming_the_field(server, body, param, words):
    err = error(post(server, "/v1/chat/completions", body), 400)
    assert words in err["message"] and err["type"] == "invalid_request_error"
    if param:
        assert err["param"] == param and err["message"].startswith(param)


def test_bad_completion_requests(server):
    base = {"model": MODEL_NAME, "prompt": "Hello", "max_tokens": 2}
    assert "greater than or equal to 0" in error(post(server, "/v1/completions", {**base, "max_tokens": -3}),
                                                 400)["message"]
    err = error(post(server, "/v1/completions", {**base, "prompt": "word " * 2100}), 400)
    assert err["code"] == "context_length_exceeded" and "maximum context length is 2048" in err["message"]
    err = error(post(server, "/v1/completions", {**base, "prompt": [5, 10 ** 9]}), 400)
    assert "outside the vocabulary" in err["message"] and err["param"] == "prompt"
    assert "must not be empty" in error(post(server, "/v1/completions", {**base, "prompt": []}), 400)["message"]
    err = error(post(server, "/v1/completions", {**base, "prompt": {"a": 1}}), 400)
    assert err["param"] == "prompt" and "a list of lists of token ids" in err["message"]
    assert "logprobs" in error(post(server, "/v1/completions", {**base, "logprobs": 50}), 400)["message"]


def test_text_that_is_not_unicode_and_bodies_that_are_not_objects(server):
    """JSON can carry a lone surrogate, which no tokenizer takes (it was a 500): refused naming the field."""
    raw = json.dumps(CHAT).replace('"Hi"', '"a \\ud800 b"')
    err = error(post(server, "/v1/chat/completions", content=raw), 400)
    assert err["param"] == "messages.0.content" and "lone surrogate '\\ud800' at character 2" in err["message"]
    raw = json.dumps({"model": MODEL_NAME, "prompt": ["ok", "\udfff"], "max_tokens": 1})
    assert error(post(server, "/v1/completions", content=raw), 400)["param"] == "prompt.1"
    for content, words in (("", "has no body"), ("null", "has no body"), ("[]", "must be a JSON object, got list")):
        err = error(post(server, "/v1/chat/completions", content=content), 400)
        assert words in err["message"] and err["code"] == "invalid_json"


def test_neutral_values_of_unhonoured_options_and_vllm_sampling_extensions_are_served(server):
    neutral = {"logit_bias": {"5": 0}, "frequency_penalty": 0, "response_format": {"type": "text"},
               "tool_choice": "none", "modalities": ["text"], "min_p": 0, "repetition_penalty": 1}
    greedy = post(server, "/v1/chat/completions", CHAT).json()["choices"][0]["message"]["content"]
    assert post(server, "/v1/chat/completions", {**CHAT, **neutral}).json()["choices"][0]["message"]["content"] == \
        greedy
    # top_k 1 keeps only the most likely token: sampling then gives the greedy text, whatever the seed
    top1 = post(server, "/v1/chat/completions", {**CHAT, "temperature": 1.5, "top_k": 1, "seed": 3}).json()
    assert top1["choices"][0]["message"]["content"] == greedy


def test_models_route_and_health_answer_as_clients_ask(client, server):
    assert client.models.retrieve(MODEL_NAME).id == MODEL_NAME
    with pytest.raises(openai.NotFoundError, match="the model 'gpt-4' does not exist"):
        client.models.retrieve("gpt-4")
    head = httpx.head(server.url + "/health", timeout=10)  # load balancers' probes
    assert head.status_code == 200 and head.content == b""


def test_malformed_json_unknown_model_route_and_method(server):
    err = error(post(server, "/v1/chat/completions", content='{"model": "tiny", "messages": ['), 400)
    assert err["code"] == "invalid_json" and "JSON" in err["message"]
    err = error(post(server, "/v1/chat/completions", {**CHAT, "model": "gpt-4"}), 404)
    assert err["code"] == "model_not_found" and "'gpt-4'" in err["message"] and err["param"] == "model"
    assert error(post(server, "/v1/nothing", {}), 404)["code"] == "not_found"
    response = httpx.get(server.url + "/v1/chat/completions", headers={"Authorization": f"Bearer {API_KEY}"})
    assert error(response, 405)["code"] == "method_not_allowed"


def test_api_key_is_required_but_health_is_open(server):
    assert error(post(server, "/v1/chat/completions", CHAT, key=None), 401)["code"] == "invalid_api_key"
    err = error(post(server, "/v1/chat/completions", CHAT, key="wrong"), 401)
    assert err["message"] == "incorrect API key provided"
    # a wrong key is refused before the body is read, even a malformed one
    assert error(post(server, "/v1/chat/completions", content="{", key="wrong"), 401)["code"] == "invalid_api_key"
    assert httpx.get(server.url + "/v1/models").status_code == 401
    assert httpx.get(server.url + "/health").json()["status"] == "ok"
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        client.models.list()


def test_a_body_over_the_limit_is_a_413_before_it_is_read_whole_and_the_server_keeps_serving(server):
    limit = MAX_REQUEST_BYTES  # the shared server runs with the default
    padding = json.dumps({**CHAT, "user": "x" * limit})  # a valid request, one field long
    assert len(padding) > limit
    headers = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}
    # declared (Content-Length): refused at once
    err = error(httpx.post(server.url + "/v1/chat/completions", content=padding, headers=headers, timeout=60), 413)
    assert err["code"] == "request_too_large" and f"limit of {limit} bytes" in err["message"]

    def chunked():  # no Content-Length: refused when the bytes received pass the limit
        for start in range(0, len(padding), 2**20):
            yield padding[start:start + 2**20].encode()

    err = error(httpx.post(server.url + "/v1/completions", content=chunked(), headers=headers, timeout=60), 413)
    assert err["code"] == "request_too_large" and err["message"].startswith("POST /v1/completions: ")
    # the key is checked first: without it, a 401 whatever the size
    assert error(post(server, "/v1/chat/completions", content=padding, key=None), 401)["code"] == "invalid_api_key"
    body = post(server, "/v1/chat/completions", CHAT).json()  # the same request within the limit is served
    assert body["choices"][0]["finish_reason"] == "length"


def test_openai_client_sees_typed_errors_and_server_keeps_serving(client, server):
    with pytest.raises(openai.NotFoundError, match="the model 'nope' does not exist") as raised:
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "Hi"}])
    assert raised.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError, match="top_p: Input should be less than or equal to 1") as raised:
        client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "Hi"}], top_p=2)
    assert raised.value.param == "top_p"
    out = client.chat.completions.create(**CHAT)
    assert out.choices[0].finish_reason == "length" and out.usage.completion_tokens == 4
    assert server.health()["running"] == 0


def test_disconnected_stream_frees_its_slot(server):
    before = server.health()["cancelled"]
    body = {**CHAT, "max_tokens": 1800, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, headers=server.headers(),
                      timeout=60) as response:
        lines = []
        for line in response.iter_lines():
            lines.append(line)
            if sum(x.startswith("data:") for x in lines) >= 4:
                break  # leave mid-stream: closing the connection
    assert wait_for(lambda: server.health()["cancelled"] == before + 1)
    assert wait_for(lambda: server.health()["running"] == 0)
    assert post(server, "/v1/chat/completions", CHAT).json()["usage"]["completion_tokens"] == 4


def test_client_that_gives_up_on_a_plain_request_frees_its_slot(server):
    """The client closes its connection once the request is decoding (seen in /health), whatever the machine's
    speed: the request is cancelled and its row freed."""
    before = server.health()["cancelled"]
    body = json.dumps({**CHAT, "max_tokens": 1800, "ignore_eos": True}).encode()
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:{server.port}\r\nAuthorization: Bearer {API_KEY}"
            f"\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode()
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
        sock.sendall(head + body)
        assert wait_for(lambda: server.health()["running"] == 1)  # admitted and decoding: 1800 tokens to go
    assert wait_for(lambda: server.health()["cancelled"] == before + 1)
    assert wait_for(lambda: server.health()["running"] == 0)


def test_slow_reader_does_not_block_others(client, server):
    """A stream nobody reads for a while: other requests complete meanwhile; the stream is whole when read."""
    body = {**CHAT, "max_tokens": 300, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, headers=server.headers(),
                      timeout=60) as response:
        lines = response.iter_lines()
        first = next(lines)
        others = [client.chat.completions.create(**CHAT) for _ in range(3)]  # while the stream waits unread
        rest = [first, *lines]
    assert all(o.usage.completion_tokens == 4 for o in others)
    chunks = [line for line in rest if line.startswith("data:")]
    assert chunks[-1] == "data: [DONE]"
    assert sum('"finish_reason": "length"' in c for c in chunks) == 1


@pytest.mark.parametrize("args,words", [
    (["--host", "0.0.0.0"], "without --api-key"),
    (["--max-batch", "0"], "--max-batch: expected a positive integer"),
    (["--port", "70000"], "--port: expected a value in [1, 65535]"),
    (["--max-request-bytes", "0"], "--max-request-bytes: expected a positive integer"),
    (["--calibrator", "/no/such/head"], "/no/such/head"),
])
def test_serve_refuses_bad_options_before_loading(model_dir, head_dir, capsys, monkeypatch, args, words):
    monkeypatch.delenv("ATS_API_KEY", raising=False)
    argv = ["serve", "--model", str(model_dir), "--calibrator", str(head_dir), *args]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("ats: error:") and words in err and "\n" not in err


def test_serve_refuses_a_port_in_use(model_dir, head_dir, server, capsys):
    assert main(["serve", "--model", str(model_dir), "--calibrator", str(head_dir), "--port", str(server.port)]) == 2
    assert f"--port {server.port}: cannot bind" in capsys.readouterr().err
