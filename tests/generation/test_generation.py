"""Calibrated generation: greedy text unchanged, exact per-token calibrated probabilities from a KV-cached head,
sampling, batching with left padding, stop strings, streaming, processor order."""

from __future__ import annotations

import io

import pytest
import torch
from transformers import LogitsProcessor, LogitsProcessorList

from ats.calibrators.ats import ATSCalibrator
from ats.errors import ATSError
from ats.generation import (
    StreamToken,
    colorize,
    encode_prompts,
    generate_calibrated,
    print_stream,
)
from ats.generation.decoder import eos_ids

from helpers import calibrator_for, random_thermometer

PROMPTS = ["The capital of France is", "Write a short poem about the sea and the wind, please."]


@pytest.fixture(scope="module")
def calibrator(tiny_backbone) -> ATSCalibrator:
    return calibrator_for(tiny_backbone)


def reference(backbone, calibrator, prompt: str, out, chat_template: bool = True):
    """tau, calibrated and raw probabilities of `out`'s tokens from ONE full forward pass over prompt + tokens."""
    ids, mask, _ = encode_prompts(backbone, [prompt], chat_template)
    new = torch.tensor([out.token_ids])
    full = torch.cat([ids, new], 1)
    full_mask = torch.cat([mask, torch.ones_like(new)], 1)
    hidden, _ = backbone.forward(full, full_mask)
    with torch.no_grad():
        tau = calibrator.log_scale(hidden, full_mask)[0]  # (T,)
        z = backbone.logits(hidden)[0].float()  # (T, V)
    P = ids.shape[1]
    positions = torch.arange(P - 1, P - 1 + new.shape[1])
    z, tau = z[positions], tau[positions]
    q = z * calibrator.scale(tau)[:, None]
    conf = q.softmax(-1).gather(1, new[0][:, None]).squeeze(1)
    raw = z.softmax(-1).gather(1, new[0][:, None]).squeeze(1)
    return tau, conf, raw


def plain_greedy(backbone, prompts, max_new_tokens):
    ids, mask, _ = encode_prompts(backbone, prompts)
    seq = backbone.model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False,
                                  pad_token_id=backbone.tokenizer.pad_token_id)
    return [backbone.tokenizer.decode(row, skip_special_tokens=True) for row in seq[:, ids.shape[1]:]]


def test_head_is_not_identity(tiny_backbone, calibrator):
    out = generate_calibrated(tiny_backbone, calibrator, PROMPTS[0], max_new_tokens=4)[0]
    assert max(abs(t) for t in out.taus) > 0.05
    assert out.confidences != pytest.approx(out.uncalibrated, abs=1e-3)


def test_greedy_text_equals_plain_generate(tiny_backbone, calibrator):
    outs = generate_calibrated(tiny_backbone, calibrator, PROMPTS, max_new_tokens=12)
    assert [o.text for o in outs] == plain_greedy(tiny_backbone, PROMPTS, 12)
    assert all(len(o.token_ids) == 12 and o.finish_reason == "length" for o in outs)


