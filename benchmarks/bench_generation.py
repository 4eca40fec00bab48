"""Tokens/s of calibrated generation on the one decoding core: uncalibrated, temperature scaling and the ATS
transformer head, as ratios to uncalibrated in the same run, and the calibrator's share of decoding time.

Every run decodes exactly --new-tokens tokens per sequence (min_new_tokens = max_new_tokens), greedy, from the same
chat-templated prompts, through `ats.generation.Decoder` (what `generate_calibrated` runs); transformers' own
`generate` is timed beside them as a reference. The arms are interleaved within each repeat (the order rotated from
repeat to repeat) so that drifting machine load hits all of them alike. Times are end to end (prompt ids in, tokens
and their probabilities out). Head share = time computing the calibration inside decoding steps (the head's tau, or
the logits map) / decoding time, from the decoder's own timers: robust to machine load.

    python benchmarks/bench_generation.py --repeats 3
    python benchmarks/bench_generation.py --new-tokens 16 --repeats 1 --batches 1   # a quick look
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

from ats.calibrators import build_calibrator
from ats.calibrators.ats import ATSCalibrator
from ats.generation import Decoder, Row, SamplingParams, encode_prompts
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
METHODS = ("generate", "uncalibrated", "temperature", "ats")  # "generate": transformers' own, a reference
TEMPERATURE = 1.3  # the temperature-scaling arm's T (timing does not depend on it)


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


def temperature_scaling(temperature: float = TEMPERATURE):
    """A temperature-scaling calibrator with T set (as if fitted)."""
    calibrator = build_calibrator("temperature")
    calibrator.temperature = temperature
    return calibrator


def random_probe(backbone, temperature: float = TEMPERATURE):
    """A correctness probe on three layers (the middle, three quarters, the last) with random weights, as if
    fitted: its cost (the layers captured during decoding, one more batched step for an answer cut by max tokens,
    the probe's dot product when an answer finishes) does not depend on them."""
    from ats.calibrators.probe import VIEWS, CorrectnessProbe
    from ats.model.layers import candidate_layers, decoder_layers
    from ats.training.probe_fit import layer_set

    layers = layer_set("spread", candidate_layers(len(decoder_layers(backbone.model))))
    probe = CorrectnessProbe(layers=layers, views=list(VIEWS), c=1.0, hidden_size=backbone.hidden_size,
                             base_model=backbone.name, revision=backbone.revision)
    d = len(layers) * len(VIEWS) * backbone.hidden_size + 1
    g = torch.Generator().manual_seed(0)
    probe.set_weights(0.01 * torch.randn(d, generator=g), 0.0, torch.zeros(d), torch.ones(d))
    probe.temperature = temperature
    return probe


def run_generate(backbone, ids, mask, new_tokens: int) -> tuple[int, dict]:
    """transformers' `generate`, greedy, exactly `new_tokens` per row; (tokens, no timers)."""
    seq = backbone.model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens,
                                  min_new_tokens=new_tokens, do_sample=False,
                                  pad_token_id=backbone.tokenizer.pad_token_id)
    return int(seq[:, ids.shape[1]:].numel()), {}


