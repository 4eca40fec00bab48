"""Tokens/s of plain `generate` vs calibrated generation (linear / mlp / transformer ATS heads).

Every run generates exactly --new-tokens tokens per sequence (min_new_tokens = max_new_tokens), greedy, from the
same chat-templated, left-padded prompts. Plain and calibrated runs are interleaved within each repeat (the order is
rotated from repeat to repeat) so that drifting machine load hits all of them alike. Both timings are end to end:
prompts in, decoded texts out.

    python benchmarks/bench_generation.py --repeats 2
    python benchmarks/bench_generation.py --new-tokens 32 --repeats 1 --batches 1   # a quick look
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import transformers

from ats.calibrators.ats import ATSCalibrator
from ats.generation import encode_prompts, generate_calibrated
from ats.generation import processor as generation
from ats.model.backbone import load_backbone

PROMPTS = [
    "Explain how a refrigerator works.",
    "Write a short story about a lighthouse keeper.",
    "What are the main causes of the French Revolution?",
    "Describe the water cycle to a ten-year-old.",
    "Give me a recipe for a simple tomato soup.",
    "Why is the sky blue?",
    "List some tips for learning a new language.",
    "Summarise the plot of Hamlet.",
]
METHODS = ("plain", "linear", "mlp", "transformer")


def machine() -> dict:
    info = {"cpu": platform.processor() or "unknown", "cores": os.cpu_count(), "platform": platform.platform()}
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        fields = dict(line.split(":", 1) for line in out.splitlines() if ":" in line)
        fields = {k.strip(): v.strip() for k, v in fields.items()}
        info["cpu"] = fields.get("Model name", info["cpu"])
        info["lscpu_cpus"] = fields.get("CPU(s)")
        info["threads_per_core"] = fields.get("Thread(s) per core")
    except (OSError, subprocess.CalledProcessError):
        pass
    return info


def load_average() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def run_info(command: str, threads: int, load_start, load_end) -> dict:
    """What a results file records about the run: command, machine (threads, load) and versions."""
    return {"command": command,
            "machine": {**machine(), "torch_threads": threads, "load_average_start": load_start,
                        "load_average_end": load_end},
            "versions": {"python": platform.python_version(), "torch": torch.__version__,
                         "transformers": transformers.__version__}}


def command_line(argv: list[str] | None) -> str:
    """The command that ran this benchmark, as typed."""
    return "python " + " ".join(shlex.quote(a) for a in [sys.argv[0], *(argv if argv is not None else sys.argv[1:])])


def save_results(out: Path, result: dict, markdown: str) -> None:
    """OUT.json, and OUT.md keeping the notes written below the `<!-- notes -->` marker of the previous one."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    md = out.with_suffix(".md")
    notes = md.read_text().split("<!-- notes -->", 1)[1] if md.is_file() and "<!-- notes -->" in md.read_text() else ""
    md.write_text(markdown + "\n<!-- notes -->" + (notes or "\n"))


def preamble(result: dict, title: str, threads: str) -> list[str]:
    """The first lines of a results page: title, command, machine."""
    m = result["machine"]
    return [
        f"# {title}",
        "",
        f"Command: `{result['command']}`",
        "",
        f"Machine: {m['cpu']}, {m['cores']} cores visible, torch threads {threads}; load average "
        f"{m['load_average_start']} at start, {m['load_average_end']} at end. torch {result['versions']['torch']}, "
        f"transformers {result['versions']['transformers']}.",
        "",
    ]


def randomised_calibrator(backbone, head_type: str, seed: int = 0) -> ATSCalibrator:
    """A head away from identity (tau varies by token), as a trained one would be; timing does not depend on it."""
    torch.manual_seed(seed)
    calibrator = ATSCalibrator.for_backbone(backbone, head_type=head_type)
    with torch.no_grad():
        calibrator.head.proj.weight.normal_(0.0, 0.02)
    calibrator.head.eval()
    return calibrator.to(backbone.device)


