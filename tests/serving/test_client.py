"""The official `openai` client against a real `ats serve` process: chat, completions, streaming and logprobs, each
value checked against the in-process API (`generate_calibrated`, or one forward pass with the calibrator)."""

from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from ats.generation import generate_calibrated

from server_process import MODEL_NAME
from serving_reference import chat_ids, forward

PROMPTS = ["The capital of France is", "Write a short poem about the sea and the wind, please.", "Hi",
           "List three colours."]


def close(actual, expected, atol: float = 1e-5) -> None:
    """Log-probabilities equal to 1e-5 (relative to 1 + |value|, see test_engine)."""
    torch.testing.assert_close(torch.as_tensor(actual, dtype=torch.float32), torch.as_tensor(expected), atol=atol,
                               rtol=1e-5)


def chat(client, prompt: str, **options):
    return client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": prompt}], **options)


def test_models_and_health(client, server):
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL_NAME]
    assert models[0].model_extra["calibrated"] is True and models[0].model_extra["max_model_len"] == 2048
    health = server.health()
    assert health["status"] == "ok" and health["calibrated"] is True and health["max_batch"] == 8


def test_greedy_chat_equals_generate_calibrated(client, backbone, calibrator):
    for prompt in PROMPTS[:2]:
        ref = generate_calibrated(backbone, calibrator, prompt, max_new_tokens=12)[0]
        out = chat(client, prompt, max_tokens=12, temperature=0, logprobs=True, top_logprobs=3)
        choice = out.choices[0]
        assert choice.message.content == ref.text and choice.finish_reason == "length"
        entries = choice.logprobs.content
        assert [e.token for e in entries] == ref.tokens
        close([math.exp(e.logprob) for e in entries], ref.confidences)
        ats = choice.model_extra["ats"]
        close([math.exp(x) for x in ats["uncalibrated_logprobs"]], ref.uncalibrated)
        close(ats["tau"], ref.taus)
        assert ats["mean_confidence"] == pytest.approx(ref.mean_confidence, abs=1e-5)
        assert ats["product_confidence"] == pytest.approx(ref.product_confidence, rel=1e-4)
        assert ats["mean_uncalibrated"] == pytest.approx(ref.mean_uncalibrated, abs=1e-5)
        assert out.usage.prompt_tokens == len(chat_ids(backbone, prompt)) and out.usage.completion_tokens == 12
        # top alternatives: the calibrated distribution's three most likely tokens at each step
        ids = chat_ids(backbone, prompt)
        logq, _, _ = forward(backbone, calibrator, ids + ref.token_ids)
        best = logq[len(ids) - 1: len(ids) - 1 + 12].topk(3)
        # the cached decoding steps against one full forward pass: float32 sums in another order differ by up to
        # ~1e-5 of the logits' size (30 here), 7e-5 on this machine's kernels
        close([[t.logprob for t in e.top_logprobs] for e in entries], best.values, atol=2e-4)
        assert [[t.token for t in e.top_logprobs] for e in entries] == [
            [backbone.tokenizer.decode([i]) for i in row] for row in best.indices.tolist()]


def test_completions_echo_scores_every_prompt_token(client, backbone, calibrator):
    texts = ["The quick brown fox jumps over the lazy dog", "Paris is the capital of"]
    ids = [backbone.tokenizer(t)["input_ids"] for t in texts]
    for prompt in (texts, ids):  # strings, and token ids as lm-eval sends them
        out = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=0, echo=True, logprobs=2)
        assert [c.index for c in out.choices] == [0, 1]
        for text, tokens, choice in zip(texts, ids, out.choices):
            logq, logz, tau = forward(backbone, calibrator, tokens)
            rows, target = torch.arange(len(tokens) - 1), torch.tensor(tokens[1:])
            lp = choice.logprobs
            assert choice.text == text and choice.finish_reason == "length"
            assert lp.tokens == [backbone.tokenizer.decode([t]) for t in tokens]
            assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
            close(lp.token_logprobs[1:], logq[rows, target])
            assert ["".join(text[a:b]) for a, b in zip(lp.text_offset, lp.text_offset[1:] + [len(text)])] == lp.tokens
            for t, top in enumerate(lp.top_logprobs[1:]):  # the 2 best and the chosen token
                best = logq[t].topk(2)
                expected = {backbone.tokenizer.decode([i]): v for i, v in zip(best.indices.tolist(),
                                                                              best.values.tolist())}
                expected.setdefault(lp.tokens[t + 1], lp.token_logprobs[t + 1])
                assert sorted(top) == sorted(expected)
                close([top[k] for k in sorted(top)], [expected[k] for k in sorted(top)])
            ats = choice.model_extra["ats"]
            close(ats["prompt_uncalibrated_logprobs"][1:], logz[rows, target])
            close(ats["prompt_tau"][1:], tau[:-1])
            assert ats["tau"] == [] and ats["mean_confidence"] is None


