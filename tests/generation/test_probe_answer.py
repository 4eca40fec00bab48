"""A correctness probe in decoding: `generate_calibrated` reports the probe's P(correct) as the answer confidence,
equal to the probe applied to views computed here from the model's own hidden-state outputs, and its tokens'
probabilities are the temperature's."""

from __future__ import annotations

import math

import pytest
import torch

from ats.calibrators.probe import VIEWS, CorrectnessProbe
from ats.generation import eos_ids, generate_calibrated

from helpers import make_tiny_backbone


def random_probe(backbone, layers: list[int]) -> CorrectnessProbe:
    """A probe with random weights on `layers` (all views, and the confidence) of `backbone`."""
    g = torch.Generator().manual_seed(0)
    p = CorrectnessProbe(layers=layers, views=list(VIEWS), c=1.0, hidden_size=backbone.hidden_size,
                         base_model=backbone.name, revision=backbone.revision)
    d = len(layers) * len(VIEWS) * backbone.hidden_size + 1
    p.set_weights(0.3 * torch.randn(d, generator=g), -0.1, 0.1 * torch.randn(d, generator=g),
                  1 + torch.rand(d, generator=g))
    p.temperature = 1.5
    return p


@pytest.fixture(scope="module")
def probe(tiny_backbone):
    return random_probe(tiny_backbone, [0])


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
    assert out.uncalibrated_answer_confidence == pytest.approx(raw, abs=1e-6)  # the tokens' own mean, no probe
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


def _independent_probe(backbone, probe, prompt: list[int], answer: list[int], raw: float) -> float:
    """The probe on views computed from the model's own `output_hidden_states` over prompt + answer, unpadded."""
    model = backbone.model(input_ids=torch.tensor([prompt + answer]), output_hidden_states=True)
    states = torch.stack([model.hidden_states[layer + 1][0] for layer in probe.layers], 1)  # (T, L, H)
    n = len(prompt)
    views = torch.stack([states[n - 1], states[n:].mean(0), states[-1]], 1)[None]  # (1, L, 3, H)
    return float(probe.answer_confidence(views, [raw])[0])


@torch.no_grad()
def test_decoding_reads_the_probes_views_without_a_second_pass(tokenizer):
    """Rows of different prompt lengths decoded together, finishing by end-of-sequence, by a stop string (tokens fed
    after the answer's end) and by max_tokens: each row's probe confidence equals the probe on the model's own
    unpadded hidden states, and none needed a pass of its own (the row cut by max_tokens is fed its last token in
    one more batched step)."""
    from ats.generation.decoder import Decoder, Row
    from ats.generation.sampling import SamplingParams

    greedy_ = SamplingParams(temperature=0)

    tiny_backbone = make_tiny_backbone(tokenizer, tie_word_embeddings=False, output_scale=60.0, layers=3)  # varied
    probe = random_probe(tiny_backbone, [0, 1])  # (the last layer's hidden_states entry is after the norm)
    tok = tiny_backbone.tokenizer
    prompts = [tok(t).input_ids for t in ("the sky is", "a b c d e f g h", "once upon a time there")]
    plain = Decoder(tiny_backbone)
    greedy = [Row(p, i, tok, max_tokens=12, sampling=greedy_) for i, p in enumerate(prompts)]
    plain.run(greedy)
    tokens = [[r.token for r in row.records] for row in greedy]
    decoder = Decoder(tiny_backbone, probe)
    end = next(j for j in range(2, 12) if tokens[0][j] not in tokens[0][:j])
    decoder.eos = {tokens[0][end]}  # row 0 ends at a token of its own greedy text (its first occurrence)
    text = tok.decode(tokens[1])
    cut = next(k for k in range(2, 10) if text.find(tok.decode(tokens[1][k:k + 2])) == len(tok.decode(tokens[1][:k])))
    stop = tok.decode(tokens[1][cut:cut + 2])  # row 1: the text is cut before its token `cut`, after cut + 2 fed
    rows = [Row(prompts[0], 0, tok, max_tokens=12, sampling=greedy_),
            Row(prompts[1], 1, tok, max_tokens=12, stop=[stop], sampling=greedy_),
            Row(prompts[2], 2, tok, max_tokens=7, sampling=greedy_)]
    decoder.run(rows)
    assert [r.finish for r in rows] == ["eos", "stop", "length"]
    for row in rows:
        answer = [r for r in row.records if r.answer]
        raw = sum(math.exp(r.uncalibrated) for r in answer) / len(answer)
        expected = _independent_probe(tiny_backbone, probe, row.prompt, [r.token for r in answer], raw)
        got = next(r.answer_probability for r in reversed(row.records) if r.answer_probability is not None)
        assert got == pytest.approx(expected, abs=2e-5)
    assert len([r for r in rows[1].records if r.answer]) < len(rows[1].generated)  # the stop string's tokens were fed
    assert decoder.calibration.probe_passes == 0
    assert [len(r.records) for r in rows] == [end + 1, cut, 7]  # the held step's own choice was dropped


@torch.no_grad()
def test_a_row_held_one_step_draws_nothing_from_the_shared_random_generator(tiny_backbone, probe):
    """Sampled rows without their own generator draw together from the global one: a row cut by max_tokens and held
    one step for the probe leaves the other rows' draws as a temperature-only decoder (the probe's token half)
    makes them."""
    from ats.calibrators import build_calibrator
    from ats.generation.decoder import Decoder, Row
    from ats.generation.sampling import SamplingParams

    tok = tiny_backbone.tokenizer
    temperature = build_calibrator("temperature")
    temperature.temperature = probe.temperature

    def sampled(calibrator) -> list[list[int]]:
        rows = [Row(tok(t).input_ids, i, tok, max_tokens=n, sampling=SamplingParams(temperature=1.0))
                for i, (t, n) in enumerate((("the sky is", 3), ("a b c", 9), ("once upon", 9)))]
        torch.manual_seed(7)
        Decoder(tiny_backbone, calibrator).run(rows)
        return [row.generated for row in rows]

    assert sampled(probe) == sampled(temperature)
