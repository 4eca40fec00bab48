"""The real SmolLM2-135M-Instruct in vLLM with the paper's head (random, away from identity): three chat prompts,
24 greedy tokens, top 5, float32; vLLM's calibrated logprobs equal ats's decoding core's within twice the floor of
plain vLLM against ats uncalibrated (5.7e-5 when the issue was filed), carried through the head's scale."""

from __future__ import annotations

import pytest

from ats.calibrators.ats import ATSCalibrator
from ats.generation.api import encode_prompts
from ats.integrations.vllm.export import export_for_vllm
from ats.model.backbone import model_source

from conftest import max_difference, perturbed, reference, run_vllm

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
