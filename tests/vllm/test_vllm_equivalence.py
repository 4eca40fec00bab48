"""vLLM runs every calibrator it can hold exactly as ats does: for each, the calibrated logprobs vLLM returns
(the chosen token and the top 5 of every generated token, every prompt token's) equal those of ats's decoding core
(`ats generate`, `ats serve`) on the same token ids in float32, and the greedy text is the same. On a tiny random
Llama and Qwen2, prompts of mixed lengths in one batch, a prompt found in the prefix cache, prefix caching on and
off, a prompt longer than the chunked-prefill budget, and the transformer head compiled as vLLM compiles by default
(without --enforce-eager: the head is a compiled module of its own beside the base's).

The tolerance is the floor measured in the same run (plain vLLM against ats's uncalibrated core on the same fp32
weights), twice, carried through the calibrator's largest factor on a logit (an engine's logit error e becomes s e
after q = s z), never more than 1e-3.
"""

from __future__ import annotations

import os
from typing import NamedTuple

import pytest

from ats.calibrators import load_calibrator
from ats.integrations.vllm.export import export_for_vllm

from vllm_helpers import calibrators, max_difference, reference, run_vllm

pytestmark = pytest.mark.slow  # about 25 vLLM engines in one process: 1.5-2 min on 2 cores

MAX_TOKENS, TOP = 10, 5
CALIBRATORS = {"llama": ["transformer", "mlp", "linear", "selective-temperature", "selective-linear", "official",
                         "temperature", "vector"],
               "qwen2": ["transformer", "temperature"]}
BUDGET = 64  # the chunked-prefill budget of the chunking engine: below the longest prompt
COMPILED = {"enforce_eager": False}  # vLLM's default compilation (the other engines run eagerly: faster to start)
SAMPLING = {"max_tokens": MAX_TOKENS, "logprobs": TOP, "prompt_logprobs": TOP, "ignore_eos": True}


class Arm(NamedTuple):
    model: str  # the folder vLLM loaded
    got: list  # vLLM's outputs, per round, per prompt
    want: list  # ats's, the same
    prompts: list  # the token ids, per round
    backbone: object
    calibrator: object
    compiled_modules: int | None = None  # modules vLLM set up for compilation while building the engine


def prompts_of(tokenizer) -> list[list[int]]:
    """Three prompts of 5-150 tokens (mixed lengths in one batch); the longest is longer than BUDGET."""
    texts = ["The capital of France is",
             "Write a short poem about the sea and the wind, and say why the tide comes in twice a day. " * 2,
             "Rome is the capital of Italy and Madrid is the capital of Spain. " * 9]
    return [tokenizer(t, add_special_tokens=False).input_ids for t in texts]


@pytest.fixture(scope="session")
def runs(tiny_models, tmp_path_factory) -> dict[tuple[str, str], Arm]:
    """Every engine of this module in one vLLM process, and ats's references."""
    root = tmp_path_factory.mktemp("vllm-runs")
    jobs, arms = [], {}
    for kind, (folder, backbone) in tiny_models.items():
        prompts = prompts_of(backbone.tokenizer)
        rounds = [prompts, [prompts[2] + prompts[0]]]  # the second starts with a prompt of the first: cached
        saved = calibrators(backbone, root / kind, CALIBRATORS[kind])
        plan = {"plain": (str(folder), None, {}), "none": (None, None, {})}
        plan.update({name: (None, path, {}) for name, path in saved.items()})
        if kind == "llama":
            plan["transformer/no-prefix-cache"] = (None, saved["transformer"], {"enable_prefix_caching": False})
            plan["transformer/chunked"] = (None, saved["transformer"], {"max_num_batched_tokens": BUDGET,
                                                                          "enable_chunked_prefill": True})
            plan["plain/compiled"] = (str(folder), None, COMPILED)
            plan["transformer/compiled"] = (None, saved["transformer"], COMPILED)
        for name, (model, path, engine) in plan.items():
            if model is None:
                model = str(export_for_vllm(str(folder), path, root / kind / f"export-{name.replace('/', '-')}"))
            jobs.append({"model": model, "engine": {"max_model_len": 512, **engine}, "sampling": SAMPLING,
                         "rounds": rounds})
            cal = None if path is None else load_calibrator(path, backbone=None if name == "official" else backbone)
            want = [reference(backbone, cal, p, MAX_TOKENS, TOP) for p in rounds]
            arms[(kind, name)] = Arm(model, None, want, rounds, backbone, cal, None)
    results = run_vllm(jobs, root)
    wanted = {"1": "v2", "0": "v1"}.get(os.environ.get("VLLM_USE_V2_MODEL_RUNNER", ""))
    assert wanted is None or {r["model_runner"] for r in results} == {wanted}  # the runner asked for ran
    return {key: arm._replace(got=result["rounds"], compiled_modules=result["compiled_modules"])
            for (key, arm), result in zip(arms.items(), results)}