def run_core(backbone, calibrator, prompts: list[list[int]], new_tokens: int) -> tuple[int, dict]:
    """The decoding core with `calibrator` (None: uncalibrated), greedy, exactly `new_tokens` per row; (tokens, the
    decoder's timers)."""
    rows = [Row(p, i, backbone.tokenizer, max_tokens=new_tokens, min_tokens=new_tokens,
                sampling=SamplingParams(temperature=0)) for i, p in enumerate(prompts)]
    decoder = Decoder(backbone, calibrator)
    decoder.run(rows)
    return sum(len(r.records) for r in rows), dict(decoder.timing)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--batches", default="1,4,16")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--methods", default=",".join(METHODS),
                   help=f"arms, of {', '.join(METHODS)} and probe (a correctness probe's extra pass per answer)")
    p.add_argument("--out", default=str(Path(__file__).parent / "results" / "generation"),
                   help="writes OUT.md and OUT.json")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    command = command_line(argv)

    backbone = load_backbone(args.model)
    methods = [m for m in args.methods.split(",") if m]
    unknown = sorted(set(methods) - set(METHODS) - {"probe"})
    if unknown or "uncalibrated" not in methods:
        raise SystemExit(f"--methods: unknown {unknown} or no 'uncalibrated' (the reference)")
    calibrators = {"uncalibrated": None, "temperature": temperature_scaling(),
                   "ats": randomised_calibrator(backbone, "transformer"), "probe": random_probe(backbone)}
    batches = [int(b) for b in args.batches.split(",") if b]

    prompt_lengths, inputs = {}, {}
    for b in batches:
        prompts = [PROMPTS[i % len(PROMPTS)] for i in range(b)]
        ids, mask, _ = encode_prompts(backbone, prompts)
        inputs[b] = (ids, mask, [row[m.bool()].tolist() for row, m in zip(ids, mask)])
        prompt_lengths[b] = {"padded": int(ids.shape[1]), "min": int(mask.sum(1).min()), "max": int(mask.sum(1).max())}

    def run(method: str, b: int, new_tokens: int) -> tuple[int, dict]:
        ids, mask, lists = inputs[b]
        if method == "generate":
            return run_generate(backbone, ids, mask, new_tokens)
        return run_core(backbone, calibrators[method], lists, new_tokens)

    for b in batches:
        for method in methods:  # warm-up: allocator, lazy initialisation, first-call costs
            assert run(method, b, 4)[0] == 4 * b

    load_start = load_average()
    started = time.perf_counter()
    times: dict[str, dict[str, list[float]]] = {str(b): {m: [] for m in methods} for b in batches}
    shares: dict[str, dict[str, list[float]]] = {str(b): {m: [] for m in methods} for b in batches}
    for r in range(args.repeats):
        for b in batches:
            order = methods[r % len(methods):] + methods[:r % len(methods)]
            for method in order:
                t0 = time.perf_counter()
                count, timing = run(method, b, args.new_tokens)
                elapsed = time.perf_counter() - t0
                if count != b * args.new_tokens:
                    raise SystemExit(f"{method} batch {b}: generated {count} tokens, expected {b * args.new_tokens}")
                times[str(b)][method].append(elapsed)
                if timing:
                    shares[str(b)][method].append((timing["head_s"] / timing["decode_s"],
                                                   timing["score_s"] / timing["decode_s"]))
                print(f"repeat {r + 1}/{args.repeats} batch {b} {method:12s} {elapsed:7.2f} s "
                      f"({count / elapsed:6.1f} tok/s)", file=sys.stderr, flush=True)
    wall = time.perf_counter() - started
    load_end = load_average()

    rows = []
    for b in batches:
        base = times[str(b)]["uncalibrated"]
        for method in methods:
            mine = times[str(b)][method]
            median = statistics.median(mine)
            rows.append({
                "batch": b, "method": method, "seconds": mine, "median_s": median,
                "tokens_per_s": b * args.new_tokens / median,
                # tokens/s relative to uncalibrated: of the medians, and the median of same-repeat pairs
                "ratio": statistics.median(base) / median,
                "paired_ratio": statistics.median(u / m for m, u in zip(mine, base)),
                **share_figures(shares[str(b)][method], shares[str(b)]["uncalibrated"]),
            })

    result = {
        **run_info(command, args.threads, load_start, load_end),
        "model": {"name": backbone.name, "revision": backbone.revision, "hidden_size": backbone.hidden_size,
                  "vocab_size": backbone.vocab_size, "dtype": str(backbone.dtype),
                  "parameters": sum(p.numel() for p in backbone.model.parameters())},
        "head_parameters": sum(p.numel() for p in calibrators["ats"].head.parameters()), "methods": methods,
        "new_tokens": args.new_tokens, "batches": batches, "repeats": args.repeats, "prompt_lengths": prompt_lengths,
        "decoding": "greedy, min_new_tokens = max_new_tokens, chat template",
        "wall_seconds": wall,
        "results": rows,
    }
    table = format_table(result)
    print(table)
    save_results(Path(args.out), result, format_markdown(result, table))
    return 0


