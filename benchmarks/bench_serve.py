"""Serving throughput: `ats serve` with the ATS head vs the same server without it, and vs sequential in-process
`generate_calibrated`.

Two servers run side by side (calibrated: `--calibrator DIR`; uncalibrated: `--calibrator none`; started with the
tests' `Server` helper, which runs this checkout's code), each pinned to --threads torch threads; only one is under load at a time. For each number of concurrent clients, every client sends
--requests-per-client chat requests back to back (greedy, --new-tokens new tokens each, `ignore_eos` so every
request has exactly that many, `logprobs: true`); the calibrated and uncalibrated runs are interleaved and their
order alternates from repeat to repeat, so that drifting machine load hits both alike. Sequential = one prompt at a
time through `generate_calibrated` in this process (min_new_tokens = max_new_tokens), same threads.

    python benchmarks/bench_serve.py --calibrator runs/smol/head
    python benchmarks/bench_serve.py --calibrator runs/smol/head --clients 1,4 --new-tokens 32 --repeats 1   # quick
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np
import torch
from bench_generation import PROMPTS, command_line, load_average, preamble, run_info, save_results

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "serving"))
from ats.calibrators.ats import ATSCalibrator
from ats.generation import generate_calibrated
from ats.model.backbone import load_backbone

from server_process import Server  # noqa: E402  (the tests' server process helper)

ARMS = ("calibrated", "uncalibrated")


async def load(url: str, model: str, clients: int, per_client: int, new_tokens: int) -> dict:
    """`clients` concurrent clients, each sending `per_client` requests back to back; wall time, latencies, errors."""
    latencies, tokens, errors = [], 0, []

    async def client(index: int, http: httpx.AsyncClient) -> None:
        nonlocal tokens
        for k in range(per_client):
            prompt = PROMPTS[(index * per_client + k) % len(PROMPTS)]
            body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": new_tokens,
                    "temperature": 0, "ignore_eos": True, "logprobs": True}
            t0 = time.perf_counter()
            try:
                response = await http.post(url + "/v1/chat/completions", json=body)
                got = response.json()["usage"]["completion_tokens"] if response.status_code == 200 else None
            except (httpx.HTTPError, ValueError, KeyError) as err:
                errors.append(f"{type(err).__name__}: {err}")
                continue
            if got != new_tokens:
                errors.append(f"status {response.status_code}: {response.text[:200]}")
                continue
            latencies.append(time.perf_counter() - t0)
            tokens += got

    limits = httpx.Limits(max_connections=clients + 4, max_keepalive_connections=clients + 4)
    async with httpx.AsyncClient(timeout=3600, limits=limits) as http:
        t0 = time.perf_counter()
        await asyncio.gather(*(client(i, http) for i in range(clients)))
        wall = time.perf_counter() - t0
    return {"clients": clients, "requests": clients * per_client, "wall_s": wall, "tokens": tokens,
            "tokens_per_s": tokens / wall, "requests_per_s": len(latencies) / wall,
            "latency_p50_s": float(np.percentile(latencies, 50)) if latencies else None,
            "latency_p95_s": float(np.percentile(latencies, 95)) if latencies else None,
            "errors": len(errors), "error_messages": errors[:5]}


def step_timing(before: dict, after: dict) -> dict:
    """From the server's cumulative decode timers (/health) around one load: ms per decoding step, rows decoded
    together per step, and the share of the step time spent computing tau (the head)."""
    d = {k: after[k] - before[k] for k in before}
    steps = max(1, d["decode_steps"])
    return {"ms_per_step": 1000 * d["decode_s"] / steps, "rows_per_step": d["decode_rows"] / steps,
            "head_share": d["head_s"] / d["decode_s"] if d["decode_s"] else 0.0}


def sequential(backbone, calibrator, prompts: list[str], new_tokens: int) -> dict:
    t0 = time.perf_counter()
    tokens = 0
    for prompt in prompts:
        out = generate_calibrated(backbone, calibrator, prompt, max_new_tokens=new_tokens, min_new_tokens=new_tokens)
        tokens += len(out[0].token_ids)
    wall = time.perf_counter() - t0
    return {"prompts": len(prompts), "tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--calibrator", required=True, help="a trained ATS head folder")
    p.add_argument("--clients", default="1,4,16,32")
    p.add_argument("--requests-per-client", type=int, default=1)
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--sequential", type=int, default=2, help="prompts generated one at a time in process, per repeat")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--max-batch", type=int, default=16)
    p.add_argument("--out", default=str(Path(__file__).parent / "results" / "serve"), help="writes OUT.md and OUT.json")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    command = command_line(argv)
    clients = [int(c) for c in args.clients.split(",") if c]
    out = Path(args.out)
    logs = Path(tempfile.mkdtemp(prefix="ats-bench-serve-"))

    started = time.perf_counter()
    servers = {arm: Server(["--model", args.model, "--calibrator", head, "--threads", str(args.threads),
                            "--max-batch", str(args.max_batch), "--max-queue", "256"], logs / f"{arm}.log", wait=False)
               for arm, head in (("calibrated", args.calibrator), ("uncalibrated", "none"))}
    try:
        backbone = load_backbone(args.model)
        calibrator = ATSCalibrator.from_pretrained(args.calibrator, backbone=backbone)
        for server in servers.values():
            server.wait(timeout=600)
        for arm, server in servers.items():  # warm-up: first-call costs, allocator
            warm = asyncio.run(load(server.url, args.model, 4, 1, 8))
            if warm["errors"]:
                raise SystemExit(f"{arm} warm-up failed: {warm['error_messages']}")
        sequential(backbone, calibrator, PROMPTS[:1], 8)

        load_start = load_average()
        runs: dict[str, dict[str, list[dict]]] = {arm: {str(c): [] for c in clients} for arm in ARMS}
        seq_runs = []
        for r in range(args.repeats):
            seq = sequential(backbone, calibrator, [PROMPTS[(r + i) % len(PROMPTS)] for i in range(args.sequential)],
                             args.new_tokens)
            seq_runs.append(seq)
            print(f"repeat {r + 1}/{args.repeats} sequential {seq['tokens_per_s']:6.1f} tok/s", file=sys.stderr,
                  flush=True)
            for i, c in enumerate(clients):
                for arm in (ARMS if (r + i) % 2 == 0 else ARMS[::-1]):
                    before = servers[arm].health()["timing"]
                    result = asyncio.run(load(servers[arm].url, args.model, c, args.requests_per_client,
                                              args.new_tokens))
                    result.update(step_timing(before, servers[arm].health()["timing"]))
                    runs[arm][str(c)].append(result)
                    print(f"repeat {r + 1}/{args.repeats} clients {c:3d} {arm:12s} {result['wall_s']:7.1f} s "
                          f"{result['tokens_per_s']:6.1f} tok/s p50 {result['latency_p50_s'] or 0:6.1f} s "
                          f"errors {result['errors']}", file=sys.stderr, flush=True)
        load_end = load_average()
    finally:
        for server in servers.values():
            server.stop()
    wall = time.perf_counter() - started

    seq_tps = statistics.median(s["tokens_per_s"] for s in seq_runs)
    rows = []
    for c in clients:
        cal, unc = runs["calibrated"][str(c)], runs["uncalibrated"][str(c)]
        row = {"clients": c, "requests": cal[0]["requests"],
               "paired_ratio": statistics.median(a["tokens_per_s"] / b["tokens_per_s"] for a, b in zip(cal, unc)),
               "errors": sum(x["errors"] for x in cal + unc)}
        for arm, results in (("calibrated", cal), ("uncalibrated", unc)):
            row[arm] = {key: statistics.median(x[key] for x in results) for key in
                        ("tokens_per_s", "requests_per_s", "latency_p50_s", "latency_p95_s", "ms_per_step",
                         "rows_per_step", "head_share")}
            row[arm]["runs"] = results
        row["ratio_of_medians"] = row["calibrated"]["tokens_per_s"] / row["uncalibrated"]["tokens_per_s"]
        row["in_run_ratio"] = 1 - row["calibrated"]["head_share"]  # tokens/s with the head / the same steps without
        row["vs_sequential"] = row["calibrated"]["tokens_per_s"] / seq_tps
        rows.append(row)
    result = {
        **run_info(command, args.threads, load_start, load_end),
        "model": {"name": backbone.name, "revision": backbone.revision,
                  "parameters": sum(x.numel() for x in backbone.model.parameters())},
        "calibrator": {"path": args.calibrator, "head": calibrator.config_.head.head_type,
                       "parameters": sum(x.numel() for x in calibrator.head.parameters())},
        "new_tokens": args.new_tokens, "clients": clients, "requests_per_client": args.requests_per_client,
        "repeats": args.repeats, "max_batch": args.max_batch,
        "request": "chat, greedy, ignore_eos, logprobs: true, one of 8 prompts (bench_generation.PROMPTS)",
        "sequential": {"runs": seq_runs, "tokens_per_s": seq_tps},
        "wall_seconds": wall,
        "results": rows,
    }
    table = format_table(result)
    print(table)
    save_results(out, result, format_markdown(result, table))
    return 0


def format_table(result: dict) -> str:
    lines = ["| clients | requests | calibrated tok/s | uncalibrated tok/s | calibrated / uncalibrated (paired) | "
             "in-run ratio | calibrated req/s | p50 / p95 latency (s), calibrated | p50 / p95 latency (s), "
             "uncalibrated | rows / step | ms / step, cal. / uncal. | calibrated / sequential | errors |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for row in result["results"]:
        cal, unc = row["calibrated"], row["uncalibrated"]
        lines.append(f"| {row['clients']} | {row['requests']} | {cal['tokens_per_s']:.1f} | {unc['tokens_per_s']:.1f} | "
                     f"{row['paired_ratio']:.3f} | {row['in_run_ratio']:.3f} | {cal['requests_per_s']:.3f} | "
                     f"{cal['latency_p50_s']:.1f} / {cal['latency_p95_s']:.1f} | {unc['latency_p50_s']:.1f} / "
                     f"{unc['latency_p95_s']:.1f} | {cal['rows_per_step']:.1f} | {cal['ms_per_step']:.0f} / "
                     f"{unc['ms_per_step']:.0f} | {row['vs_sequential']:.2f}x | {row['errors']} |")
    return "\n".join(lines)


def format_markdown(result: dict, table: str) -> str:
    seq = result["sequential"]
    return "\n".join([
        *preamble(result, "Serving: calibrated vs uncalibrated `ats serve`, and vs sequential `generate_calibrated`",
                  f"{result['machine']['torch_threads']} per server and in process"),
        f"Model: {result['model']['name']} ({result['model']['parameters'] / 1e6:.1f}M parameters); head: "
        f"{result['calibrator']['head']} ({result['calibrator']['parameters']:,} parameters, "
        f"`{result['calibrator']['path']}`).",
        "",
        f"Load: N concurrent clients x {result['requests_per_client']} request(s) each, {result['new_tokens']} new "
        f"tokens per request ({result['request']}); server --max-batch {result['max_batch']}; {result['repeats']} "
        f"repeats, calibrated and uncalibrated runs interleaved, order alternating. Tokens/s = generated tokens / "
        f"wall time of the whole load (first request sent to last answer received); figures are medians over "
        f"repeats; the paired ratio is the median over repeats of calibrated / uncalibrated tokens/s of the same "
        f"repeat. In-run ratio = 1 - (time computing tau / decoding time) inside the calibrated server during the "
        f"same load (its /health timers), i.e. its tokens/s relative to the same steps without the head: robust to "
        f"machine load, unlike a ratio of two runs. Rows / step = sequences decoded together (median). Sequential: {seq['runs'][0]['prompts']} prompts one at a time through `generate_calibrated` in "
        f"process, {seq['tokens_per_s']:.1f} tokens/s (median over repeats). Total benchmark time "
        f"{result['wall_seconds']:.0f} s.",
        "",
        table,
        "",
    ])


if __name__ == "__main__":
    raise SystemExit(main())
