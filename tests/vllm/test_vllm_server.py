"""`ats serve --engine vllm` as a user runs it (slow): one vLLM server for the module, on the tiny Llama with a
transformer head certified as `ats certify` certifies it, with an API key. The openai client gets the calibrated
logprobs of ats's decoding core; the `ats` field of plain and streamed chats and completions is the decision
`AnswerDecider` makes on ats's own tokens (the stream's on the chunk that finishes the choice), with the request's
word on the certified format as the export's certificate gives it; the playground page at `/` (the same files as
`ats serve`'s) asks for the key, shades each token by the calibrated probability of the same greedy request through
the API, shows the `ats` field's decision, says what vLLM cannot show, and shows markup as text."""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

import httpx
import pytest
from test_vllm_abstain import CERTIFIED

from ats.calibrators import load_calibrator
from ats.evaluation.threshold import read_certificate
from ats.generation.api import encode_prompts
from ats.integrations.vllm import CALIBRATOR_FOLDER
from ats.integrations.vllm.abstain import AnswerDecider
from ats.integrations.vllm.page import NO_TRAINING_RECORD, UNAVAILABLE
from ats.serving.api_errors import MAX_REQUEST_BYTES

from helpers import write_certificate
from vllm_helpers import ats_serve_vllm, calibrators, max_difference, reference

sys.path.insert(0, str(Path(__file__).parents[1] / "serving"))
from browser import ask, chromium, markup_is_text, open_page, shade, spans, wait_for  # noqa: E402
from server_process import API_KEY  # noqa: E402

pytestmark = pytest.mark.slow  # one vLLM server (30-90 s to start here) and a browser
PROMPT = "The capital of France is"
MAX_TOKENS = 8


class VLLMServer:
    """The running server: its url, its export (made on the fly under the cache), its log, the backbone and head."""

    def __init__(self, url: str, export: Path, log: Path, backbone, head: Path) -> None:
        self.url, self.export, self.log, self.backbone, self.head = url, export, log, backbone, head

    def post(self, route: str, body: dict, key: str | None = API_KEY) -> httpx.Response:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        return httpx.post(self.url + route, json={"model": "tiny", **body}, headers=headers, timeout=120)