def test_completion_with_new_tokens_and_echo(client, backbone, calibrator):
    text = "Once upon a time"
    ids = backbone.tokenizer(text)["input_ids"]
    out = client.completions.create(model=MODEL_NAME, prompt=text, max_tokens=5, temperature=0, echo=True,
                                    logprobs=0)
    choice = out.choices[0]
    ref = generate_calibrated(backbone, calibrator, text, max_new_tokens=5, chat_template=False)[0]
    assert choice.text == text + ref.text
    lp = choice.logprobs
    assert lp.tokens == [backbone.tokenizer.decode([t]) for t in ids] + ref.tokens
    close([math.exp(x) for x in lp.token_logprobs[len(ids):]], ref.confidences)
    assert [len(top) for top in lp.top_logprobs[1:]] == [1] * (len(ids) - 1 + 5)  # the chosen token only
    assert lp.text_offset[len(ids)] == len(text)


def test_completion_stream_with_echo_and_logprobs(client):
    """Legacy streaming: the echoed prompt with its scores first, then the new tokens; together they are the plain
    response."""
    options = dict(model=MODEL_NAME, prompt=["Once upon a time", "The sea"], max_tokens=6, temperature=0, echo=True,
                   logprobs=1)
    plain = client.completions.create(**options)
    text, tokens, logprobs, offsets, finish = ["", ""], [[], []], [[], []], [[], []], [None, None]
    for chunk in client.completions.create(**options, stream=True):
        for c in chunk.choices:
            text[c.index] += c.text
            tokens[c.index] += c.logprobs.tokens
            logprobs[c.index] += c.logprobs.token_logprobs
            offsets[c.index] += c.logprobs.text_offset
            finish[c.index] = c.finish_reason or finish[c.index]
    for i, choice in enumerate(plain.choices):
        assert text[i] == choice.text and finish[i] == choice.finish_reason == "length"
        assert tokens[i] == choice.logprobs.tokens and offsets[i] == choice.logprobs.text_offset
        assert logprobs[i][0] is None and choice.logprobs.token_logprobs[0] is None
        close(logprobs[i][1:], choice.logprobs.token_logprobs[1:])


def test_stream_carries_the_same_text_and_values(client, backbone):
    plain = chat(client, PROMPTS[1], max_tokens=10, temperature=0.9, seed=3, logprobs=True, n=2)
    stream = chat(client, PROMPTS[1], max_tokens=10, temperature=0.9, seed=3, logprobs=True, n=2, stream=True,
                  stream_options={"include_usage": True})
    text, entries, ats, finish, usage = ["", ""], [[], []], [{}, {}], [None, None], None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            text[c.index] += c.delta.content or ""
            entries[c.index] += c.logprobs.content if c.logprobs else []
            for key, value in (c.model_extra.get("ats") or {}).items():
                ats[c.index][key] = ats[c.index].get(key, []) + value if isinstance(value, list) else value
            finish[c.index] = c.finish_reason or finish[c.index]
    for i, choice in enumerate(plain.choices):
        assert text[i] == choice.message.content and finish[i] == choice.finish_reason
        assert [e.token for e in entries[i]] == [e.token for e in choice.logprobs.content]
        close([e.logprob for e in entries[i]], [e.logprob for e in choice.logprobs.content])
        expected = choice.model_extra["ats"]
        assert sorted(ats[i]) == sorted(expected)
        close(ats[i]["uncalibrated_logprobs"], expected["uncalibrated_logprobs"])
        close(ats[i]["tau"], expected["tau"])
        close([ats[i][k] for k in ("mean_confidence", "product_confidence")],
              [expected[k] for k in ("mean_confidence", "product_confidence")])
    ids = chat_ids(backbone, PROMPTS[1])
    assert usage.completion_tokens == 20 and usage.prompt_tokens == len(ids)
    assert plain.choices[0].message.content != plain.choices[1].message.content


def test_stop_strings_and_ignore_eos(client):
    full = chat(client, PROMPTS[0], max_tokens=16, temperature=0).choices[0].message.content
    stop = full[len(full) // 2: len(full) // 2 + 3]
    out = chat(client, PROMPTS[0], max_tokens=16, temperature=0, stop=[stop], logprobs=True).choices[0]
    assert out.finish_reason == "stop" and out.message.content == full[:full.find(stop)]
    streamed = "".join(c.choices[0].delta.content or "" for c in
                       chat(client, PROMPTS[0], max_tokens=16, temperature=0, stop=stop, stream=True) if c.choices)
    assert streamed == out.message.content
    long = chat(client, PROMPTS[2], max_tokens=40, temperature=0, extra_body={"ignore_eos": True})
    assert long.usage.completion_tokens == 40 and long.choices[0].finish_reason == "length"


def test_concurrent_requests_get_what_they_get_alone(client, backbone, calibrator):
    """Requests sent together are decoded in one batch (left-padded, joining and leaving): same text, same values."""
    refs = [generate_calibrated(backbone, calibrator, p, max_new_tokens=8 + 3 * i)[0] for i, p in enumerate(PROMPTS)]
    jobs = [(p, 8 + 3 * i) for i, p in enumerate(PROMPTS)] * 3
    with ThreadPoolExecutor(len(jobs)) as pool:
        outs = list(pool.map(lambda j: chat(client, j[0], max_tokens=j[1], temperature=0, logprobs=True), jobs))
    for (prompt, _), out in zip(jobs, outs):
        ref = refs[PROMPTS.index(prompt)]
        assert out.choices[0].message.content == ref.text
        close([math.exp(e.logprob) for e in out.choices[0].logprobs.content], ref.confidences)
