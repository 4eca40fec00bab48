"""Serving throughput of calibrated models inside vLLM: vLLM's OpenAI server on `ats export --engine vllm` folders
(the ATS transformer head, temperature scaling, Thermometer, none) against each other and against `ats serve` with the same
calibrators, on each model, at 1 / 4 / 16 concurrent clients; plus each server's start-up time.

The arms' servers of a model start one after another (each start-up timed alone) and then stay up together, all on
the same cores with the same thread count (vLLM: VLLM_CPU_OMP_THREADS_BIND=0-(threads-1), a 2 GiB KV cache; ats
serve: --threads). Load comes in --repeats rounds; in each, for every client count, the arms run back to back in
rotating order, so only one server works at a time and the arms compared are seconds apart: each round gives a
paired ratio, and a ratio is reported as the geometric mean over rounds with a 95% t-interval. Each client sends
--requests-per-client chat requests back to back (greedy, --new-tokens new tokens, ignore_eos, logprobs: true;
`bench_serve.load`); each server is warmed up first. The ATS head is a
transformer head away from identity (`bench_generation.randomised_calibrator`; timing does not depend on training),
temperature scaling has T = 1.3, Thermometer is of the default width with random weights
(`tests/helpers.random_thermometer`: one temperature per prompt, computed from the prompt in vLLM's prompt
layer). Start-up = launch to the first answer of /health.

An arm is ENGINE:CALIBRATOR. ENGINE `vllm` is vLLM's server with ats's layer passing requests through (the layer is
given no export, so it decides nothing), `bare` the same server without ats's layer, `served` the server as
`ats serve --engine vllm` runs it (the layer deciding every choice against a threshold certified on made-up answers,
`tests/helpers.certified_copy`; every response must carry the `ats` field) and `ats` is `ats serve`. `served:X /
bare:X` is what ats's whole layer costs (the request checks, the decisions, their monitor); `--stream` measures
it on streamed answers, where each event is rewritten.

Each load also records CPU seconds (user + system) of the server (its process and children) and of the process
that runs the model (vLLM's worker), tabled as tokens per worker CPU-second with --threads 1 (with more engine
threads, OpenMP workers spin at barriers). Measured, this adds no resolution on vLLM 0.32: the worker spins while it
waits for the engine core (and the engine core while it waits for the worker), so its CPU time is its wall time
(`results/vllm_cpu_time.md`). What a calibrator costs below 1% is read from a profile: `profile_vllm.py`.

    python benchmarks/bench_vllm.py                                    # SmolLM2 and Qwen2.5-Coder-0.5B
    python benchmarks/bench_vllm.py --models smollm2-135m-instruct --clients 1,4 --new-tokens 16   # quick
    python benchmarks/bench_vllm.py --arms vllm:none,vllm:ats,vllm:temperature --no-eager --repeats 6   # targets
    python benchmarks/bench_vllm.py --arms vllm:none,vllm:none/b,vllm:thermometer --no-eager --repeats 6
    python benchmarks/bench_vllm.py --models smollm2-135m-instruct --arms vllm:none,vllm:none/b,vllm:ats,vllm:temperature \
        --no-eager --threads 1 --repeats 20 --requests-per-client 2 --new-tokens 64   # one engine thread
    python benchmarks/bench_vllm.py --models smollm2-135m-instruct --arms bare:ats,served:ats,vllm:ats --no-eager \
        --repeats 6 --requests-per-client 6 --new-tokens 64 [--stream]   # what ats's layer costs
"""

from __future__ import annotations

import argparse
import asyncio
import math
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import psutil
from bench_generation import (
    command_line,
    load_average,
    preamble,
    randomised_calibrator,
    run_info,
    save_results,
    temperature_scaling,
)
from bench_serve import load
from scipy import stats

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "serving"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from ats.calibrators import load_calibrator
from ats.calibrators.thermometer import Thermometer
from ats.integrations.vllm.export import export_for_vllm
from ats.integrations.vllm.middleware import EXPORT_ENV, MODEL_NAME_ENV
from ats.integrations.vllm.serve import server_argv
from ats.model.backbone import load_backbone

from helpers import certified_copy, random_thermometer  # noqa: E402  (the tests' Thermometer with random weights)
from server_process import Server, free_port, server_env  # noqa: E402  (the tests' server process helper)

ARMS = ("vllm:none", "vllm:ats", "vllm:temperature", "vllm:thermometer", "ats:none", "ats:ats", "ats:temperature",
        "ats:thermometer")  # the default arms
