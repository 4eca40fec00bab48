"""Serving throughput on the one decoding core: `ats serve` with the ATS head and with temperature scaling vs the same
server uncalibrated, and vs sequential in-process `generate_calibrated`.

Three servers run side by side (`--calibrator ATS_DIR`, `--calibrator TEMPERATURE_DIR`, `--calibrator none`; started
with the tests' `Server` helper, which runs this checkout's code), each pinned to --threads torch threads; only one is
under load at a time. For each number of concurrent clients, every client sends --requests-per-client chat requests
back to back (greedy, --new-tokens new tokens each, `ignore_eos` so every request has exactly that many,
`logprobs: true`); the arms are interleaved and their order rotates from repeat to repeat, so that drifting machine
load hits all alike. Sequential = one prompt at a time through `generate_calibrated` with the ATS head in this
process (min_new_tokens = max_new_tokens), same threads. Without --calibrator the ATS head is a transformer head away
from identity (`bench_generation.randomised_calibrator`; timing does not depend on training).

    python benchmarks/bench_serve.py --repeats 3
    python benchmarks/bench_serve.py --clients 1,4 --new-tokens 16 --repeats 1   # quick
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np
import torch
from bench_generation import (
    PROMPTS,
    TEMPERATURE,
    command_line,
    load_average,
    preamble,
    randomised_calibrator,
    run_info,
    save_results,
    temperature_scaling,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "serving"))
from ats.calibrators import load_calibrator
from ats.generation import generate_calibrated
from ats.model.backbone import load_backbone

from server_process import Server  # noqa: E402  (the tests' server process helper)

ARMS = ("ats", "temperature", "uncalibrated")


async def load(url: str, model: str, clients: int, per_client: int, new_tokens: int, *, stream: bool = False,
               expect_ats: bool = False) -> dict:
    """`clients` concurrent clients, each sending `per_client` requests back to back; wall time, latencies, errors.

    Args:
        stream: each request streams (server-sent events, with the usage chunk); its latency ends at `[DONE]`.
        expect_ats: a response whose choice carries no `ats` field (the decision) counts as an error.
    """
    latencies, tokens, errors = [], 0, []

    async def answer(http: httpx.AsyncClient, body: dict) -> tuple[int | None, bool, str]:
        """(completion tokens or None, whether every choice carried the `ats` field, the failure's text)."""
        if not stream:
            response = await http.post(url + "/v1/chat/completions", json=body)
            if response.status_code != 200:
                return None, False, f"status {response.status_code}: {response.text[:200]}"
            out = response.json()
            return out["usage"]["completion_tokens"], all("ats" in c for c in out["choices"]), ""
        usage, decided = None, False
        async with http.stream("POST", url + "/v1/chat/completions",
                               json={**body, "stream": True, "stream_options": {"include_usage": True}}) as response:
            if response.status_code != 200:
                return None, False, f"status {response.status_code}: {(await response.aread())[:200]!r}"
            async for line in response.aiter_lines():
                if line == "data: [DONE]":
                    return (usage or {}).get("completion_tokens"), decided, ""
                if line.startswith("data: "):
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        return None, False, line[:200]
                    usage = chunk.get("usage") or usage
                    decided = decided or any("ats" in c for c in chunk.get("choices", []))
        return None, False, "the stream ended without [DONE]"

    async def client(index: int, http: httpx.AsyncClient) -> None:
        nonlocal tokens
        for k in range(per_client):
            prompt = PROMPTS[(index * per_client + k) % len(PROMPTS)]
            body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": new_tokens,
                    "temperature": 0, "ignore_eos": True, "logprobs": True}
            t0 = time.perf_counter()
            try:
                count, decided, failure = await answer(http, body)
            except (httpx.HTTPError, ValueError, KeyError) as err:
                errors.append(f"{type(err).__name__}: {err}")
                continue
            if count != new_tokens or (expect_ats and not decided):
                errors.append(failure or f"{count} tokens{'' if decided or not expect_ats else ', no ats field'}")
                continue
            latencies.append(time.perf_counter() - t0)
            tokens += count

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
            "head_share": d["head_s"] / d["decode_s"] if d["decode_s"] else 0.0,
            "score_share": d["score_s"] / d["decode_s"] if d["decode_s"] else 0.0}


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
    p.add_argument("--calibrator", default=None, help="an ATS head folder (default: a randomised transformer head)")
    p.add_argument("--clients", default="1,4,16")
    p.add_argument("--requests-per-client", type=int, default=1)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--sequential", type=int, default=2, help="prompts generated one at a time in process, per repeat")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--max-batch", type=int, default=16)
    p.add_argument("--out", default=str(Path(__file__).parent / "results" / "serve"), help="writes OUT.md and OUT.json")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    command = command_line(argv)
    clients = [int(c) for c in args.clients.split(",") if c]
    out = Path(args.out)
    logs = Path(tempfile.mkdtemp(prefix="ats-bench-serve-"))

    started = time.perf_counter()
    backbone = load_backbone(args.model)
    folders = {"ats": args.calibrator, "temperature": str(logs / "temperature"), "uncalibrated": "none"}
    if args.calibrator is None:
        folders["ats"] = str(logs / "ats")
        randomised_calibrator(backbone, "transformer").save_pretrained(folders["ats"])
    temperature_scaling().save_pretrained(folders["temperature"])
    calibrator = load_calibrator(folders["ats"], backbone=backbone)
    servers = {arm: Server(["--model", args.model, "--calibrator", folders[arm], "--threads", str(args.threads),
                            "--max-batch", str(args.max_batch), "--max-queue", "256"], logs / f"{arm}.log", wait=False)
               for arm in ARMS}
    try:
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
                shift = (r + i) % len(ARMS)
                for arm in ARMS[shift:] + ARMS[:shift]:
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
        base = runs["uncalibrated"][str(c)]
        row = {"clients": c, "requests": base[0]["requests"],
               "errors": sum(x["errors"] for arm in ARMS for x in runs[arm][str(c)])}
        for arm in ARMS:
            results = runs[arm][str(c)]
            row[arm] = {key: statistics.median(x[key] for x in results) for key in
                        ("tokens_per_s", "requests_per_s", "latency_p50_s", "latency_p95_s", "ms_per_step",
                         "rows_per_step", "head_share", "score_share")}
            row[arm]["runs"] = results
            # tokens/s relative to the uncalibrated server: median of same-repeat pairs, and of the medians
            row[arm]["paired_ratio"] = statistics.median(a["tokens_per_s"] / b["tokens_per_s"]
                                                         for a, b in zip(results, base))
            row[arm]["ratio_of_medians"] = row[arm]["tokens_per_s"] / statistics.median(b["tokens_per_s"]
                                                                                        for b in base)
            # tokens/s relative to uncalibrated decoding, estimated inside each server's runs (robust to load)
            row[arm]["in_run_ratio"] = ((1 - row[arm]["head_share"] - row[arm]["score_share"])
                                        / (1 - statistics.median(b["head_share"] + b["score_share"] for b in base)))
            row[arm]["vs_sequential"] = row[arm]["tokens_per_s"] / seq_tps
        rows.append(row)
    result = {
        **run_info(command, args.threads, load_start, load_end),
        "model": {"name": backbone.name, "revision": backbone.revision,
                  "parameters": sum(x.numel() for x in backbone.model.parameters())},
        "calibrator": {"path": args.calibrator or "randomised transformer head",
                       "head": calibrator.config_.head.head_type,
                       "parameters": sum(x.numel() for x in calibrator.head.parameters()),
                       "temperature": TEMPERATURE},
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
    lines = ["| clients | arm | tokens/s | vs uncalibrated (paired) | vs uncalibrated (medians) | head share of "
             "decoding | scoring share | in-run ratio vs uncalibrated | p50 / p95 latency (s) | rows / step | "
             "ms / step | vs sequential | errors |",
             "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for row in result["results"]:
        for arm in ARMS:
            x = row[arm]
            lines.append(f"| {row['clients']} | {arm} | {x['tokens_per_s']:.1f} | {x['paired_ratio']:.3f} | "
                         f"{x['ratio_of_medians']:.3f} | {100 * x['head_share']:.1f}% | {100 * x['score_share']:.1f}% | "
                         f"{x['in_run_ratio']:.3f} | {x['latency_p50_s']:.1f} / "
                         f"{x['latency_p95_s']:.1f} | {x['rows_per_step']:.1f} | {x['ms_per_step']:.0f} | "
                         f"{x['vs_sequential']:.2f}x | {row['errors'] if arm == ARMS[0] else ''} |")
    return "\n".join(lines)


def format_markdown(result: dict, table: str) -> str:
    seq = result["sequential"]
    cal = result["calibrator"]
    return "\n".join([
        *preamble(result, "Serving on the one decoding core: ATS and temperature scaling vs uncalibrated `ats serve`, "
                  "and vs sequential `generate_calibrated`", f"{result['machine']['torch_threads']} per server and "
                  "in process"),
        f"Model: {result['model']['name']} ({result['model']['parameters'] / 1e6:.1f}M parameters); ATS head: "
        f"{cal['head']} ({cal['parameters']:,} parameters, {cal['path']}); temperature scaling: T = "
        f"{cal['temperature']}.",
        "",
        f"Load: N concurrent clients x {result['requests_per_client']} request(s) each, {result['new_tokens']} new "
        f"tokens per request ({result['request']}); server --max-batch {result['max_batch']}; {result['repeats']} "
        f"repeats, the three servers' runs interleaved, order rotating. Tokens/s = generated tokens / wall time of "
        f"the whole load (first request sent to last answer received), median over repeats; vs uncalibrated "
        f"(paired) = median over repeats of the arm's / the uncalibrated server's tokens/s in the same repeat. Head "
        f"share = time computing the calibration (the head's tau, or the logits map) / decoding time inside that "
        f"server during the load (its /health timers); scoring share = time computing the chosen tokens' "
        f"calibrated and uncalibrated log-probabilities / decoding time; in-run ratio = (1 - head share - scoring "
        f"share) / (1 - the uncalibrated server's head and scoring shares): the arm's tokens/s relative to "
        f"uncalibrated decoding, estimated inside each server's runs, robust to machine load unlike a ratio of two "
        f"runs. Rows / "
        f"step = sequences decoded together. Sequential: {seq['runs'][0]['prompts']} prompts one at a time through "
        f"`generate_calibrated` with the ATS head in process, {seq['tokens_per_s']:.1f} tokens/s (median over "
        f"repeats). Total benchmark time {result['wall_seconds']:.0f} s.",
        "",
        table,
        "",
    ])


if __name__ == "__main__":
    raise SystemExit(main())
