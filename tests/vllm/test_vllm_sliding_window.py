"""A base model with a sliding window (a tiny Mistral, window 32): Thermometer's layer still reads the prompt's end
from tokens generated further than the window past it, and the transformer head's layer attends over every earlier
position as ats's head does (vLLM's attention layers take the base model's window from the cache config:
`compat.full_attention` removes it for the calibration layers). 48 tokens are generated after 5-10 token prompts,
and the logprobs equal ats's decoding core's within the float32 bound of the other tests (before: 21-32 nats off
for Thermometer, 0.02-0.08 for the head)."""

from __future__ import annotations

import pytest

from ats.calibrators import load_calibrator
from ats.calibrators.ats import ATSCalibrator
from ats.integrations.vllm.export import export_for_vllm
from ats.model.backbone import load_backbone

from helpers import random_thermometer
from vllm_helpers import SLIDING_WINDOW, max_difference, perturbed, reference, run_vllm, tiny_model_folder

pytestmark = pytest.mark.slow  # 3 vLLM engines in one process: about 50 s on 2 cores

MAX_TOKENS, TOP = 48, 5
SAMPLING = {"max_tokens": MAX_TOKENS, "logprobs": TOP, "ignore_eos": True}


@pytest.fixture(scope="module")
def windowed_runs(tiny_tokenizer, tmp_path_factory):
    """name -> (vLLM's outputs, ats's) for plain vLLM and each calibrator, on the tiny Mistral."""
    root = tmp_path_factory.mktemp("vllm-window")
    folder = tiny_model_folder(root, "mistral", tiny_tokenizer)
    backbone = load_backbone(str(folder), dtype="float32")
    random_thermometer(backbone.hidden_size, 3).save_pretrained(root / "thermometer")
    perturbed(ATSCalibrator.for_backbone(backbone, head_type="transformer", seed=3), seed=4).save_pretrained(
        root / "transformer")
    saved = {"thermometer": root / "thermometer", "transformer": root / "transformer"}
    prompts = [tiny_tokenizer(t, add_special_tokens=False).input_ids
               for t in ["The capital of France is", "Hi! Hello world, this is a test."]]
    assert MAX_TOKENS > SLIDING_WINDOW + 1  # the last tokens are further than the window from the prompts' ends
    models = {"plain": str(folder), **{name: str(export_for_vllm(str(folder), path, root / f"export-{name}"))
                                       for name, path in saved.items()}}
    jobs = [{"model": model, "engine": {"max_model_len": 256}, "sampling": SAMPLING, "rounds": [prompts]}
            for model in models.values()]
    results = run_vllm(jobs, root)
    calibrators = {"plain": None, **{name: load_calibrator(path, backbone=backbone) for name, path in saved.items()}}
    return {name: (result["rounds"][0], reference(backbone, calibrators[name], prompts, MAX_TOKENS, TOP))
            for name, result in zip(models, results)}


@pytest.mark.parametrize("name", ["thermometer", "transformer"])
def test_calibration_layers_see_past_the_base_models_window(windowed_runs, name):
    base = max(max_difference(g, w, keys=("logprobs",)) for g, w in zip(*windowed_runs["plain"]))
    assert 0.0 < base < 1e-4
    for g, w in zip(*windowed_runs[name]):
        assert max_difference(g, w, keys=("logprobs",)) <= min(2 * base * max(1.0, w["scale"]), 1e-3)