CALIBRATORS = ("none", "ats", "temperature", "thermometer")
SERVERS = {  # an arm's engine -> what serves it
    "vllm": "vLLM's server on the export with ats's layer passing requests through (no export named: no decisions)",
    "bare": "vLLM's server on the export without ats's layer (what `vllm serve EXPORT` runs)",
    "served": "what `ats serve --engine vllm` runs: ats's layer deciding every choice (a certified threshold)",
    "ats": "`ats serve`"}
PAIRS = {"vllm ats / vllm none": ("vllm:ats", "vllm:none"),
         "vllm temperature / vllm none": ("vllm:temperature", "vllm:none"),
         "vllm thermometer / vllm none": ("vllm:thermometer", "vllm:none"),
         "vllm ats / ats serve ats": ("vllm:ats", "ats:ats"),
         "vllm temperature / ats serve temperature": ("vllm:temperature", "ats:temperature"),
         "vllm thermometer / ats serve thermometer": ("vllm:thermometer", "ats:thermometer"),
         "vllm none / ats serve none": ("vllm:none", "ats:none"),
         **{f"{e} {c}/b / {e} {c}": (f"{e}:{c}/b", f"{e}:{c}") for e in ("vllm", "bare", "served", "ats")
            for c in ("none", "ats")},  # two servers of one calibrator: the instance effect (the A/A control)
         **{f"served {c} / bare {c}": (f"served:{c}", f"bare:{c}") for c in CALIBRATORS},  # ats's whole layer
         **{f"vllm {c} / bare {c}": (f"vllm:{c}", f"bare:{c}") for c in CALIBRATORS}}  # the layer passing through


def omp_bind(threads: int) -> str:
    """VLLM_CPU_OMP_THREADS_BIND for a server on the first `threads` cores."""
    return f"0-{threads - 1}" if threads > 1 else "0"


def cpu_seconds(process: subprocess.Popen) -> tuple[float, float, float]:
    """(server, model, front end) user + system CPU seconds so far: of a server's process and live children, of
    the processes that run the model (vLLM's "VLLM::Worker"; the engine core beside it spins while it waits for the
    worker, so its CPU time is not work; an `ats serve` server runs its model in its own process), and of the
    server's own process (vLLM's API server: HTTP, tokenizing, detokenizing and ats's layer)."""
    root = psutil.Process(process.pid)
    seconds = {p: sum(p.cpu_times()[:2]) for p in [root, *root.children(recursive=True)]}
    workers = [t for p, t in seconds.items() if p.name().startswith("VLLM::Worker")]
    return sum(seconds.values()), sum(workers) if workers else sum(seconds.values()), seconds[root]