def share_figures(mine: list[tuple[float, float]], base: list[tuple[float, float]]) -> dict:
    """From (head share, scoring share) of decoding time per run: their medians and the in-run ratio, the arm's
    tokens/s relative to uncalibrated decoding estimated inside each run, (1 - head - scoring) / (1 - the
    uncalibrated run's own calibration and scoring shares); robust to machine load. Empty for `generate`."""
    if not mine:
        return {"head_share": None, "score_share": None, "in_run_ratio": None}
    head, scored = (statistics.median(x[i] for x in mine) for i in (0, 1))
    base_total = statistics.median(x[0] + x[1] for x in base)
    return {"head_share": head, "score_share": scored, "in_run_ratio": (1 - head - scored) / (1 - base_total)}


def format_table(result: dict) -> str:
    lines = ["| batch | method | median time (s) | tokens/s | tokens/s vs uncalibrated | paired | head share of "
             "decoding | scoring share | in-run ratio vs uncalibrated |", "|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
    for row in result["results"]:
        shares = (["-"] * 3 if row["head_share"] is None else
                  [f"{100 * row['head_share']:.1f}%", f"{100 * row['score_share']:.1f}%", f"{row['in_run_ratio']:.3f}"])
        lines.append(f"| {row['batch']} | {row['method']} | {row['median_s']:.2f} | {row['tokens_per_s']:.1f} | "
                     f"{row['ratio']:.3f} | {row['paired_ratio']:.3f} | {' | '.join(shares)} |")
    return "\n".join(lines)


def format_markdown(result: dict, table: str) -> str:
    model = result["model"]
    return "\n".join([
        *preamble(result, "Calibrated generation on the one decoding core: cost of the calibrator",
                  str(result["machine"]["torch_threads"])),
        f"Model: {model['name']} ({model['parameters'] / 1e6:.1f}M parameters, hidden {model['hidden_size']}, "
        f"vocabulary {model['vocab_size']}, {model['dtype']}). ATS: a transformer head "
        f"({result['head_parameters']:,} parameters, away from identity); temperature: T = {TEMPERATURE}.",
        "",
        f"{result['new_tokens']} new tokens per sequence ({result['decoding']}); batches {result['batches']}; "
        f"{result['repeats']} repeats, arms interleaved, order rotated per repeat; prompt lengths (padded/min/max) "
        f"{result['prompt_lengths']}. `uncalibrated`, `temperature`, `ats`: the decoding core "
        f"(`ats.generation.Decoder`, what `generate_calibrated`, `ats generate` and `ats serve` run); `generate`: "
        f"transformers' own `model.generate`, a reference. Tokens/s vs uncalibrated = median uncalibrated time / "
        f"median time; paired = median over repeats of the same ratio within a repeat. Head share = time "
        f"computing the calibration (the head's tau, or the logits map) / decoding-step time; scoring share = time "
        f"computing the chosen tokens' calibrated and uncalibrated log-probabilities / decoding-step time; both "
        f"from the decoder's timers. In-run ratio = (1 - head share - scoring share) / (1 - the uncalibrated run's "
        f"head and scoring shares): the arm's tokens/s relative to uncalibrated decoding, estimated inside each run, "
        f"robust to machine load. Total benchmark time {result['wall_seconds']:.0f} s."
        + (" `probe`: a correctness probe on three layers (temperature for tokens), read during decoding; every "
           "answer here is cut by max tokens, so each row also takes one more batched step to feed its last token, "
           "and the probe's P(correct) is computed when it finishes: outside the shares, so its cost is the "
           "tokens/s ratio." if "probe" in result.get("methods", ()) else ""),
        "",
        table,
        "",
    ])


if __name__ == "__main__":
    raise SystemExit(main())