class ProcessorTimer:
    """Accumulates the time spent in `CalibrationProcessor.__call__` (head + scaling + token probabilities) and in
    its `finish` (the token probabilities still pending when `generate` returns): the calibration's own cost,
    measured inside the run and so far less sensitive to machine load than a difference of two end-to-end timings."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.calls = 0
        self._call = generation.CalibrationProcessor.__call__
        self._finish = generation.CalibrationProcessor.finish
        timer = self

        def timed(processor, input_ids, scores):
            t0 = time.perf_counter()
            out = timer._call(processor, input_ids, scores)
            timer.seconds += time.perf_counter() - t0
            timer.calls += 1
            return out

        def timed_finish(processor, new_tokens):
            t0 = time.perf_counter()
            timer._finish(processor, new_tokens)
            timer.seconds += time.perf_counter() - t0

        generation.CalibrationProcessor.__call__ = timed
        generation.CalibrationProcessor.finish = timed_finish

    def take(self) -> tuple[float, int]:
        seconds, calls, self.seconds, self.calls = self.seconds, self.calls, 0.0, 0
        return seconds, calls


def run_plain(backbone, prompts, new_tokens: int) -> int:
    ids, mask, _ = encode_prompts(backbone, prompts)
    seq = backbone.model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens,
                                  min_new_tokens=new_tokens, do_sample=False,
                                  pad_token_id=backbone.tokenizer.pad_token_id)
    backbone.tokenizer.batch_decode(seq[:, ids.shape[1]:], skip_special_tokens=True)
    return int(seq[:, ids.shape[1]:].numel())


def run_calibrated(backbone, calibrator, prompts, new_tokens: int) -> int:
    outs = generate_calibrated(backbone, calibrator, prompts, max_new_tokens=new_tokens, min_new_tokens=new_tokens)
    return sum(len(o.token_ids) for o in outs)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--batches", default="1,8")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default=str(Path(__file__).parent / "results" / "generation"),
                   help="writes OUT.md and OUT.json")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    command = command_line(argv)

    backbone = load_backbone(args.model)
    calibrators = {head: randomised_calibrator(backbone, head) for head in METHODS[1:]}
    batches = [int(b) for b in args.batches.split(",") if b]
    runners = {"plain": lambda prompts: run_plain(backbone, prompts, args.new_tokens)}
    for head, calibrator in calibrators.items():
        runners[head] = lambda prompts, c=calibrator: run_calibrated(backbone, c, prompts, args.new_tokens)

    prompt_lengths = {}
    for b in batches:
        prompts = [PROMPTS[i % len(PROMPTS)] for i in range(b)]
        ids, mask, _ = encode_prompts(backbone, prompts)
        prompt_lengths[b] = {"padded": int(ids.shape[1]), "min": int(mask.sum(1).min()), "max": int(mask.sum(1).max())}
        for method in METHODS:  # warm-up: allocator, lazy initialisation, first-call costs
            count = run_plain(backbone, prompts, 4) if method == "plain" else \
                run_calibrated(backbone, calibrators[method], prompts, 4)
            assert count == 4 * b

    timer = ProcessorTimer()
    processor_s: dict[str, dict[str, list[float]]] = {str(b): {m: [] for m in METHODS[1:]} for b in batches}
    load_start = load_average()
    started = time.perf_counter()
    times: dict[str, dict[str, list[float]]] = {str(b): {m: [] for m in METHODS} for b in batches}
    for r in range(args.repeats):
        for b in batches:
            prompts = [PROMPTS[i % len(PROMPTS)] for i in range(b)]
            order = METHODS[r % len(METHODS):] + METHODS[:r % len(METHODS)]
            for method in order:
                timer.take()
                t0 = time.perf_counter()
                count = runners[method](prompts)
                elapsed = time.perf_counter() - t0
                spent, calls = timer.take()
                if method != "plain":
                    processor_s[str(b)][method].append(spent)
                if count != b * args.new_tokens:
                    raise SystemExit(f"{method} batch {b}: generated {count} tokens, expected {b * args.new_tokens}")
                times[str(b)][method].append(elapsed)
                print(f"repeat {r + 1}/{args.repeats} batch {b} {method:11s} {elapsed:7.2f} s "
                      f"({count / elapsed:6.1f} tok/s)", file=sys.stderr, flush=True)
    wall = time.perf_counter() - started
    load_end = load_average()

    rows = []
    for b in batches:
        plain = times[str(b)]["plain"]
        for method in METHODS:
            mine = times[str(b)][method]
            median = statistics.median(mine)
            rows.append({
                "batch": b, "method": method, "seconds": mine, "median_s": median,
                "tokens_per_s": b * args.new_tokens / median,
                "overhead": median / statistics.median(plain),  # calibrated time / plain time
                "paired_overhead": statistics.median(m / p for m, p in zip(mine, plain)),
            })
            if method != "plain":
                spent = processor_s[str(b)][method]
                rows[-1]["processor_s"] = spent
                rows[-1]["processor_ms_per_step"] = 1000 * statistics.median(spent) / args.new_tokens
                # the calibration's own cost relative to the rest of the same run
                rows[-1]["processor_overhead"] = statistics.median(1 + x / (t - x) for x, t in zip(spent, mine))

    head_params = {h: sum(p.numel() for p in c.head.parameters()) for h, c in calibrators.items()}
    result = {
        **run_info(command, args.threads, load_start, load_end),
        "model": {"name": backbone.name, "revision": backbone.revision, "hidden_size": backbone.hidden_size,
                  "vocab_size": backbone.vocab_size, "dtype": str(backbone.dtype),
                  "parameters": sum(p.numel() for p in backbone.model.parameters())},
        "head_parameters": head_params,
        "new_tokens": args.new_tokens, "batches": batches, "repeats": args.repeats, "prompt_lengths": prompt_lengths,
        "decoding": "greedy, min_new_tokens = max_new_tokens, chat template, left padding",
        "wall_seconds": wall,
        "results": rows,
    }
    table = format_table(result)
    print(table)
    save_results(Path(args.out), result, format_markdown(result, table))
    return 0


def format_table(result: dict) -> str:
    lines = ["| batch | method | median time (s) | tokens/s | overhead (time / plain) | paired overhead | "
             "processor ms/step | in-run overhead |",
             "|---:|---|---:|---:|---:|---:|---:|---:|"]
    for row in result["results"]:
        extra = (f"{row['processor_ms_per_step']:.2f} | {row['processor_overhead']:.3f}" if "processor_s" in row
                 else "- | -")
        lines.append(f"| {row['batch']} | {row['method']} | {row['median_s']:.2f} | {row['tokens_per_s']:.1f} | "
                     f"{row['overhead']:.3f} | {row['paired_overhead']:.3f} | {extra} |")
    return "\n".join(lines)


def format_markdown(result: dict, table: str) -> str:
    model = result["model"]
    return "\n".join([
        *preamble(result, "Calibrated generation: cost of the ATS head", str(result["machine"]["torch_threads"])),
        f"Model: {model['name']} ({model['parameters'] / 1e6:.1f}M parameters, hidden {model['hidden_size']}, "
        f"vocabulary {model['vocab_size']}, {model['dtype']}). Head parameters: "
        + ", ".join(f"{k} {v:,}" for k, v in result["head_parameters"].items()) + ".",
        "",
        f"{result['new_tokens']} new tokens per sequence ({result['decoding']}); batches {result['batches']}; "
        f"{result['repeats']} repeats, plain and calibrated runs interleaved, order rotated per repeat; prompt "
        f"lengths (padded/min/max) {result['prompt_lengths']}. Times are end to end (prompts in, texts out). "
        f"Overhead = median calibrated time / median plain time; paired overhead = median over repeats of "
        f"(calibrated / plain of the same repeat). Processor ms/step = time inside `CalibrationProcessor` (head, "
        f"scaling, token probabilities; its `finish` included) per decoding step, prefill included; in-run overhead = calibrated time / (calibrated time - "
        f"processor time) within the same run, which is robust to machine load. "
        f"Total benchmark time {result['wall_seconds']:.0f} s.",
        "",
        table,
        "",
    ])


if __name__ == "__main__":
    raise SystemExit(main())