@pytest.fixture(scope="module")
def vllm_server(tiny_models, tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("vllm-server")
    folder, backbone = tiny_models["llama"]
    head = calibrators(backbone, tmp_path, ["transformer"])["transformer"]
    write_certificate(head, CERTIFIED, load_calibrator(head), backbone)
    # no VLLM_CPU_* settings and no --gpu-memory-utilization: ats serve's CPU defaults start it on this machine
    env = {key: value for key, value in os.environ.items() if not key.startswith("VLLM_CPU_")}
    env["ATS_CACHE"] = str(tmp_path / "cache")
    argv = ["--model", str(folder), "--calibrator", str(head), "--served-model-name", "tiny", "--max-model-len", "512",
            "--api-key", API_KEY, "--", "--enforce-eager"]
    log_path = tmp_path / "server.log"
    with ats_serve_vllm(argv, env, log_path) as url:
        (export,) = (tmp_path / "cache" / "vllm").iterdir()  # the export, made on the fly under the cache
        yield VLLMServer(url, export, log_path, backbone, head)
        served = log_path.read_text()  # before it stops (vLLM logs its engine's exit as a traceback)
    assert "Traceback" not in served, served[-4000:]  # the middleware failed on no request


def token_id(token: str) -> int:
    """The id in "token_id:123" (vLLM's return_tokens_as_token_ids)."""
    return int(token.split(":")[1])


def ats_reference(server: VLLMServer) -> dict:
    """ats's decoding core on the prompt through the chat template, greedy, MAX_TOKENS tokens (end-of-sequence
    ignored): its tokens and calibrated logprobs, and the answer confidence (all tokens count: cut by length)."""
    ids = encode_prompts(server.backbone, [PROMPT])[0][0].tolist()
    (want,) = reference(server.backbone, load_calibrator(server.head), [ids], MAX_TOKENS, 5)
    want["confidence"] = sum(math.exp(step[t]) for step, t in zip(want["logprobs"], want["tokens"])) / MAX_TOKENS
    return want


def stream_chunks(response: httpx.Response) -> list[dict]:
    """The JSON chunks of a server-sent event stream, up to [DONE] (which must end it)."""
    data = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    return [json.loads(d) for d in data[:-1]]


CHAT = {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": MAX_TOKENS, "temperature": 0,
        "ignore_eos": True}


def test_the_openai_client_gets_calibrated_logprobs_and_the_decision(vllm_server):
    from openai import OpenAI

    client = OpenAI(base_url=vllm_server.url + "/v1", api_key=API_KEY)
    out = client.chat.completions.create(model="tiny", messages=CHAT["messages"], max_tokens=MAX_TOKENS,
                                         temperature=0, logprobs=True, top_logprobs=5,
                                         extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True})
    bare = client.chat.completions.create(model="tiny", messages=CHAT["messages"], max_tokens=MAX_TOKENS,
                                          temperature=0, extra_body={"ignore_eos": True})
    want = ats_reference(vllm_server)
    tokens = out.choices[0].logprobs.content
    got = {"tokens": [token_id(t.token) for t in tokens],
           "logprobs": [{token_id(a.token): a.logprob for a in [t, *t.top_logprobs]} for t in tokens]}
    assert max_difference(got, want, keys=("logprobs",)) <= 1e-3
    # the client's answer-or-abstain decision from ats's own decoding core, against the threshold the export carries
    decision = AnswerDecider.from_export(vllm_server.export).decide(out.choices[0])
    assert decision["answer_confidence"] == pytest.approx(want["confidence"], abs=1e-4)
    assert decision == {**CERTIFIED.decide(decision["answer_confidence"]),
                        "answer_confidence": decision["answer_confidence"]}
    # the server's own `ats` field is that decision, also when the client asked for no logprobs (none returned),
    # with the request's word on the format: 8 tokens past end-of-sequence, outside the certified 64
    fields = read_certificate(vllm_server.export / CALIBRATOR_FOLDER).format_fields(
        max_tokens=MAX_TOKENS, chat_template=True, ignore_eos=True)
    assert fields["certified_format"] is False and "ignore_eos" in fields["outside_certificate"]
    assert out.choices[0].model_dump()["ats"] == {**decision, **fields}
    assert bare.choices[0].model_dump()["ats"] == {**decision, **fields} and bare.choices[0].logprobs is None
    # a role ats serve refuses: its 400 (vLLM alone answers 200 and generates); no key: vLLM's own 401
    wizard = vllm_server.post("/v1/chat/completions", {"messages": [{"role": "wizard", "content": PROMPT}]})
    assert wizard.status_code == 400
    assert wizard.json()["error"]["message"].startswith("messages.0.role: Input should be 'system'")
    assert vllm_server.post("/v1/chat/completions", CHAT, key=None).status_code == 401
    # a body over ats serve's default limit: its 413, with the key (none: vLLM's 401, whatever the size)
    big = vllm_server.post("/v1/chat/completions", {**CHAT, "user": "x" * MAX_REQUEST_BYTES})
    assert big.status_code == 413 and big.json()["error"]["code"] == "request_too_large"
    assert vllm_server.post("/v1/chat/completions", {**CHAT, "user": "x" * MAX_REQUEST_BYTES}, key=None).status_code \
        == 401
    log = vllm_server.log.read_text()
    for setting in ("VLLM_CPU_NUM_OF_RESERVED_CPU=0", "VLLM_CPU_OMP_THREADS_BIND=", "VLLM_CPU_KVCACHE_SPACE=1"):
        assert f"vLLM on CPU: {setting}" in log


