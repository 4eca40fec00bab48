"""The prepared GPU check: speed and memory of every step of ats at the paper's scale, on random weights.

    bash scripts/gpu_check.sh                                  # on the GPU machine (bf16, both 7B shapes, < 8 min)
    PYTHONPATH=src python benchmarks/gpu_check.py --tiny --device cpu --out /tmp/gpu_check   # CPU smoke run, < 1 min

It needs only the source tree and torch, transformers, accelerate, safetensors, tqdm, scikit-learn, matplotlib: no
network, no embedded model, no `datasets`, `fastapi` or `uvicorn` (the `ats` modules it imports load none of them).
Two models are built from their configs with random weights directly on the device, one at a time: one shaped like
Llama-2-7B (hidden 4096, 32 layers, 32 heads, intermediate 11008, vocabulary 32,000) and one like Qwen2.5-7B
(hidden 3584, 28 layers, 28 heads / 4 KV heads, intermediate 18944, vocabulary 152,064). Their tokenizer is a
word-level one over the whole vocabulary (`w4 w17 ...`), built in memory; it only supplies pad / eos ids, prompt
encoding and decoding. Calibration numbers from random weights mean nothing; speed and memory do.

Per model, each step against the same step without the head, in the same run (medians of `--repeats` timed runs
after one untimed warm-up, variants interleaved with the order alternating per repeat):

1. extraction: `backbone.forward` only vs `extract_features` without and with the per-token scale summary;
2. cached head training (a FeatureStore with the summary): iterating the batches only vs `train_ats` on the summary
   route and on the exact route (`TrainingConfig(exact_loss=True)`);
3. online head training: iterating `OnlineFeatures` batches (the backbone forward) vs `train_ats` on them;
4. scoring synthetic questions: `score_letters` / `score_choices` with {uncalibrated} vs {uncalibrated, ats};
5. answers, the default route of `ats train` (`SyntheticQA`: TriviaQA's task on random words): plain
   `model.generate` of its prompts vs the answer set (greedy answers by the generation core, one scoring forward,
   the probe layers captured), then Thermometer trained on them and the correctness probe fitted, as `ats train`
   calls each (`train_spec`);
6. decoding at batch 1 and 16: plain `model.generate` vs `generate_calibrated` with the head (its KV cache),
   Thermometer and the probe, tokens/s.

Peak GPU memory (`torch.cuda.max_memory_allocated`, reset before each timed run) is recorded per variant, with the
device, torch and transformers versions. Each step runs in its own try/except: a failure is recorded with the last
line of its traceback and the other steps still run; no step starts after `--budget` seconds. The results
(OUT.json and OUT.md, default benchmarks/results/gpu_check) are rewritten after every step, so a run killed by the
wrapper's time limit still leaves what it measured.

The steps are in `gpu_check_steps.py`, the model shapes and synthetic data in `gpu_check_models.py`; this file runs
them and writes the results.

Status: this check has NOT run on a GPU yet (no GPU was lent to the session that wrote it); only the `--tiny` CPU
smoke run (tests/test_gpu_check.py) has. No results file is committed until the GPU run happens.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, replace
from datetime import datetime, timezone
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402
import transformers  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_generation import command_line, save_results  # noqa: E402
from gpu_check_models import SHAPES, TINY_SIZES, Shape, Sizes, build_backbone, synthetic_examples, tiny_shape  # noqa: E402
from gpu_check_steps import GIB, STEP_FUNCTIONS, Context, device_info, free_memory, timed  # noqa: E402

from ats.model.backbone import Backbone  # noqa: E402
from ats.model.scale_summary import ScaleSummarySpec  # noqa: E402

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "gpu_check"
STEPS = tuple(STEP_FUNCTIONS)  # in the order they run


# --- the run ----------------------------------------------------------------------------------------------------------
class Run:
    """The results of one run, written after every step; progress lines with UTC timestamps."""

    def __init__(self, args: argparse.Namespace, sizes: Sizes, shapes: list[Shape], command: str) -> None:
        self.args, self.sizes, self.out = args, sizes, Path(args.out)
        self.device = torch.device(args.device)
        self.start = time.perf_counter()
        self.result = {"title": "CPU smoke run (tiny models), not GPU results" if args.tiny else "GPU check",
                       "command": command, "started": now(), "tiny": args.tiny, "dtype": args.dtype,
                       "machine": device_info(self.device), "sizes": asdict(sizes),
                       "models": {s.name: {"shape": asdict(s)} for s in shapes}, "steps": [],
                       "wall_seconds": None}

    def elapsed(self) -> float:
        """Seconds since the run started."""
        return time.perf_counter() - self.start

    def log(self, message: str) -> None:
        """One progress line: UTC time, seconds since the start, the message."""
        print(f"[{now()} +{self.elapsed():6.1f}s] {message}", flush=True)

    def record(self, model: str, step: str, status: str, rows: list[dict], seconds: float, error: str = "") -> None:
        """Add one step's outcome and rewrite the results files."""
        entry = {"model": model, "step": step, "status": status, "seconds": seconds, "rows": rows}
        if error:
            entry["error"] = error
        self.result["steps"].append(entry)
        self.save()

    def save(self) -> None:
        """Write OUT.json and OUT.md (the markdown keeps notes below its `<!-- notes -->` marker)."""
        self.result["wall_seconds"] = self.elapsed()
        save_results(self.out, self.result, markdown(self.result))

    def attempt(self, model: str, step: str, fn: Callable[[], list[dict]]) -> bool:
        """Run one step unless the budget is spent; a failure is recorded with its traceback's last line."""
        if self.elapsed() > self.args.budget:
            self.log(f"{model} {step}: skipped, the {self.args.budget:.0f} s budget is spent")
            self.record(model, step, "skipped", [], 0.0, error=f"time budget of {self.args.budget:.0f} s spent")
            return False
        self.log(f"{model} {step} ...")
        start = time.perf_counter()
        try:
            rows = fn()
        except Exception:  # noqa: BLE001 - one failing step must not stop the others
            traceback.print_exc()
            error = traceback.format_exc().strip().splitlines()[-1]
            free_memory(self.device)
            self.log(f"{model} {step}: FAILED: {error}")
            self.record(model, step, "failed", [], time.perf_counter() - start, error=error)
            return False
        for row in rows:
            ratios = ", ".join(f"{v:.2f}x {k}" for k, v in row["ratios"].items())
            speed = f"{row['tokens_per_s']:10.0f} tok/s" if row["tokens"] else " " * 16
            self.log(f"  {row['variant']:24s} {row['seconds']:8.3f} s {speed}"
                     + (f"  {ratios}" if ratios else "") + (f"  peak {row['peak_gib']:.1f} GiB"
                                                            if row["peak_gib"] is not None else ""))
        self.record(model, step, "ok", rows, time.perf_counter() - start)
        return True

    def model(self, shape: Shape, dtype: torch.dtype) -> None:
        """Build one model, run every step on it, free it."""
        info = self.result["models"][shape.name]
        holder: dict[str, Backbone] = {}

        def build() -> list[dict]:
            seconds, peak = timed(lambda: holder.setdefault("backbone", build_backbone(shape, self.device, dtype)),
                                  self.device)
            params = sum(p.numel() for p in holder["backbone"].model.parameters())
            info.update(parameters=params, build_seconds=seconds, weights_gib=params * dtype.itemsize / GIB)
            return [{"variant": "build random weights", "seconds": seconds, "runs": [seconds], "peak_gib": peak,
                     "tokens": 0, "tokens_per_s": 0.0, "ratios": {}}]

        if not self.attempt(shape.name, "build", build):
            for step in self.args.steps:
                self.record(shape.name, step, "skipped", [], 0.0, error="the model was not built")
            return
        with tempfile.TemporaryDirectory(prefix="gpu-check-") as workdir:
            self.steps(Context(backbone=holder.pop("backbone"), sizes=self.sizes, device=self.device,
                               workdir=Path(workdir), examples=synthetic_examples(self.sizes, shape.vocab),
                               summary=ScaleSummarySpec()))
        free_memory(self.device)

    def steps(self, ctx: Context) -> None:
        """Every chosen step on one model (the model is freed when `ctx` goes)."""
        for step in self.args.steps:
            self.attempt(ctx.backbone.name, step, lambda s=step: STEP_FUNCTIONS[s](ctx))