class VLLMServer:
    """vLLM's OpenAI server (`ats.integrations.vllm.serve.server_argv`) on an export, on a free port.

    Args:
        layer: "checks" (ats's layer without an export named: it checks requests and passes them through),
            "none" (vLLM's server alone) or "decisions" (ats's layer deciding every choice from the export, as
            `ats serve --engine vllm` runs it).
    """

    def __init__(self, export: Path, name: str, log: Path, threads: int, eager: bool, max_batch: int,
                 kv_gib: int, layer: str = "checks") -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        extra = ["--enforce-eager"] if eager else []
        argv = server_argv(export, served_model_name=name, host="127.0.0.1", port=self.port, dtype="float32",
                           max_model_len=2048, max_num_seqs=max_batch, vllm_args=extra)
        if layer == "none":
            at = argv.index("--middleware")
            del argv[at:at + 2]
        env = dict(server_env(), VLLM_CPU_KVCACHE_SPACE=str(kv_gib), VLLM_CPU_NUM_OF_RESERVED_CPU="0",
                   VLLM_CPU_OMP_THREADS_BIND=omp_bind(threads))
        if layer == "decisions":
            env.update({EXPORT_ENV: str(export), MODEL_NAME_ENV: name})
        self._log = log.open("w")
        self.process = subprocess.Popen(argv, stdout=self._log, stderr=subprocess.STDOUT, env=env)

    def wait(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"vLLM server exited with {self.process.returncode}; see {self._log.name}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"vLLM server not up after {timeout} s; see {self._log.name}")

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self._log.close()


def start(arm: str, model: str, folders: dict, work: Path, args) -> tuple[object, float]:
    """Start the arm's server and wait for it; (server, start-up seconds)."""
    engine, calibrator = arm.split(":")
    calibrator = calibrator.split("/")[0]  # "none/b": a second server of the same calibrator
    log = work / (arm.replace(":", "-").replace("/", "-") + ".log")
    t0 = time.perf_counter()
    if engine != "ats":
        export = folders[f"certified-export:{calibrator}" if engine == "served" else f"export:{calibrator}"]
        server = VLLMServer(export, model, log, args.threads, args.eager, args.max_batch, args.kv_cache_gib,
                            layer={"vllm": "checks", "bare": "none", "served": "decisions"}[engine])
        server.wait(args.start_timeout)
    else:
        server = Server(["--model", model, "--calibrator", folders[calibrator], "--threads", str(args.threads),
                         "--max-batch", str(args.max_batch), "--max-queue", "256"],
                        log, wait=False)
        server.wait(timeout=args.start_timeout)
    return server, time.perf_counter() - t0


def paired_ratio(a: list[float], b: list[float]) -> dict:
    """The geometric mean of a/b over paired rounds with a 95% t-interval on its log (rounds are the pairs)."""
    logs = [math.log(x / y) for x, y in zip(a, b)]
    mean = statistics.fmean(logs)
    if len(logs) < 2:
        return {"ratio": math.exp(mean), "low": None, "high": None, "rounds": len(logs)}
    half = stats.t.ppf(0.975, len(logs) - 1) * statistics.stdev(logs) / math.sqrt(len(logs))
    return {"ratio": math.exp(mean), "low": math.exp(mean - half), "high": math.exp(mean + half), "rounds": len(logs)}


def bench_model(model: str, args, clients: list[int], work: Path) -> dict:
    """Start the arms' servers one after another (start-up timed alone), keep them all up, then run --repeats
    rounds: in each, every client count, the arms back to back in rotating order. Idle servers take no CPU, so the
    arms of a round run seconds apart on the same cores and their ratio is paired."""
    arms = args.arms
    backbone = load_backbone(model)
    folders = {"none": "none", **{name: str(work / name) for name in ("ats", "temperature", "thermometer")}}
    randomised_calibrator(backbone, "transformer").save_pretrained(folders["ats"])
    temperature_scaling().save_pretrained(folders["temperature"])
    random_thermometer(backbone.hidden_size, 0, mlp_hidden=Thermometer.Config(hidden_size=1).mlp_hidden).save_pretrained(
        folders["thermometer"])
    for calibrator in {arm.split(":")[1].split("/")[0] for arm in arms if arm.split(":")[0] in ("vllm", "bare")}:
        folders[f"export:{calibrator}"] = export_for_vllm(model, None if calibrator == "none" else folders[calibrator],
                                                          work / f"export-{calibrator}")
    for calibrator in {arm.split(":")[1].split("/")[0] for arm in arms if arm.startswith("served:")}:
        loaded = None if calibrator == "none" else load_calibrator(folders[calibrator])
        source = None if loaded is None else certified_copy(Path(folders[calibrator]), work / f"certified-{calibrator}",
                                                            loaded, backbone, seed=0)
        folders[f"certified-export:{calibrator}"] = export_for_vllm(model, source, work / f"certified-export-{calibrator}")
    del backbone
    runs = {arm: {str(c): [] for c in clients} for arm in arms}
    startup, servers = {}, {}
    try:
        for arm in arms:
            servers[arm], startup[arm] = start(arm, model, folders, work, args)
            warm = asyncio.run(load(servers[arm].url, model, 4, 1, 8, stream=args.stream,
                                    expect_ats=arm.startswith("served:")))
            if warm["errors"]:
                raise SystemExit(f"{model} {arm} warm-up failed: {warm['error_messages']}")
            print(f"{model} {arm:17s} up in {startup[arm]:.0f} s", file=sys.stderr, flush=True)
        for r in range(args.repeats):
            for c in clients:
                shift = (r * len(clients) + clients.index(c)) % len(arms)
                for arm in arms[shift:] + arms[:shift]:
                    server_cpu, model_cpu, front_cpu = cpu_seconds(servers[arm].process)
                    result = asyncio.run(load(servers[arm].url, model, c, args.requests_per_client, args.new_tokens,
                                              stream=args.stream, expect_ats=arm.startswith("served:")))
                    server_after, model_after, front_after = cpu_seconds(servers[arm].process)
                    result["server_cpu_s"], result["model_cpu_s"] = server_after - server_cpu, model_after - model_cpu
                    result["front_cpu_ms_per_token"] = 1000 * (front_after - front_cpu) / max(1, result["tokens"])
                    result["tokens_per_cpu_s"] = result["tokens"] / result["model_cpu_s"]
                    runs[arm][str(c)].append(result)
                    print(f"{model} round {r + 1}/{args.repeats} {arm:17s} clients {c:3d} "
                          f"{result['tokens_per_s']:6.1f} tok/s {result['tokens_per_cpu_s']:6.1f} tok/cpu-s "
                          f"p50 {result['latency_p50_s'] or 0:6.1f} s "
                          f"errors {result['errors']}", file=sys.stderr, flush=True)
    finally:
        for server in servers.values():
            server.stop()
    pairs = {name: pair for name, pair in PAIRS.items() if set(pair) <= set(arms)}
    rows = []
    for c in clients:
        tps = {arm: statistics.median(x["tokens_per_s"] for x in runs[arm][str(c)]) for arm in arms}
        rows.append({"clients": c, "tokens_per_s": tps,
                     "p50_s": {arm: statistics.median(x["latency_p50_s"] or 0 for x in runs[arm][str(c)])
                               for arm in arms},
                     "errors": sum(x["errors"] for arm in arms for x in runs[arm][str(c)]),
                     "ratios": {name: paired_ratio([x["tokens_per_s"] for x in runs[a][str(c)]],
                                                   [x["tokens_per_s"] for x in runs[b][str(c)]])
                                for name, (a, b) in pairs.items()},
                     "front_ratios": {name: paired_ratio([x["front_cpu_ms_per_token"] for x in runs[a][str(c)]],
                                                         [x["front_cpu_ms_per_token"] for x in runs[b][str(c)]])
                                      for name, (a, b) in pairs.items()},
                     "cpu_ratios": {name: paired_ratio([x["tokens_per_cpu_s"] for x in runs[a][str(c)]],
                                                       [x["tokens_per_cpu_s"] for x in runs[b][str(c)]])
                                    for name, (a, b) in pairs.items()},
                     "runs": {arm: runs[arm][str(c)] for arm in arms}})
    return {"model": model, "results": rows, "startup_s": startup}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="smollm2-135m-instruct,qwen2.5-coder-0.5b-instruct")
    p.add_argument("--clients", default="1,4,16")
    p.add_argument("--requests-per-client", type=int, default=2)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3, help="rounds of load over the servers, which stay up")
    p.add_argument("--arms", default=",".join(ARMS),
                   help="comma-separated ENGINE:CALIBRATOR, ENGINE one of " + "; ".join(f"{k}: {v}" for k, v in
                                                                                 SERVERS.items())
                        + f"; CALIBRATOR one of {', '.join(CALIBRATORS)}; a '/b' after it (vllm:none/b): a second "
                          f"server of the same export, a control for how much two servers of one model differ")
    p.add_argument("--stream", action="store_true", help="clients stream their answers (server-sent events)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--max-batch", type=int, default=16)
    p.add_argument("--eager", action=argparse.BooleanOptionalAction, default=True,
                   help="vLLM with --enforce-eager (no torch.compile: minutes less start-up)")
    p.add_argument("--kv-cache-gib", type=int, default=2,
                   help="each vLLM server's KV cache (VLLM_CPU_KVCACHE_SPACE); the servers are up together")
    p.add_argument("--start-timeout", type=float, default=900)
    p.add_argument("--out", default=str(Path(__file__).parent / "results" / "vllm"), help="writes OUT.md and OUT.json")
    args = p.parse_args(argv)
    command = command_line(argv)
    clients = [int(c) for c in args.clients.split(",") if c]
    args.arms = [a for a in args.arms.split(",") if a]
    arm_pattern = re.compile(rf"({'|'.join(SERVERS)}):({'|'.join(CALIBRATORS)})(/b)?")
    if unknown := [a for a in args.arms if not arm_pattern.fullmatch(a)]:
        p.error(f"--arms: unknown arm(s) {', '.join(unknown)}; each is ENGINE:CALIBRATOR, ENGINE one of "
                f"{', '.join(SERVERS)}, CALIBRATOR one of {', '.join(CALIBRATORS)} (/b: a second server)")
    work = Path(tempfile.mkdtemp(prefix="ats-bench-vllm-"))
    started = time.perf_counter()
    load_start = load_average()
    models = []
    for model in [m for m in args.models.split(",") if m]:  # results saved after each model
        models.append(bench_model(model, args, clients, work / model))
        result = {**run_info(command, args.threads, load_start, load_average()), "clients": clients,
                  "requests_per_client": args.requests_per_client, "new_tokens": args.new_tokens,
                  "repeats": args.repeats, "arms": args.arms, "threads": args.threads, "max_batch": args.max_batch,
                  "eager": args.eager, "stream": args.stream, "servers": {e: SERVERS[e] for e in
                                                                            {a.split(":")[0] for a in args.arms}},
                  "vllm_env": {"VLLM_CPU_KVCACHE_SPACE": str(args.kv_cache_gib), "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
                               "VLLM_CPU_OMP_THREADS_BIND": omp_bind(args.threads)},
                  "wall_seconds": time.perf_counter() - started, "models": models}
        table = format_table(result)
        save_results(Path(args.out), result, format_markdown(result, table))
    print(table)
    return 0


