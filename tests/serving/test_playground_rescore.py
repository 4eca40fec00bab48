"""Rescoring generated tokens under a calibrator (the playground's "compare"): under the calibrator that generated
them it gives back the values decoding reported, for every way a calibrator reads the model (a token head, a
prompt-level Thermometer, a logits map, a confidence map); the alternatives' raw probabilities equal one plain
forward pass; the engine runs the work on its own thread."""

from __future__ import annotations

import math

import pytest
import torch

from ats.calibrators import build_calibrator
from ats.generation import SamplingParams
from ats.generation.calibration import DecodingCalibration
from ats.generation.decoder import eos_ids
from ats.generation.logprobs import answer_confidence
from ats.serving.engine import Engine, Job
from ats.serving.rescore import rescore, unique_ids

from helpers import random_thermometer
from serving_reference import chat_ids, choices, forward

PROMPT = "Tell me about the sea."


def _thermometer(backbone):
    return random_thermometer(backbone.hidden_size, 5)


def _vector(backbone):
    g = torch.Generator().manual_seed(3)
    vector = build_calibrator("vector")
    vector.scale = 1 + 0.3 * torch.randn(backbone.vocab_size, generator=g)
    vector.bias = 0.5 * torch.randn(backbone.vocab_size, generator=g)
    return vector


def _histogram(backbone):
    tok = backbone.tokenizer
    ids = torch.tensor([tok("The quick brown fox jumps over the lazy dog. " * 4)["input_ids"]])
    with torch.no_grad():
        hidden, _ = backbone.forward(ids)
        chunk = (backbone.logits(hidden)[0, :-1].float(), ids[0, 1:])
    return build_calibrator("histogram").fit(lambda: iter([chunk]))


def _generate(backbone, calibrator, prompt_ids, max_tokens=10):
    engine = Engine(backbone, calibrator, max_batch=2)
    events = []
    engine.submit(Job([prompt_ids], max_tokens=max_tokens, sampling=SamplingParams(temperature=0), top_logprobs=3,
                      sink=events.append))
    while engine.step():
        pass
    return choices(events)[0]["tokens"]


@pytest.mark.parametrize("kind", ["head", "thermometer", "vector", "histogram", "none"])
def test_rescoring_under_the_generating_calibrator_gives_the_decoded_values(backbone, calibrator, kind):
    cal = {"head": calibrator, "thermometer": _thermometer(backbone), "vector": _vector(backbone),
           "histogram": _histogram(backbone), "none": None}[kind]
    prompt = chat_ids(backbone, PROMPT)
    made = _generate(backbone, cal, prompt)
    records, raw_top = rescore(backbone, DecodingCalibration(cal, backbone), prompt, [t.token for t in made], k=3,
                               eos=eos_ids(backbone))
    assert [r.token for r in records] == [t.token for t in made]
    for name in ("logprob", "uncalibrated", "confidence"):
        torch.testing.assert_close(torch.tensor([getattr(r, name) for r in records]),
                                   torch.tensor([getattr(t, name) for t in made]), atol=1e-4, rtol=1e-5)
    if kind in ("head", "none"):
        torch.testing.assert_close(torch.tensor([r.tau for r in records]), torch.tensor([t.tau for t in made]),
                                   atol=1e-4, rtol=1e-5)
    else:
        assert all(r.tau is None for r in records)
    assert [[i for i, _ in r.top] for r in records] == [[i for i, _ in t.top] for t in made]
    torch.testing.assert_close(torch.tensor([[lp for _, lp in r.top] for r in records]),
                               torch.tensor([[lp for _, lp in t.top] for t in made]), atol=1e-4, rtol=1e-5)
    assert [r.answer for r in records] == [t.answer for t in made]
    assert math.isclose(answer_confidence(records), answer_confidence(made), rel_tol=1e-4)
    # the alternatives' raw log-probabilities: the model's own softmax at that position, from a plain forward pass
    ids = prompt + [t.token for t in made]
    _, logz, _ = forward(backbone, None, ids)  # (T, V)
    for i, (record, raw) in enumerate(zip(records, raw_top)):
        row = len(prompt) - 1 + i
        torch.testing.assert_close(torch.tensor(raw), logz[row, [t for t, _ in record.top]], atol=1e-4, rtol=1e-5)


def test_rescoring_under_another_calibrator_is_what_it_would_have_reported(backbone, calibrator):
    """Tokens generated uncalibrated, rescored under the head: the head's values on those same tokens (greedy
    decoding picks the argmax, which a positive scale never changes, so generating under the head gives the same
    tokens and its values)."""
    prompt = chat_ids(backbone, PROMPT)
    plain = _generate(backbone, None, prompt)
    under_head = _generate(backbone, calibrator, prompt)
    assert [t.token for t in plain] == [t.token for t in under_head]
    records, _ = rescore(backbone, DecodingCalibration(calibrator, backbone), prompt, [t.token for t in plain])
    torch.testing.assert_close(torch.tensor([r.logprob for r in records]),
                               torch.tensor([t.logprob for t in under_head]), atol=1e-4, rtol=1e-5)
    assert any(abs(r.logprob - t.logprob) > 1e-3 for r, t in zip(records, plain))  # the head changed them


def test_engine_call_runs_on_the_engine_thread_and_returns_errors(backbone):
    import threading

    engine = Engine(backbone, None)
    engine.start()
    try:
        assert engine.call(lambda: threading.current_thread().name).result(30) == "ats-engine"
        with pytest.raises(ZeroDivisionError):
            engine.call(lambda: 1 / 0).result(30)
        assert engine.call(lambda: 7).result(30) == 7  # the engine goes on after a failed call
    finally:
        engine.stop()


def test_engine_call_waiting_when_the_engine_stops_fails_instead_of_hanging(backbone):
    engine = Engine(backbone, None)  # never started: the call waits
    future = engine.call(lambda: 7)
    engine.stop()
    with pytest.raises(RuntimeError, match="shutting down"):
        future.result(5)


def test_unique_ids():
    assert unique_ids(["ats", "thermometer", "ats", "ats"]) == ["ats", "thermometer", "ats#2", "ats#3"]
