"""Runs vLLM engines one after another in this process and writes what they returned as JSON: the tests' way to
start vLLM once per session (`python vllm_runner.py JOBS.json OUT.json`, from a fresh process: vLLM must not be
forked from pytest).

JOBS.json: a list of {"model": folder, "engine": {LLM options}, "rounds": [[[token ids], ...], ...],
"sampling": {SamplingParams options}}: each round is one `generate` call (later rounds find what earlier ones left
in the prefix cache). OUT.json: per job {"start_seconds", "model_runner" ("v1" or "v2": which of vLLM's model
runners ran it), "rounds": per round, per prompt {"tokens", "logprobs" (per generated token {id: logprob} of the
top-k and the chosen token), "prompt_logprobs" (when asked)}}; with "expect_error" in the job, a round whose
requests vLLM refuses is {"error": its message}; with "disable_log_stats": false among its engine options,
"counters" holds vLLM's counters after the job (vllm:num_preemptions, vllm:prefix_cache_hits, ...);
"compiled_modules" counts the modules vLLM set up for its compilation (`support_torch_compile`) while building it.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import time

ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
       "VLLM_CPU_OMP_THREADS_BIND": "0-1", "VLLM_LOGGING_LEVEL": "WARNING", "TOKENIZERS_PARALLELISM": "false"}


def _logprobs(entries) -> list[dict[str, float]] | None:
    if entries is None:
        return None
    return [None if e is None else {str(k): float(v.logprob) for k, v in e.items()} for e in entries]


def run(jobs: list[dict]) -> list[dict]:
    from vllm.compilation.counter import compilation_counter
    from vllm.inputs import TokensPrompt

    from vllm import LLM, SamplingParams

    results = []
    for job in jobs:
        seen = compilation_counter.num_models_seen
        start = time.perf_counter()
        llm = LLM(job["model"], **{"dtype": "float32", "enforce_eager": True, "seed": 0, **job.get("engine", {})})
        started = time.perf_counter() - start
        params = SamplingParams(**{"temperature": 0.0, **job.get("sampling", {})})
        rounds = []
        for prompts in job["rounds"]:
            try:
                outputs = llm.generate([TokensPrompt(prompt_token_ids=ids) for ids in prompts], params,
                                       use_tqdm=False)
            except Exception as error:  # a request vLLM refused (VLLMValidationError)
                if not job.get("expect_error"):
                    raise
                rounds.append({"error": str(error)})
                continue
            rounds.append([{"tokens": list(o.outputs[0].token_ids), "logprobs": _logprobs(o.outputs[0].logprobs),
                            "prompt_logprobs": _logprobs(o.prompt_logprobs)} for o in outputs])
        runner = "v2" if llm.llm_engine.vllm_config.use_v2_model_runner else "v1"
        counters = {m.name: m.value for m in llm.get_metrics() if hasattr(m, "value")} \
            if job.get("engine", {}).get("disable_log_stats") is False else {}
        results.append({"start_seconds": started, "model_runner": runner, "rounds": rounds, "counters": counters,
                        "compiled_modules": compilation_counter.num_models_seen - seen})
        del llm
        gc.collect()
    return results


if __name__ == "__main__":
    for key, value in ENV.items():
        os.environ.setdefault(key, value)
    jobs_path, out_path = sys.argv[1], sys.argv[2]
    with open(jobs_path) as f:
        jobs = json.load(f)
    results = run(jobs)
    with open(out_path, "w") as f:
        json.dump(results, f)
