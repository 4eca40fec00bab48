"""What a calibrator costs inside vLLM, read from a sampling profile of vLLM's model worker rather than from
throughput: the share of the worker's samples spent in ats's code (the head's layer, the scale, the concatenation)
and not in the base model's. On a shared 2-core machine, two bursts of the same server differ in tokens/s by 5-10%
(`bench_vllm.py`'s A/A arm), so throughput ratios do not resolve 1%; a share is counted within one burst of one
process and does not move with the machine's speed.

One arm's server at a time (vLLM compiled, its default; float32; one engine thread, so the worker is one thread that
py-spy samples whole); for each client count, --windows bursts of load (`bench_serve.load`: N clients x
--requests-per-client chats of --new-tokens greedy tokens), each recorded by `py-spy record` on the worker
("VLLM::Worker"), blocking: the worker is paused for each sample, since a stack read while it runs can mix a
finished call's frames with the next call's (the base's logits matmul filed under the calibrator's scale). A sample
is the calibrator's when its stack holds a frame of `ats/` with no frame of vLLM's base model
(`vllm/model_executor/models/`) beneath it. Reported: the calibrator's share of all the worker's samples (waits
included: they are part of a step's wall time) and of its busy samples (those not waiting for vLLM's engine core),
each the mean over windows with a 95% t-interval, and the throughput ratio each implies against uncalibrated,
(1 - share) / (1 - share_none): the uncalibrated arm's share is the rule's floor (its wrapper only passes calls
through, and ats's frames there cost the same in every arm). With waits kept, the ratio holds if the engine core's
time per step is unchanged; with no waits, if the worker alone set the pace: the lower bound. Needs py-spy
(`pip install py-spy`).

    python benchmarks/profile_vllm.py --out results/vllm_profile
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

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
from bench_vllm import VLLMServer, paired_ratio
from scipy import stats

from ats.integrations.vllm.export import export_for_vllm
from ats.model.backbone import load_backbone

ARMS = ("none", "ats", "temperature")
ATS_FRAME = "(ats/"  # py-spy writes a frame as "function (package/module.py:line)"
BASE_FRAME = "(vllm/model_executor/models/"  # the base model's code (Llama, Qwen2, ...)
WAIT_FRAMES = ("(vllm/distributed/device_communicators/shm_broadcast.py", "sched_yield (")  # waits for the engine


def calibrator_samples(raw: str) -> tuple[int, int, int]:
    """(calibrator's samples, samples not waiting for the engine core, all samples) of py-spy's raw output: one
    line per stack, frames joined by ';' from the outermost, then a count."""
    mine = busy = total = 0
    for line in raw.splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack:
            continue
        frames, n = stack.split(";"), int(count)
        total += n
        busy += 0 if any(wait in frame for frame in frames for wait in WAIT_FRAMES) else n
        ours = [i for i, frame in enumerate(frames) if ATS_FRAME in frame]
        if ours and not any(BASE_FRAME in frame for frame in frames[ours[-1]:]):
            mine += n
    return mine, busy, total


def worker_pid(server: VLLMServer) -> int:
    """The pid of the server's model worker."""
    children = psutil.Process(server.process.pid).children(recursive=True)
    workers = [p.pid for p in children if p.name().startswith("VLLM::Worker")]
    if len(workers) != 1:
        raise SystemExit(f"expected one VLLM::Worker process under the server, found {len(workers)}")
    return workers[0]


def profiled_load(server: VLLMServer, model: str, clients: int, args, out: Path) -> dict:
    """One burst of load with py-spy on the worker; its samples and tokens/s."""
    spy = subprocess.Popen(["py-spy", "record", "--pid", str(worker_pid(server)), "--rate", str(args.rate),
                            "--format", "raw", "--output", str(out)],
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(1.0)  # py-spy attaches
    result = asyncio.run(load(server.url, model, clients, args.requests_per_client, args.new_tokens))
    spy.send_signal(2)  # SIGINT: py-spy writes what it has
    spy.wait(60)
    mine, busy, total = calibrator_samples(out.read_text())
    return {"tokens_per_s": result["tokens_per_s"], "errors": result["errors"], "calibrator_samples": mine,
            "busy_samples": busy, "samples": total, "share": mine / total, "busy_share": mine / busy}


def mean_interval(values: list[float]) -> dict:
    """Mean with a 95% t-interval and the standard error."""
    mean, se = statistics.fmean(values), statistics.stdev(values) / len(values) ** 0.5
    half = stats.t.ppf(0.975, len(values) - 1) * se
    return {"mean": mean, "low": mean - half, "high": mean + half, "se": se, "windows": len(values)}


def implied_ratio(share: dict, floor: dict) -> dict:
    """Throughput with the calibrator over without, (1 - share) / (1 - floor): the time outside ats's frames is the
    same in both arms, so T_none (1 - floor) = T_calibrated (1 - share). A 95% interval by the delta method (the two
    arms' windows are independent; normal quantile)."""
    ratio = (1 - share["mean"]) / (1 - floor["mean"])
    half = 1.96 * ratio * (share["se"] ** 2 / (1 - share["mean"]) ** 2
                           + floor["se"] ** 2 / (1 - floor["mean"]) ** 2) ** 0.5
    return {"ratio": ratio, "low": ratio - half, "high": ratio + half}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--clients", default="1,4,16")
    p.add_argument("--windows", type=int, default=6, help="profiled bursts per arm and client count")
    p.add_argument("--requests-per-client", type=int, default=2)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--rate", type=int, default=200, help="py-spy samples per second")
    p.add_argument("--out", default=str(Path(__file__).parent / "results" / "vllm_profile"))
    args = p.parse_args(argv)
    if shutil.which("py-spy") is None:
        raise SystemExit("profile_vllm.py needs py-spy: pip install py-spy")
    command, load_start, started = command_line(argv), load_average(), time.perf_counter()
    clients = [int(c) for c in args.clients.split(",") if c]
    work = Path(tempfile.mkdtemp(prefix="ats-profile-vllm-"))
    backbone = load_backbone(args.model)
    randomised_calibrator(backbone, "transformer").save_pretrained(work / "ats")
    temperature_scaling().save_pretrained(work / "temperature")
    del backbone
    rows = {arm: {} for arm in ARMS}
    for arm in ARMS:
        export = export_for_vllm(args.model, None if arm == "none" else str(work / arm), work / f"export-{arm}")
        server = VLLMServer(export, args.model, work / f"{arm}.log", threads=1, eager=False, max_batch=16, kv_gib=2)
        try:
            server.wait(900)
            asyncio.run(load(server.url, args.model, 4, 1, 8))  # warm-up
            for c in clients:
                runs = [profiled_load(server, args.model, c, args, work / f"{arm}-{c}-{w}.txt")
                        for w in range(args.windows)]
                rows[arm][str(c)] = {"share": mean_interval([r["share"] for r in runs]),
                                     "busy_share": mean_interval([r["busy_share"] for r in runs]), "runs": runs}
                print(f"{arm:12s} clients {c:3d} calibrator share {rows[arm][str(c)]['share']['mean']:.4f} "
                      f"tok/s {statistics.median(r['tokens_per_s'] for r in runs):.1f}", file=sys.stderr, flush=True)
        finally:
            server.stop()
    result = {**run_info(command, 1, load_start, load_average()), "model": args.model, "clients": clients,
              "windows": args.windows, "requests_per_client": args.requests_per_client, "new_tokens": args.new_tokens,
              "rate": args.rate, "wall_seconds": time.perf_counter() - started, "arms": rows,
              "implied_ratios": {arm: {str(c): implied_ratio(rows[arm][str(c)]["share"], rows["none"][str(c)]["share"])
                                       for c in clients} for arm in ARMS if arm != "none"},
              "implied_ratios_busy": {arm: {str(c): implied_ratio(rows[arm][str(c)]["busy_share"],
                                                                  rows["none"][str(c)]["busy_share"])
                                            for c in clients} for arm in ARMS if arm != "none"},
              "tokens_per_s_ratios": {arm: {str(c): paired_ratio(
                  [r["tokens_per_s"] for r in rows[arm][str(c)]["runs"]],
                  [r["tokens_per_s"] for r in rows["none"][str(c)]["runs"]]) for c in clients}
                  for arm in ARMS if arm != "none"}}
    table = format_table(result)
    save_results(Path(args.out), result, format_markdown(result, table))
    print(table)
    return 0


def format_table(result: dict) -> str:
    calibrated = [a for a in ARMS if a != "none"]

    def interval(x: dict, key: str, digits: int) -> str:
        return f"{x[key]:.{digits}f} [{x['low']:.{digits}f}, {x['high']:.{digits}f}]"

    lines = ["| clients | " + " | ".join(f"{a}: share (of all / of busy)" for a in ARMS) + " | "
             + " | ".join(f"{a} / none implied (waits kept / no waits)" for a in calibrated) + " |",
             "|---:|" + "---:|" * (len(ARMS) + len(calibrated))]
    for c in result["clients"]:
        rows = [result["arms"][a][str(c)] for a in ARMS]
        lines.append(f"| {c} | " + " | ".join(f"{r['share']['mean']:.4f} / {r['busy_share']['mean']:.4f}" for r in rows)
                     + " | " + " | ".join(f"{interval(result['implied_ratios'][a][str(c)], 'ratio', 4)} / "
                                          f"{interval(result['implied_ratios_busy'][a][str(c)], 'ratio', 4)}"
                                          for a in calibrated) + " |")
    return "\n".join(lines)


def format_markdown(result: dict, table: str) -> str:
    return "\n".join([
        *preamble(result, "What a calibrator costs inside vLLM, from a profile of its model worker", "1 per server"),
        f"Model {result['model']}; per arm and client count, {result['windows']} profiled bursts of N clients x "
        f"{result['requests_per_client']} chats x {result['new_tokens']} tokens (py-spy at {result['rate']} Hz on "
        f"the worker). Calibrator share = samples with an `ats/` frame and no base-model frame beneath it / all the "
        f"worker's samples (or / the samples not waiting for vLLM's engine core: busy), mean over bursts. Implied "
        f"= (1 - share) / (1 - none's share), 95% interval by the delta method: with waits kept, if the engine "
        f"core's time is unchanged; with no waits, if the worker alone set the pace (the lower bound). Tokens/s of the profiled bursts are in the JSON only: "
        f"they come from servers up one at a time, minutes apart, with py-spy reading the worker, so their ratios "
        f"are not a comparison. Targets (issue 38): the head >= 0.95x, temperature scaling >= 0.99x of uncalibrated. "
        f"Total time {result['wall_seconds']:.0f} s.",
        "",
        table,
        "",
    ])


if __name__ == "__main__":
    raise SystemExit(main())
