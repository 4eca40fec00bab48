"""Every calibrator type served by a real `ats serve` process and read with the `openai` client: its log-probabilities
are the in-process calibrated ones (`Calibrator.apply` on one forward pass, as `ats eval` applies it), greedy text is
the uncalibrated model's, and the `ats` field's answer confidence is the number the evaluation tasks compute for
that answer (binning methods: through their map, said in `confidence_kind`)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from ats.calibrators import load_calibrator
from ats.confidence import mean_token_confidence
from ats.evaluation.tasks.scoring import gather_logits
from ats.generation import eos_ids, generate_calibrated

from server_process import MODEL_NAME
from serving_reference import chat_ids

pytestmark = pytest.mark.slow  # ten `ats serve` processes, one per calibrator type (~30 s of start-up on 2 cores)

TYPES = ["temperature", "vector", "scaling-binning", "histogram", "isotonic", "thermometer", "selective-temperature",
         "ats", "ats-official", "probe", "none"]
MAPPED = {"scaling-binning", "histogram", "isotonic"}
PROMPT = "Write a short poem about the sea and the wind, please."
NEW_TOKENS = 8


@torch.no_grad()
def as_evaluated(backbone, calibrator, prompt: list[int], tokens: list[int]):
    """From ONE forward pass over prompt + tokens, calibrated as the evaluation tasks calibrate an answer
    (`Calibrator.apply` with the answer positions as `index`): the calibrated log-softmax (N, V) at the positions
    predicting `tokens`, and the answer confidence (`mean_token_confidence` of the tokens' probabilities through
    `map_confidence`, the end-of-sequence token left out)."""
    ids = prompt + tokens
    hidden, _ = backbone.forward(torch.tensor([ids]))
    index = torch.arange(len(prompt) - 1, len(ids) - 1)[None]  # (1, N)
    z = gather_logits(backbone, hidden, index)  # (1, N, V)
    q = z.float() if calibrator is None else calibrator.apply(z, hidden, attention_mask=torch.ones(1, len(ids)),
                                                              index=index)
    logq = q[0].log_softmax(-1)  # (N, V)
    answer = [t for t in tokens if t not in eos_ids(backbone)]
    p = torch.softmax(q[0, : len(answer)], -1).gather(1, torch.tensor(answer)[:, None])[:, 0]  # (K,)
    p = p.numpy() if calibrator is None else calibrator.map_confidence(p)
    return logq, float(mean_token_confidence(np.asarray(p)[None], np.ones((1, len(answer)), dtype=bool))[0])


@torch.no_grad()
def probed(backbone, probe, prompt: list[int], tokens: list[int]) -> float:
    """A probe's answer confidence by the model's own hidden-state outputs (layer 0: hidden_states[1]) over prompt +
    answer, its views by hand, and the answer's uncalibrated mean token probability."""
    answer = [t for t in tokens if t not in eos_ids(backbone)]
    out = backbone.model(input_ids=torch.tensor([prompt + answer]), output_hidden_states=True)
    states = out.hidden_states[1][0]  # (T, H)
    span = states[len(prompt):]
    views = torch.stack([states[len(prompt) - 1], span.mean(0), span[-1]])[None, None]  # (1, 1, 3, H)
    logp = torch.log_softmax(out.logits[0, len(prompt) - 1:-1].float(), -1)
    raw = logp.gather(1, torch.tensor(answer)[:, None]).exp().mean()
    return float(probe.answer_confidence(views, [float(raw)])[0])


@pytest.mark.parametrize("kind", TYPES)
def test_each_calibrator_served_equals_in_process(kind, calibrator_servers, calibrator_folders, backbone):
    import openai

    server = calibrator_servers[kind]
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    out = client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": PROMPT}],
                                         max_tokens=NEW_TOKENS, temperature=0, logprobs=True, top_logprobs=2)
    choice = out.choices[0]
    plain = generate_calibrated(backbone, None, PROMPT, max_new_tokens=NEW_TOKENS)[0]
    assert choice.message.content == plain.text  # greedy text is the model's own, whatever the calibrator

    calibrator = None if kind == "none" else load_calibrator(calibrator_folders[kind], backbone=backbone)
    prompt = chat_ids(backbone, PROMPT)
    tokens = plain.token_ids
    logq, confidence = as_evaluated(backbone, calibrator, prompt, tokens)
    entries = choice.logprobs.content
    served = torch.tensor([e.logprob for e in entries])
    expected = logq.gather(1, torch.tensor(tokens)[:, None])[:, 0]
    # cached decoding against one full pass: float32 sums in another order (see test_client)
    torch.testing.assert_close(served, expected, atol=2e-4, rtol=1e-5)
    top = logq.topk(2)
    for entry, values in zip(entries, top.values):  # the calibrated distribution's own top tokens
        torch.testing.assert_close(torch.tensor([t.logprob for t in entry.top_logprobs]), values, atol=2e-4,
                                   rtol=1e-5)

    ats = choice.model_extra["ats"]
    if kind == "probe":
        confidence = probed(backbone, calibrator, prompt, tokens)
    assert ats["answer_confidence"] == pytest.approx(confidence, abs=1e-4)
    assert ats["confidence_kind"] == ("mapped" if kind in MAPPED else "probe" if kind == "probe" else "probability")
    assert ats["calibrator"] == ("uncalibrated" if calibrator is None else calibrator.label)
    changes = kind not in {"none", "histogram", "isotonic"}
    moved = max(abs(math.exp(a) - math.exp(b)) for a, b in zip(served.tolist(), ats["uncalibrated_logprobs"]))
    assert (moved > 1e-3) == changes  # scaling methods move the probabilities, the others leave them
    if kind in {"ats", "ats-official", "selective-temperature"}:
        assert all(t is not None for t in ats["tau"])
    health = server.health()
    assert health["calibration"].startswith(ats["calibrator"]) and "\n" not in health["calibration"]
    assert ("leaves log-probabilities" in health["calibration"]) == (kind in {"histogram", "isotonic"})


def test_thermometer_reads_each_prompt_at_prefill(calibrator_servers, calibrator_folders, backbone):
    """Thermometer's temperature is read from each prompt's last hidden state at prefill: two prompts decoded in one
    batch get two temperatures, each the one `ats eval` reads for that prompt's answer."""
    import openai

    thermometer = load_calibrator(calibrator_folders["thermometer"], backbone=backbone)
    client = openai.OpenAI(base_url=calibrator_servers["thermometer"].url + "/v1", api_key="unused", max_retries=0)
    prompts = [PROMPT, "Hi"]
    ids = [chat_ids(backbone, p) for p in prompts]
    out = client.completions.create(model=MODEL_NAME, prompt=ids, max_tokens=4, temperature=0, logprobs=0)
    scales = []
    for prompt, prompt_ids, choice in zip(prompts, ids, out.choices):
        hidden, _ = backbone.forward(torch.tensor([prompt_ids]))
        scales.append(float(1 / thermometer.temperature(hidden[:, -1])))
        tokens = generate_calibrated(backbone, None, prompt, max_new_tokens=4)[0].token_ids
        logq, _ = as_evaluated(backbone, thermometer, prompt_ids, tokens)
        torch.testing.assert_close(torch.tensor(choice.logprobs.token_logprobs),
                                   logq.gather(1, torch.tensor(tokens)[:, None])[:, 0], atol=2e-4, rtol=1e-5)
    assert abs(scales[0] - scales[1]) > 1e-3
