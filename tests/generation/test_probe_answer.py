"""A correctness probe in decoding: `generate_calibrated` reports the probe's P(correct) as the answer confidence,
equal to the probe applied to views computed here from the model's own hidden-state outputs, and its tokens'
probabilities are the temperature's."""

from __future__ import annotations

import math

import pytest
import torch

from ats.calibrators.probe import VIEWS, CorrectnessProbe
from ats.generation import eos_ids, generate_calibrated


@pytest.fixture(scope="module")
def probe(tiny_backbone):
    g = torch.Generator().manual_seed(0)
    p = CorrectnessProbe(layers=[0], views=list(VIEWS), c=1.0, hidden_size=tiny_backbone.hidden_size,
                         base_model=tiny_backbone.name, revision=tiny_backbone.revision)
    d = len(VIEWS) * tiny_backbone.hidden_size + 1
    p.set_weights(0.3 * torch.randn(d, generator=g), -0.1, 0.1 * torch.randn(d, generator=g),
                  1 + torch.rand(d, generator=g))
    p.temperature = 1.5
    return p


@torch.no_grad()
def test_generated_answer_confidence_is_the_probes(tiny_backbone, probe):
    out = generate_calibrated(tiny_backbone, probe, "the sky is", max_new_tokens=6, chat_template=False)[0]
    plain = generate_calibrated(tiny_backbone, None, "the sky is", max_new_tokens=6, chat_template=False)[0]
    assert out.token_ids == plain.token_ids and out.confidence_kind == "probe"
    from ats.generation.calibration import DecodingCalibration

    assert "correctness probe's P(correct) from layers [0]" in DecodingCalibration(probe, tiny_backbone).describe()
    prompt = tiny_backbone.tokenizer("the sky is").input_ids
    answer = [t for t in out.token_ids if t not in eos_ids(tiny_backbone)]
    model = tiny_backbone.model(input_ids=torch.tensor([prompt + answer]), output_hidden_states=True)
    states = model.hidden_states[1][0]  # layer 0's output (T, H)
    views = torch.stack([states[len(prompt) - 1], states[len(prompt):].mean(0), states[-1]])[None, None]
    raw = sum(plain.confidences[:len(answer)]) / len(answer)
    expected = float(probe.answer_confidence(views, [raw])[0])
    assert out.answer_confidence == pytest.approx(expected, abs=1e-5)
    assert not math.isclose(expected, raw, abs_tol=1e-3)  # the probe's, not the tokens' mean
    # the tokens: the temperature's probabilities
    logits = model.logits[0, len(prompt) - 1:-1].float() / probe.temperature
    expected_tokens = torch.softmax(logits, -1).gather(1, torch.tensor(answer)[:, None])[:, 0]
    torch.testing.assert_close(torch.tensor(out.confidences[:len(answer)]), expected_tokens.float(), atol=1e-5,
                               rtol=1e-4)


@torch.no_grad()
def test_a_confidence_only_probe_is_platt_scaling_of_the_answers_mean_token_probability(tiny_backbone):
    p = CorrectnessProbe(layers=[], views=[], c=1.0, hidden_size=tiny_backbone.hidden_size,
                         base_model=tiny_backbone.name, revision=tiny_backbone.revision)
    p.set_weights(torch.tensor([1.7]), -0.4, torch.tensor([0.2]), torch.tensor([2.0]))
    p.temperature = 1.0
    out = generate_calibrated(tiny_backbone, p, "the sky is", max_new_tokens=6, chat_template=False)[0]
    plain = generate_calibrated(tiny_backbone, None, "the sky is", max_new_tokens=6, chat_template=False)[0]
    answer = [t for t in out.token_ids if t not in eos_ids(tiny_backbone)]
    raw = sum(plain.confidences[:len(answer)]) / len(answer)
    expected = 1 / (1 + math.exp(-(1.7 * (math.log(raw / (1 - raw)) - 0.2) / 2.0 - 0.4)))
    assert out.answer_confidence == pytest.approx(expected, abs=1e-5)
