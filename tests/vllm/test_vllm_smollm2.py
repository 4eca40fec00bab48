"""The real SmolLM2-135M-Instruct in vLLM with the paper's head (random, away from identity): three chat prompts,
24 greedy tokens, top 5, float32; vLLM's calibrated logprobs equal ats's decoding core's within twice the floor of
plain vLLM against ats uncalibrated (5.7e-5 when the issue was filed), carried through the head's scale. In
bfloat16, the same comparison teacher-forced on the prompts' tokens, with the bound of the bfloat16 tests
(test_vllm_runners_and_dtypes.py), and what a scale rounded to bfloat16 would have added (computed on ats's side)."""

from __future__ import annotations

import pytest
import torch
from test_vllm_runners_and_dtypes import DRIFT_BOUND

from ats.calibrators.ats import ATSCalibrator
from ats.generation.api import encode_prompts
from ats.integrations.vllm.export import export_for_vllm
from ats.model.backbone import load_backbone, model_source

from vllm_helpers import max_difference, perturbed, prompt_drift, reference, run_vllm

PROMPTS = ["What is the capital of Australia?", "Write a haiku about autumn leaves.",
           "Explain in one sentence why the sky is blue."]
SAMPLING = {"max_tokens": 24, "logprobs": 5, "prompt_logprobs": 5, "ignore_eos": True}


@pytest.mark.slow
def test_smollm2_calibrated_in_vllm_equals_ats(smollm2, tmp_path):
    ids = [encode_prompts(smollm2, [p])[0][0].tolist() for p in PROMPTS]
    head = perturbed(ATSCalibrator.for_backbone(smollm2, head_type="transformer", seed=0), seed=1)
    folder = model_source("smollm2-135m-instruct")[0]
    export = export_for_vllm("smollm2-135m-instruct", head, tmp_path / "export")
    jobs = [{"model": model, "engine": {"max_model_len": 1024}, "sampling": SAMPLING, "rounds": [ids]}
            for model in (folder, str(export))]
    plain, calibrated = run_vllm(jobs, tmp_path)
    floor = max(max_difference(g, w) for g, w in zip(plain["rounds"][0], reference(smollm2, None, ids, 24, 5)))
    assert 0 < floor < 2e-4
    for g, w in zip(calibrated["rounds"][0], reference(smollm2, head, ids, 24, 5)):
        assert max_difference(g, w) <= min(2 * floor * max(1.0, w["scale"]), 1e-3)


@torch.no_grad()
def bfloat16_scale_rounding(backbone, head, prompts: list[list[int]]) -> float:
    """How far the prompt tokens' calibrated logprobs move when the scale is rounded to bfloat16 before it is applied
    (what the calibrated class did before it computed in float32), on ats's own bfloat16 logits."""
    worst = 0.0
    for ids in prompts:
        hidden, _ = backbone.forward(torch.tensor([ids]))  # (1, T, H)
        z = backbone.logits(hidden)[0].float()  # (T, V)
        s = head.scale(head.log_scale(hidden)[0].float())  # (T,)
        exact = torch.log_softmax(z * s[:, None], -1)
        rounded = torch.log_softmax(z * s.to(torch.bfloat16).float()[:, None], -1)
        at = torch.tensor(ids[1:])[:, None]  # each position's next prompt token
        worst = max(worst, float((exact[:-1].gather(1, at) - rounded[:-1].gather(1, at)).abs().max()))
    return worst


@pytest.mark.slow
def test_smollm2_bfloat16_drift_is_bounded(tmp_path, record_property):
    bf16 = load_backbone("smollm2-135m-instruct", dtype="bfloat16")
    ids = [encode_prompts(bf16, [p])[0][0].tolist() for p in PROMPTS]
    head = perturbed(ATSCalibrator.for_backbone(bf16, head_type="transformer", seed=0), seed=1)
    export = export_for_vllm("smollm2-135m-instruct", head, tmp_path / "export")
    sampling = {**SAMPLING, "max_tokens": 1}
    jobs = [{"model": model, "engine": {"max_model_len": 1024, "dtype": "bfloat16"}, "sampling": sampling,
             "rounds": [ids]} for model in (model_source("smollm2-135m-instruct")[0], str(export))]
    plain, calibrated = run_vllm(jobs, tmp_path)
    want_plain, want = reference(bf16, None, ids, 1, 5), reference(bf16, head, ids, 1, 5)
    floor = prompt_drift(plain["rounds"][0], want_plain, ids)
    drift = prompt_drift(calibrated["rounds"][0], want, ids)
    scale = max(w["scale"] for w in want)
    rounding = bfloat16_scale_rounding(bf16, head, ids)
    record_property("bf16", {"floor": floor, "drift": drift, "scale": scale, "bf16_scale_rounding": rounding})
    print(f"SmolLM2 bf16: drift {drift:.4g}, floor {floor:.4g}, largest factor {scale:.3g}, a bfloat16 scale "
          f"would add up to {rounding:.4g}")
    assert 0 < floor < 0.5
    assert drift <= DRIFT_BOUND["transformer"] * floor * max(1.0, scale)