def now() -> str:
    """The UTC time, to the second."""
    return datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M:%S")


# --- the report -------------------------------------------------------------------------------------------------------
def markdown(result: dict) -> str:
    """The results page: what ran where, then one table row per measured variant."""
    m = result["machine"]
    lines = [f"# {result['title']}", "", f"Command: `{result['command']}`", "",
             f"Device: {m['name']} ({m['device']}); torch {m['torch']} (CUDA {m['cuda']}), transformers "
             f"{m['transformers']}, Python {m['python']}. Started {result['started']} UTC, "
             f"{result['wall_seconds']:.0f} s in all. Weights {result['dtype']}, random (speed and memory only; "
             f"calibration numbers from random weights mean nothing).", "",
             "Sizes: " + ", ".join(f"{k} {v}" for k, v in result["sizes"].items()) + ".", "", "Models:", ""]
    for name, info in result["models"].items():
        s = info["shape"]
        built = (f", {info['parameters'] / 1e6:,.1f}M parameters ({info['weights_gib']:.2f} GiB), built in "
                 f"{info['build_seconds']:.1f} s" if "parameters" in info else ", not built")
        lines.append(f"- {name}: {s['family']}, hidden {s['hidden']}, {s['layers']} layers, {s['heads']} heads / "
                     f"{s['kv_heads']} KV heads, intermediate {s['intermediate']}, vocabulary {s['vocab']}{built}")
    lines += ["", "Times are medians over the repeats after one warm-up; ratios divide a variant's time by the named "
              "variant's (the same step without the head, or the other loss route). Peak memory: "
              "`torch.cuda.max_memory_allocated` of the variant's runs (weights included).", "",
              "| model | step | status | variant | time (s) | tokens/s | time ratios | peak memory (GiB) |",
              "|---|---|---|---|---:|---:|---|---:|"]
    for entry in result["steps"]:
        if not entry["rows"]:
            lines.append(f"| {entry['model']} | {entry['step']} | {entry['status']}: {entry.get('error', '')} "
                         f"| | | | | |")
        for row in entry["rows"]:
            ratios = "; ".join(f"{v:.2f}x {k}" for k, v in row["ratios"].items())
            peak = "-" if row["peak_gib"] is None else f"{row['peak_gib']:.1f}"
            speed = f"{row['tokens_per_s']:.0f}" if row["tokens"] else "-"
            lines.append(f"| {entry['model']} | {entry['step']} | {entry['status']} | {row['variant']} | "
                         f"{row['seconds']:.3f} | {speed} | {ratios} | {peak} |")
    return "\n".join(lines) + "\n"