def floor(runs, kind: str, plain: str = "plain") -> float:
    """How far plain vLLM is from ats's uncalibrated core on the same prompts: the rounding both engines differ by."""
    arm = runs[(kind, plain)]
    return max(max_difference(g, w) for gr, wr in zip(arm.got, arm.want) for g, w in zip(gr, wr))


def bound(runs, kind: str, want: dict, plain: str = "plain") -> float:
    """Twice the floor times the calibrator's largest factor on a logit there, at most 1e-3."""
    return min(2 * floor(runs, kind, plain) * max(1.0, want["scale"]), 1e-3)


@pytest.mark.parametrize("kind,name", [(k, n) for k, names in CALIBRATORS.items() for n in names if n != "vector"]
                         + [("llama", "transformer/no-prefix-cache"), ("llama", "transformer/chunked")])
def test_calibrated_logprobs_equal_ats(runs, kind, name):
    arm = runs[(kind, name)]
    for got_round, want_round in zip(arm.got, arm.want):
        for g, w in zip(got_round, want_round):
            assert max_difference(g, w) <= bound(runs, kind, w)
    # the calibrator moved the probabilities (the comparison is not of two uncalibrated models)
    plain = runs[(kind, "plain")].got[0][2]["logprobs"]
    moved = max(abs(g[t] - p[t]) for g, p in zip(arm.got[0][2]["logprobs"], plain) for t in g if t in p)
    assert moved > 0.05


def test_compiled_transformer_head_equals_ats(runs):
    """Under vLLM's default compilation the head is compiled too (a second module beside the base's) and still gives
    ats's logprobs, within the compiled base's own floor."""
    arm, plain = runs[("llama", "transformer/compiled")], runs[("llama", "plain/compiled")]
    assert (plain.compiled_modules, arm.compiled_modules) == (1, 2)  # the base; the base and the head
    for got_round, want_round in zip(arm.got, arm.want):
        for g, w in zip(got_round, want_round):
            assert max_difference(g, w) <= bound(runs, "llama", w, plain="plain/compiled")
    assert max_difference(arm.got[0][2], runs[("llama", "transformer")].got[0][2]) < 1e-3  # as the eager engine


def test_vector_scaling_decodes_greedily_from_the_calibrated_distribution(runs):
    """Vector scaling can move the argmax. ats's greedy decoding keeps the model's own text; vLLM's sampler sees only
    the calibrated logits, so its greedy text is the calibrated argmax. Its prompt logprobs equal ats's, and ats
    scoring vLLM's text gives the logprobs vLLM reported for it, the chosen token the most likely."""
    arm = runs[("llama", "vector")]
    for got_round, want_round, prompts in zip(arm.got, arm.want, arm.prompts):
        for g, w, ids in zip(got_round, want_round, prompts):
            assert max_difference({**g, "tokens": []}, {**w, "tokens": []}, keys=("prompt_logprobs",)) \
                <= bound(runs, "llama", w)
            scored = reference(arm.backbone, arm.calibrator, [ids + g["tokens"]], 0, TOP)[0]
            at = scored["prompt_logprobs"][len(ids):]  # the positions that chose the generated tokens
            assert max_difference({"tokens": [], "logprobs": g["logprobs"]}, {"tokens": [], "logprobs": at},
                                  keys=("logprobs",)) <= bound(runs, "llama", scored)
            assert all(max(y, key=y.get) == token for y, token in zip(at, g["tokens"]))
    assert any(g["tokens"] != w["tokens"] for g, w in zip(arm.got[0], arm.want[0]))  # it moved the argmax here


@pytest.mark.parametrize("kind", CALIBRATORS)
def test_uncalibrated_export_is_plain_vllm(runs, kind):
    for got_round, plain_round in zip(runs[(kind, "none")].got, runs[(kind, "plain")].got):
        for g, p in zip(got_round, plain_round):
            assert max_difference(g, p) == 0.0


def test_floor_is_rounding(runs):
    """The floor itself is float32 rounding, not a disagreement (plain vLLM and ats on the same weights)."""
    for kind in CALIBRATORS:
        assert 0.0 < floor(runs, kind) < 1e-4, kind


def test_tensor_parallel_two_equals_one(runs, tmp_path):
    """The calibrated model on two tensor-parallel ranks (vLLM's CPU backend, one core each; the head's layer
    sharded like the base model's: two attention heads, one per rank) gives the logprobs of one rank."""
    arm = runs[("llama", "transformer")]
    job = {"model": arm.model, "engine": {"max_model_len": 512, "tensor_parallel_size": 2,
                                          "distributed_executor_backend": "mp"},
           "sampling": SAMPLING, "rounds": arm.prompts}
    (got,) = run_vllm([job], tmp_path, env={"VLLM_CPU_OMP_THREADS_BIND": "0|1"})
    for got_round, one_round, want_round in zip(got["rounds"], arm.got, arm.want):
        for g, one, w in zip(got_round, one_round, want_round):
            assert max_difference(g, one) <= bound(runs, "llama", w)
            assert max_difference(g, w) <= bound(runs, "llama", w)