def _ratio(r: dict, fmt: str) -> str:
    """The paired ratio and its interval."""
    return f"{r['ratio']:{fmt}}" + (f" [{r['low']:{fmt}}, {r['high']:{fmt}}]" if r["low"] is not None else "")


def format_table(result: dict) -> str:
    arms = result["arms"]
    names = [n for n in PAIRS if set(PAIRS[n]) <= set(arms)]
    lines = ["| model | clients | " + " | ".join(f"{a} (tok/s)" for a in arms) + " | "
             + " | ".join(names) + " | errors |", "|---|---:|" + "---:|" * (len(arms) + len(names) + 1)]
    for model in result["models"]:
        for row in model["results"]:
            lines.append(f"| {model['model']} | {row['clients']} | "
                         + " | ".join(f"{row['tokens_per_s'][a]:.1f}" for a in arms) + " | "
                         + " | ".join(_ratio(row["ratios"][n], ".3f") for n in names) + f" | {row['errors']} |")
    if result.get("threads") == 1:  # one engine thread: no OpenMP barrier spin (vLLM's worker still polls)
        lines += ["", "Tokens per CPU-second of the process that runs the model (vLLM's worker):", "",
                  "| model | clients | " + " | ".join(f"{a} (tok/cpu-s)" for a in arms) + " | "
                  + " | ".join(names) + " |", "|---|---:|" + "---:|" * (len(arms) + len(names))]
        for model in result["models"]:
            for row in model["results"]:
                per_cpu = [statistics.median(x["tokens_per_cpu_s"] for x in row["runs"][a]) for a in arms]
                lines.append(f"| {model['model']} | {row['clients']} | " + " | ".join(f"{v:.1f}" for v in per_cpu)
                             + " | " + " | ".join(_ratio(row["cpu_ratios"][n], ".3f") for n in names) + " |")
    layer = [n for n in names if " / bare " in n]
    if layer:  # what ats's layer costs the API server process, which runs it
        lines += ["", "CPU milliseconds of the API server process per generated token (median over rounds; ratio: "
                  "paired, as above):", "", "| model | clients | " + " | ".join(f"{a} (ms/token)" for a in arms)
                  + " | " + " | ".join(layer) + " |", "|---|---:|" + "---:|" * (len(arms) + len(layer))]
        for model in result["models"]:
            for row in model["results"]:
                front = [statistics.median(x["front_cpu_ms_per_token"] for x in row["runs"][a]) for a in arms]
                lines.append(f"| {model['model']} | {row['clients']} | " + " | ".join(f"{v:.2f}" for v in front)
                             + " | " + " | ".join(_ratio(row["front_ratios"][n], ".3f") for n in layer) + " |")
    lines += ["", "| model | " + " | ".join(f"start-up {a} (s)" for a in arms) + " |", "|---|" + "---:|" * len(arms)]
    for model in result["models"]:
        lines.append(f"| {model['model']} | " + " | ".join(f"{model['startup_s'][a]:.0f}" for a in arms) + " |")
    return "\n".join(lines)