@pytest.mark.parametrize("head_type", ["transformer", "linear", "mlp"])
def test_per_token_values_match_full_forward(tiny_backbone, head_type):
    """The head decoded step by step (the transformer head with its KV cache) gives a full pass's values."""
    calibrator = calibrator_for(tiny_backbone, head_type, seed=3)
    out = generate_calibrated(tiny_backbone, calibrator, PROMPTS[1], max_new_tokens=10, do_sample=True)[0]
    assert len(out.confidences) == len(out.uncalibrated) == len(out.taus) == len(out.token_ids) == 10
    tau, conf, raw = reference(tiny_backbone, calibrator, PROMPTS[1], out)
    # the transformer head decoded with its KV cache gives the same tau as a full pass over the final sequence
    torch.testing.assert_close(torch.tensor(out.taus), tau, atol=1e-5, rtol=0)
    torch.testing.assert_close(torch.tensor(out.confidences), conf, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(torch.tensor(out.uncalibrated), raw, atol=1e-5, rtol=1e-4)
    assert out.mean_confidence == pytest.approx(conf.mean().item(), abs=1e-5)
    assert out.product_confidence == pytest.approx(conf.prod().item(), rel=1e-4)
    assert out.mean_uncalibrated == pytest.approx(raw.mean().item(), abs=1e-5)


def test_sampling_is_reproducible_and_uses_options(tiny_backbone, calibrator):
    def run(seed, **kw):
        torch.manual_seed(seed)
        return generate_calibrated(tiny_backbone, calibrator, PROMPTS, max_new_tokens=12, do_sample=True, **kw)

    a, b = run(0, temperature=1.5), run(0, temperature=1.5)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    assert [o.confidences for o in a] == [o.confidences for o in b]
    # top_k=1 after calibration is greedy (calibration keeps the argmax)
    assert [o.text for o in run(1, top_k=1)] == plain_greedy(tiny_backbone, PROMPTS, 12)


def test_batched_left_padding_matches_one_by_one(tiny_backbone, calibrator):
    batched = generate_calibrated(tiny_backbone, calibrator, PROMPTS, max_new_tokens=10)
    ids, mask, _ = encode_prompts(tiny_backbone, PROMPTS)
    assert (mask == 0).any()  # the prompts really have different lengths: left padding is exercised
    for prompt, out in zip(PROMPTS, batched):
        single = generate_calibrated(tiny_backbone, calibrator, prompt, max_new_tokens=10)[0]
        assert single.token_ids == out.token_ids
        torch.testing.assert_close(torch.tensor(out.taus), torch.tensor(single.taus), atol=1e-5, rtol=0)
        torch.testing.assert_close(torch.tensor(out.confidences), torch.tensor(single.confidences), atol=1e-5,
                                   rtol=1e-4)


def test_stop_strings_cut_the_text(tiny_backbone, calibrator):
    torch.manual_seed(5)
    full = generate_calibrated(tiny_backbone, calibrator, PROMPTS[0], max_new_tokens=16, do_sample=True,
                               temperature=2.0)[0]
    text = full.text
    assert len(text) > 4
    stop = text[len(text) // 2: len(text) // 2 + 2]
    cut = text.find(stop)
    torch.manual_seed(5)
    out = generate_calibrated(tiny_backbone, calibrator, PROMPTS[0], max_new_tokens=16, do_sample=True,
                              temperature=2.0, stop_strings=[stop])[0]
    assert out.finish_reason == "stop"
    assert out.text == text[:cut]
    assert len(out.token_ids) <= len(full.token_ids)
    assert out.token_ids == full.token_ids[:len(out.token_ids)]
    assert len(out.confidences) == len(out.taus) == len(out.token_ids)


def test_stream_colours_and_text(tiny_backbone, calibrator):
    events: list[StreamToken] = []
    outs = generate_calibrated(tiny_backbone, calibrator, PROMPTS, max_new_tokens=8, do_sample=True,
                               stream=events.append)
    for row, out in enumerate(outs):
        mine = [e for e in events if e.row == row]
        assert mine[-1].done and not any(e.done for e in mine[:-1])
        assert "".join(e.text for e in mine) == out.text
        assert [e.confidence for e in mine[:-1]] == pytest.approx(out.confidences)
    buffer = io.StringIO()
    for event in events:
        print_stream(event, file=buffer)
    printed = buffer.getvalue()
    assert "\033[" in printed and printed.endswith("\n")
    assert colorize("x", 0.1).startswith("\033[31m") and colorize("x", 0.5).startswith("\033[33m")
    assert colorize("x", 0.9).startswith("\033[32m")


def test_user_processors_see_the_calibrated_logits(tiny_backbone, calibrator):
    """A user's logits processor runs on the calibrated logits q = z * s (before the sampling warpers)."""
    ids, _, _ = encode_prompts(tiny_backbone, PROMPTS[:1])

    class Recorder(LogitsProcessor):
        seen: list = []

        def __call__(self, input_ids, scores):
            self.seen.append(scores.clone())
            return scores

    recorder = Recorder()
    out = generate_calibrated(tiny_backbone, calibrator, PROMPTS[0], max_new_tokens=3,
                              logits_processor=LogitsProcessorList([recorder]))[0]
    tau, _, _ = reference(tiny_backbone, calibrator, PROMPTS[0], out)
    full = torch.cat([ids, torch.tensor([out.token_ids])], 1)
    hidden, _ = tiny_backbone.forward(full, torch.ones_like(full))
    z = tiny_backbone.logits(hidden)[0, ids.shape[1] - 1: ids.shape[1] + 2].float()
    expected = z * calibrator.scale(tau)[:, None]
    torch.testing.assert_close(torch.cat(recorder.seen), expected, atol=1e-4, rtol=1e-4)


def test_a_processor_that_bans_the_greedy_token_bans_it_for_greedy_decoding(tiny_backbone, calibrator):
    """Greedy rows choose from the processors' output, as transformers' `generate` does: banning the model's first
    greedy token yields its second-best token there, which the model's own logits rank second."""
    plain = generate_calibrated(tiny_backbone, calibrator, PROMPTS[0], max_new_tokens=1)[0]
    banned = plain.token_ids[0]

    class Ban(LogitsProcessor):
        def __call__(self, input_ids, scores):
            scores = scores.clone()
            scores[:, banned] = float("-inf")
            return scores

    out = generate_calibrated(tiny_backbone, calibrator, PROMPTS[0], max_new_tokens=1,
                              logits_processor=LogitsProcessorList([Ban()]))[0]
    ids, _, _ = encode_prompts(tiny_backbone, PROMPTS[:1])
    hidden, _ = tiny_backbone.forward(ids, torch.ones_like(ids))
    z = tiny_backbone.logits(hidden)[0, -1].float()  # (V,)
    assert z.topk(2).indices.tolist() == [banned, out.token_ids[0]]


def test_chat_template_option_and_errors(tiny_backbone, calibrator):
    assert tiny_backbone.is_chat
    chat = generate_calibrated(tiny_backbone, calibrator, "Hi", max_new_tokens=2)[0]
    plain = generate_calibrated(tiny_backbone, calibrator, "Hi", max_new_tokens=2, chat_template=False)[0]
    assert "<|im_start|>" in chat.prompt_text and plain.prompt_text == "Hi"
    tau, conf, _ = reference(tiny_backbone, calibrator, "Hi", plain, chat_template=False)
    torch.testing.assert_close(torch.tensor(plain.confidences), conf, atol=1e-5, rtol=1e-4)
    with pytest.raises(ATSError, match="beam"):
        generate_calibrated(tiny_backbone, calibrator, "Hi", max_new_tokens=2, num_beams=2)
    assert generate_calibrated(tiny_backbone, calibrator, [], max_new_tokens=2) == []


@pytest.mark.parametrize("prompts, options, message", [
    (["Hi", 5], {}, r"^prompts: expected a string or a list of strings, got int 5$"),
    (None, {}, r"^prompts: expected a string or a list of strings, got NoneType None$"),
    ("Hi", {"stop_strings": 7}, r"^stop_strings: expected a string or a list of strings, got int 7$"),
    ("", {"chat_template": False}, r"^prompt 0: empty \(no tokens\)$"),  # was a reshape error from the model
    ("word " * 2100, {"chat_template": False}, r"^this model's maximum context length is 2048 tokens, but prompt 0 "
                                               r"has \d+ tokens and max_tokens is 2$"),  # the server's own words
    ("Hi", {"do_sample": True, "temperature": -1.0}, r"^temperature: expected a finite number >= 0, got -1\.0$"),
    ("Hi", {"do_sample": True, "top_k": -3}, r"^top_k: expected an integer >= 0 \(0: all tokens\), got -3$"),
    ("Hi", {"do_sample": True, "top_p": 1.5}, r"^top_p: expected a number in \[0, 1\], got 1\.5$"),
    ("Hi", {"num_return_sequences": 0}, r"^num_return_sequences: expected an integer >= 1, got 0$"),
    ("Hi", {"min_new_tokens": -1}, r"^min_new_tokens: expected an integer >= 0, got -1$"),
])
def test_bad_inputs_are_one_line_errors_before_decoding(tiny_backbone, calibrator, prompts, options, message):
    assert tiny_backbone.model.config.max_position_embeddings == 2048
    with pytest.raises(ATSError, match=message):
        generate_calibrated(tiny_backbone, calibrator, prompts, **{"max_new_tokens": 2, **options})


def test_num_return_sequences(tiny_backbone, calibrator):
    torch.manual_seed(0)
    outs = generate_calibrated(tiny_backbone, calibrator, PROMPTS, max_new_tokens=5, do_sample=True,
                               num_return_sequences=2)
    assert [o.prompt for o in outs] == [PROMPTS[0], PROMPTS[0], PROMPTS[1], PROMPTS[1]]
    for out in outs:
        _, conf, _ = reference(tiny_backbone, calibrator, out.prompt, out)
        torch.testing.assert_close(torch.tensor(out.confidences), conf, atol=1e-5, rtol=1e-4)


def test_smollm2_identity_head_and_eos(smollm2):
    """On the real chat model: an identity head reports the model's own probabilities, greedy text is unchanged,
    and a trained-looking head changes confidence but not the text; generation stops at <|im_end|>."""
    identity = ATSCalibrator.for_backbone(smollm2, head_type="transformer")
    prompt = "What is 2 + 2? Answer with one number."
    out = generate_calibrated(smollm2, identity, prompt, max_new_tokens=8)[0]
    assert out.text == plain_greedy(smollm2, [prompt], 8)[0]
    assert out.confidences == pytest.approx(out.uncalibrated, abs=1e-6)
    assert "4" in out.text
    calibrator = calibrator_for(smollm2, "transformer", seed=1)
    again = generate_calibrated(smollm2, calibrator, prompt, max_new_tokens=8)[0]
    assert again.text == out.text and again.token_ids == out.token_ids
    _, conf, raw = reference(smollm2, calibrator, prompt, again)
    torch.testing.assert_close(torch.tensor(again.confidences), conf, atol=1e-4, rtol=1e-3)
    if again.finish_reason == "eos":
        assert again.token_ids[-1] == smollm2.tokenizer.convert_tokens_to_ids("<|im_end|>")


@pytest.mark.slow
def test_gemma3_270m_generates_past_its_sliding_window():
    """The embedded Gemma 3 270M (five of every six layers attend to 512 tokens): a prompt longer than the window,
    batched beside a short one, decodes the model's own greedy text with a full pass's probabilities."""
    from ats.model.backbone import load_backbone

    gemma = load_backbone("gemma3-270m")
    assert "sliding_attention" in gemma.model.config.layer_types and gemma.model.config.sliding_window == 512
    long = " ".join(f"{i} apples, {i + 1} pears;" for i in range(80)) + " Count on:"
    prompts = [long, "The capital of France is"]
    outs = generate_calibrated(gemma, None, prompts, max_new_tokens=6, chat_template=False)
    for prompt, out in zip(prompts, outs):
        ids = gemma.tokenizer(prompt, return_tensors="pt").input_ids
        plain = gemma.model.generate(ids, max_new_tokens=6, do_sample=False)[0, ids.shape[1]:].tolist()
        assert out.token_ids == plain[:len(out.token_ids)]
        full = torch.cat([ids, torch.tensor([out.token_ids])], 1)
        with torch.no_grad():
            logp = gemma.model(full).logits[0, ids.shape[1] - 1:-1].float().log_softmax(-1)
        expected = logp.gather(1, torch.tensor(out.token_ids)[:, None])[:, 0].exp()
        torch.testing.assert_close(torch.tensor(out.uncalibrated), expected, atol=1e-4, rtol=1e-3)
    assert len(gemma.tokenizer(long).input_ids) > 512


def test_cli_generate_streams_the_api_text_and_confidence(smollm2, tmp_path, capsys, monkeypatch):
    """`ats generate --model M --calibrator DIR "prompt"`: streams the same text as the API (uncoloured under
    NO_COLOR) and prints the sequence confidence."""
    from ats.cli import main

    calibrator = calibrator_for(smollm2, "transformer", seed=1)
    calibrator.save_pretrained(tmp_path / "cal")
    prompt = "What is 2 + 2? Answer with one number."
    expected = generate_calibrated(smollm2, calibrator, prompt, max_new_tokens=8)[0]
    monkeypatch.setenv("NO_COLOR", "1")
    capsys.readouterr()
    assert main(["generate", "--model", "smollm2-135m-instruct", "--calibrator", str(tmp_path / "cal"),
                 "--max-new-tokens", "8", *prompt.split()]) == 0
    printed = capsys.readouterr().out
    assert printed.startswith(expected.text)
    assert f"sequence confidence: mean {expected.mean_confidence:.3f}" in printed
    assert f"(uncalibrated mean {expected.mean_uncalibrated:.3f})" in printed


def _fitted(backbone, kind: str):
    """A calibrator of type `kind` away from identity for `backbone` (None for "none")."""
    from ats.calibrators import build_calibrator

    if kind == "none":
        return None
    if kind == "thermometer":
        return random_thermometer(backbone.hidden_size, 1)
    ids = torch.tensor([backbone.tokenizer("The quick brown fox jumps over the lazy dog. " * 4)["input_ids"]])
    with torch.no_grad():
        hidden, _ = backbone.forward(ids)
        chunk = (backbone.logits(hidden)[0, :-1].float(), ids[0, 1:])
    calibrator = build_calibrator(kind).fit(lambda: iter([chunk]))
    if kind == "temperature":
        calibrator.temperature = 1.7
    return calibrator


@pytest.mark.parametrize("kind", ["none", "temperature", "histogram", "thermometer"])
def test_any_calibrator_generates_the_model_text_with_its_own_probabilities(tiny_backbone, kind):
    """Greedy text is the uncalibrated model's; each token's probability is `Calibrator.apply` on a full pass (the
    prompt's last hidden state for Thermometer); `answer_confidence` maps it through a binning map."""
    calibrator = _fitted(tiny_backbone, kind)
    out = generate_calibrated(tiny_backbone, calibrator, PROMPTS[1], max_new_tokens=6)[0]
    assert out.text == plain_greedy(tiny_backbone, [PROMPTS[1]], 6)[0]
    ids, mask, _ = encode_prompts(tiny_backbone, [PROMPTS[1]])
    full = torch.cat([ids, torch.tensor([out.token_ids])], 1)
    with torch.no_grad():
        hidden, _ = tiny_backbone.forward(full)
        index = torch.arange(ids.shape[1] - 1, full.shape[1] - 1)[None]
        z = tiny_backbone.logits(hidden)[:, index[0]].float()
        q = z if calibrator is None else calibrator.apply(z, hidden, index=index)
    p = q[0].softmax(-1).gather(1, torch.tensor(out.token_ids)[:, None])[:, 0]
    torch.testing.assert_close(torch.tensor(out.confidences), p, atol=1e-5, rtol=1e-4)
    mapped = p.double() if calibrator is None else torch.tensor(calibrator.map_confidence(p))
    answer = [i for i, t in enumerate(out.token_ids) if t not in eos_ids(tiny_backbone)]
    assert out.answer_confidence == pytest.approx(float(mapped[answer].mean()), abs=1e-6)
    assert out.confidence_kind == ("mapped" if kind == "histogram" else "probability")
    own = z[0].softmax(-1).gather(1, torch.tensor(out.token_ids)[:, None])[:, 0]  # the backbone's, never mapped
    assert out.uncalibrated_answer_confidence == pytest.approx(float(own[answer].double().mean()), abs=1e-6)


def test_cli_generate_with_calibrator_none_prints_the_model_own_text(smollm2, capsys, monkeypatch):
    """`ats generate --calibrator none`: the uncalibrated stream beside a calibrated one (no folder needed)."""
    from ats.cli import main

    prompt = "What is 2 + 2? Answer with one number."
    expected = generate_calibrated(smollm2, None, prompt, max_new_tokens=8)[0]
    assert expected.confidences == pytest.approx(expected.uncalibrated, abs=1e-6)
    monkeypatch.setenv("NO_COLOR", "1")
    capsys.readouterr()
    assert main(["generate", "--model", "smollm2-135m-instruct", "--calibrator", "none", "--max-new-tokens", "8",
                 *prompt.split()]) == 0
    printed = capsys.readouterr().out
    assert printed.startswith(expected.text) and expected.text == plain_greedy(smollm2, [prompt], 8)[0]
    assert f"answer confidence: {expected.answer_confidence:.3f}" in printed