def test_a_stream_carries_the_decision_on_ats_tokens(vllm_server):
    want = ats_reference(vllm_server)
    decision = {**CERTIFIED.decide(want["confidence"]), "answer_confidence": pytest.approx(want["confidence"],
                                                                                          abs=1e-4)}
    fields = read_certificate(vllm_server.export / CALIBRATOR_FOLDER).format_fields(
        max_tokens=MAX_TOKENS, chat_template=True, ignore_eos=True)
    asked = stream_chunks(vllm_server.post("/v1/chat/completions", {
        **CHAT, "stream": True, "logprobs": True, "extra": None, "return_tokens_as_token_ids": True}))
    choices = [c["choices"][0] for c in asked if c["choices"]]
    tokens = [token_id(t["token"]) for c in choices if c.get("logprobs") for t in c["logprobs"]["content"]]
    assert tokens == want["tokens"]  # the stream's tokens are ats's greedy tokens
    finished = [c for c in choices if c.get("finish_reason")]
    assert len(finished) == 1 and finished[-1] is choices[-1]  # as in ats serve's stream: on the finishing chunk
    assert finished[0]["ats"] == {**decision, **fields}
    assert all("ats" not in c for c in choices[:-1])
    bare = [c["choices"][0] for c in stream_chunks(vllm_server.post("/v1/chat/completions", {**CHAT, "stream": True}))
            if c["choices"]]
    assert all(c.get("logprobs") is None for c in bare) and bare[-1]["ats"] == {**decision, **fields}
    # a completion of the same text after the chat template's prompt: same tokens, same decision; no chat template,
    # so outside a certificate of chat answers
    prompt = encode_prompts(vllm_server.backbone, [PROMPT])[0][0].tolist()
    completion = [c["choices"][0] for c in stream_chunks(vllm_server.post("/v1/completions", {
        "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True, "stream": True}))
        if c["choices"]]
    outside = read_certificate(vllm_server.export / CALIBRATOR_FOLDER).format_fields(
        max_tokens=MAX_TOKENS, chat_template=False, ignore_eos=True)
    assert completion[-1]["ats"] == {**decision, **outside} and completion[-1]["logprobs"] is None


def test_a_greedy_chat_of_the_certified_length_is_in_the_certified_format(vllm_server):
    certificate = read_certificate(vllm_server.export / CALIBRATOR_FOLDER)
    limit = certificate.served["format"]["max_tokens"]
    ats = vllm_server.post("/v1/chat/completions", {"messages": CHAT["messages"], "max_tokens": limit,
                                                    "temperature": 0}).json()["choices"][0]["ats"]
    assert ats["certified_format"] is True and ats["outside_certificate"] is None


def test_the_monitor_counts_the_decisions_and_vllms_metrics_carry_them(vllm_server):
    """A greedy chat of the certified length and a completion (outside a chat certificate): the report at
    /v1/ats/monitor grows by the two decisions, and vLLM's own /metrics carries the report's counts."""
    from prometheus_client.parser import text_string_to_metric_families

    headers = {"Authorization": f"Bearer {API_KEY}"}

    def report() -> dict:
        return httpx.get(vllm_server.url + "/v1/ats/monitor", headers=headers, timeout=30).json()

    def answered(r: dict, fmt: str) -> tuple[int, int]:
        return r["served"][fmt]["answers"], r["served"][fmt]["answered"]

    before = report()
    limit = read_certificate(vllm_server.export / CALIBRATOR_FOLDER).served["format"]["max_tokens"]
    chat = vllm_server.post("/v1/chat/completions", {"messages": CHAT["messages"], "max_tokens": limit,
                                                     "temperature": 0}).json()["choices"][0]["ats"]
    completion = vllm_server.post("/v1/completions", {"prompt": PROMPT, "max_tokens": MAX_TOKENS,
                                                      "temperature": 0}).json()["choices"][0]["ats"]
    after = report()
    assert chat["certified_format"] is True and completion["certified_format"] is False
    for fmt, ats in (("true", chat), ("false", completion)):
        (n0, a0), (n1, a1) = answered(before, fmt), answered(after, fmt)
        assert (n1 - n0, a1 - a0) == (1, int(ats["answered"]))
    assert after["certified"]["coverage"] == CERTIFIED.coverage
    assert httpx.get(vllm_server.url + "/v1/ats/monitor", timeout=30).status_code == 401
    metrics = httpx.get(vllm_server.url + "/metrics", timeout=30).text
    exposed = {(s.labels["certified_format"], s.labels["answered"]): s.value
               for family in text_string_to_metric_families(metrics) for s in family.samples
               if s.name == "ats_answers_total"}
    for fmt in ("true", "false", "unknown"):
        answers, answered_ = answered(after, fmt)
        assert (exposed[fmt, "true"], exposed[fmt, "false"]) == (answered_, answers - answered_)
    assert "vllm:" in metrics  # beside vLLM's own


@pytest.fixture(scope="module")
def browser():
    yield from chromium()


def api_chat(server: VLLMServer, text: str) -> dict:
    """The page's request through the API, not streamed: greedy, MAX_TOKENS, logprobs with 5 alternatives."""
    response = server.post("/v1/chat/completions", {"messages": [{"role": "user", "content": text}],
                                                    "max_tokens": MAX_TOKENS, "temperature": 0, "logprobs": True,
                                                    "top_logprobs": 5})
    response.raise_for_status()
    return response.json()["choices"][0]


def test_the_page_shows_what_vllm_returns(vllm_server, browser):
    assert httpx.get(vllm_server.url + "/", timeout=10).status_code == 200  # the page's files are open
    assert httpx.get(vllm_server.url + "/v1/playground", timeout=10).status_code == 401  # its data needs the key
    text = "Tell me about the sea."
    open_page(browser, vllm_server.url, API_KEY, forget_key=True)
    limit = read_certificate(vllm_server.export / CALIBRATOR_FOLDER).served["format"]["max_tokens"]
    assert browser.find_element("id", "max-tokens").get_attribute("value") == str(limit)  # the certified length
    ask(browser, text, 1, MAX_TOKENS)
    choice = api_chat(vllm_server, text)
    content, ats = choice["logprobs"]["content"], choice["ats"]
    shown = spans(browser, 0)
    assert len(shown) == len(content) > 0
    for span, entry in zip(shown, content):  # the shading: the calibrated probability vLLM returned
        assert float(span["confidence"]) == pytest.approx(math.exp(entry["logprob"]), abs=1e-6)
        assert float(span["p"]) == float(span["confidence"]) and span["colour"] == shade(float(span["p"]))
        assert span["raw"] == ""  # no raw probability from vLLM
    verdict = browser.find_element("id", "verdict")
    assert verdict.get_attribute("data-answered") == str(ats["answered"]).lower()
    assert browser.find_element("id", "decision").text == ("Answer" if ats["answered"] else "Abstain")
    assert float(verdict.get_attribute("data-answer-confidence")) == pytest.approx(ats["answer_confidence"], abs=1e-9)
    assert verdict.get_attribute("data-certified-format") == str(ats["certified_format"]).lower() == "false"
    assert ats["outside_certificate"] in browser.find_element("id", "outside-certificate").text
    # the server's count of its decisions, read by the page from the middleware (both answers above are outside the
    # certified format, so the in-format count the page read is still the report's)
    report = httpx.get(vllm_server.url + "/v1/ats/monitor", headers={"Authorization": f"Bearer {API_KEY}"},
                       timeout=10).json()
    monitor = browser.find_element("id", "monitor")
    assert monitor.get_attribute("data-answers") == str(report["served"]["true"]["answers"])
    assert monitor.get_attribute("data-alarm") == str(report["shift"]["alarm"]).lower()
    # what vLLM cannot show is disabled or hidden, each with its reason
    assert browser.find_element("css selector", "input[name=shade][value=raw]").get_attribute("disabled") is not None
    notes = {li.get_attribute("data-feature"): li.text for li in
             browser.find_elements("css selector", "#unavailable li")}
    reasons = {**UNAVAILABLE, "training": NO_TRAINING_RECORD}  # the export's copy of the head has no fingerprint
    assert set(notes) == set(reasons) and all(reasons[k] in notes[k] for k in notes)
    assert NO_TRAINING_RECORD in browser.find_element("id", "no-training").text
    assert browser.find_element("id", "calibrator").get_attribute("disabled") is not None
    assert UNAVAILABLE["evaluation"] in browser.find_element("id", "no-evaluation").text
    browser.find_elements("css selector", ".turn.assistant .tok")[0].click()
    assert browser.find_element("id", "token-calibrated").text == f"{math.exp(content[0]['logprob']):.3f}"
    assert UNAVAILABLE["raw"] in browser.find_element("id", "token-raw").text
    wait_for(browser, "return document.body.dataset.streaming === 'false'")


def test_markup_in_a_prompt_is_text_on_vllm(vllm_server, browser):
    markup_is_text(browser, vllm_server.url, API_KEY, MAX_TOKENS)