def format_markdown(result: dict, table: str) -> str:
    return "\n".join([
        *preamble(result, "Calibrated models inside vLLM: throughput against vLLM uncalibrated and against "
                  "`ats serve`", f"{result['machine']['torch_threads']} per server"),
        f"Load: N concurrent clients x {result['requests_per_client']} chat request(s) each, {result['new_tokens']} "
        f"new tokens per request (greedy, ignore_eos, logprobs: true{', streamed' if result.get('stream') else ''}). "
        f"Servers: " + "; ".join(f"{k}: {v}" for k, v in result.get("servers", {}).items()) + ". The arms' servers stay up side by side and "
        f"take the load in {result['repeats']} round(s), arms back to back in rotating order within each round (one "
        f"server works at a time). vLLM {'with --enforce-eager' if result['eager'] else 'compiled (its default)'}"
        f", float32, --max-num-seqs {result['max_batch']}; ats serve --max-batch {result['max_batch']}. Tokens/s = "
        f"generated tokens / wall time of the load, median over rounds; a ratio is the geometric mean over rounds of "
        f"each round's paired ratio, with a 95% t-interval over rounds in brackets. Targets: vLLM ATS / "
        f"vLLM none >= 0.95, vLLM temperature / vLLM none >= 0.99. Total benchmark time "
        f"{result['wall_seconds']:.0f} s.",
        "",
        table,
        "",
    ])


if __name__ == "__main__":
    raise SystemExit(main())