# --- the command line -------------------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The options; `--tiny` switches the defaults of dtype and sizes to the CPU smoke run's."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--tiny", action="store_true", help="2-layer hidden-64 models, float32, small sizes (CPU smoke)")
    p.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default=None,
                   help="the models' dtype (default bfloat16; float32 with --tiny)")
    p.add_argument("--out", default=str(DEFAULT_OUT), help="writes OUT.json and OUT.md (a suffix is replaced)")
    p.add_argument("--models", default=",".join(s.name for s in SHAPES), help="comma-separated shape names")
    p.add_argument("--steps", default=",".join(STEPS), help="comma-separated steps, of " + ", ".join(STEPS))
    p.add_argument("--repeats", type=int, default=None, help="timed runs per variant (default 2; 1 with --tiny)")
    p.add_argument("--budget", type=float, default=420.0, help="no step starts after this many seconds")
    args = p.parse_args(argv)
    args.dtype = args.dtype or ("float32" if args.tiny else "bfloat16")
    args.steps = [s for s in args.steps.split(",") if s]
    unknown = [s for s in args.steps if s not in STEP_FUNCTIONS]
    names = [m for m in args.models.split(",") if m]
    unknown += [m for m in names if m not in {s.name for s in SHAPES}]
    if unknown:
        p.error(f"unknown steps or models: {unknown}")
    args.models = names
    return args


def main(argv: list[str] | None = None) -> int:
    """Run every step on every model; returns 1 if a step failed or was skipped, else 0."""
    args = parse_args(argv)
    sizes = TINY_SIZES if args.tiny else Sizes()
    if args.repeats is not None:
        sizes = replace(sizes, repeats=args.repeats)
    shapes = [tiny_shape(s) if args.tiny else s for s in SHAPES if s.name in args.models]
    run = Run(args, sizes, shapes, command_line(argv))
    run.log(f"device {run.result['machine']['name']}, torch {torch.__version__}, transformers "
            f"{transformers.__version__}, {args.dtype}; results -> {Path(args.out).with_suffix('.md')}")
    dtype = getattr(torch, args.dtype)
    for shape in shapes:
        run.model(shape, dtype)
    run.save()
    bad = [f"{e['model']} {e['step']}" for e in run.result["steps"] if e["status"] != "ok"]
    run.log(f"done in {run.elapsed():.0f} s; " + (f"not ok: {', '.join(bad)}" if bad else "every step ok"))
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
