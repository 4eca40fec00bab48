"""The prepared GPU check (benchmarks/gpu_check.py) runs end to end in its CPU smoke mode, as the GPU machine would run
it: from the source tree (PYTHONPATH=src), offline, with `datasets`, `fastapi` and `uvicorn` absent; and it measures
what it says: the tokens of each variant (counted here by hand from the smoke sizes), the medians and ratios of its
own runs, and a step with the head costing more than the same step's data alone."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
ABSENT = ("datasets", "fastapi", "uvicorn")  # not installed on the GPU machine
SHAPES = ("llama-2-7b-shape", "qwen2.5-7b-shape")
STEPS = ("build", "extraction", "training_cached", "training_online", "scoring", "answers", "decoding")

# the smoke sizes (TINY_SIZES) by hand: 8 sequences of 64, 62, ..., 50 tokens; 6 questions of 32 tokens, whose choice
# rows are 4 x 16 context tokens + 4 + 5 + 6 + 7 choice tokens; 8 answered questions of 4 new tokens (training and
# fitting on them count no tokens); 8 new tokens per decoded prompt, batches 1 and 4
SEQUENCE_TOKENS = sum(64 - 2 * i for i in range(8))  # 456
LETTER_TOKENS, CHOICE_TOKENS = 6 * 32, 6 * (4 * 16 + 4 + 5 + 6 + 7)
EXPECTED_TOKENS = {
    "extraction": dict.fromkeys(("forward only", "extract, no summary", "extract + summary"), SEQUENCE_TOKENS),
    "training_cached": dict.fromkeys(("batches only", "train, summary route", "train, exact route"), SEQUENCE_TOKENS),
    "training_online": dict.fromkeys(("online batches only", "train online"), SEQUENCE_TOKENS),
    "scoring": {"letters, uncalibrated": LETTER_TOKENS, "letters, + ats": LETTER_TOKENS,
                "choices, uncalibrated": CHOICE_TOKENS, "choices, + ats": CHOICE_TOKENS},
    "answers": {"plain generate": 8 * 4, "answers + probe layers": 8 * 4, "train thermometer": 0, "fit probe": 0},
    "decoding": {**{f"{name}, batch 1": 8 for name in ("plain", "calibrated", "thermometer", "probe")},
                 **{f"{name}, batch 4": 32 for name in ("plain", "calibrated", "thermometer", "probe")}},
}
# variants that do strictly more work than the one named (the same data plus the head's training, or the extraction's
# writing): tens of times more on these sizes, so the order holds whatever the machine's noise
COSTLIER = {("extraction", "extract + summary"): "forward only",
            ("training_cached", "train, summary route"): "batches only",
            ("training_cached", "train, exact route"): "batches only",
            ("training_online", "train online"): "online batches only"}

def markdown_row(out: Path, model: str, variant: str) -> str:
    """The results page's table row of one model's variant."""
    return next(line for line in out.with_suffix(".md").read_text().splitlines()
                if line.startswith(f"| {model} |") and f"| {variant} |" in line)


RUN = """
import runpy, sys
for name in {absent!r}:
    sys.modules[name] = None  # `import name` now fails, as where the package is not installed
sys.argv = ["benchmarks/gpu_check.py", "--tiny", "--device", "cpu", "--out", {out!r}]
runpy.run_path("benchmarks/gpu_check.py", run_name="__main__")
"""


@pytest.mark.slow  # the whole GPU check in a fresh process (about 8 s)
def test_tiny_cpu_run_reports_every_step(tmp_path):
    out = tmp_path / "gpu_check"
    env = {**os.environ, "PYTHONPATH": str(REPO / "src"), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, "-c", RUN.format(absent=ABSENT, out=str(out))], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.with_suffix(".json").read_text())
    steps = {(e["model"], e["step"]): e for e in result["steps"]}
    assert set(steps) == {(m, s) for m in SHAPES for s in STEPS}
    for (model, step), entry in steps.items():
        assert entry["status"] == "ok", (model, step, entry.get("error"))
        assert entry["rows"], (model, step)
        rows = {row["variant"]: row for row in entry["rows"]}
        for row in entry["rows"]:
            assert row["seconds"] > 0, (model, step, row["variant"])
        if step == "build":
            continue
        assert {name: row["tokens"] for name, row in rows.items()} == EXPECTED_TOKENS[step], (model, step)
        for name, row in rows.items():
            assert len(row["runs"]) == 1 and row["seconds"] == statistics.median(row["runs"]), (model, step, name)
            assert row["tokens_per_s"] == pytest.approx(row["tokens"] / row["seconds"], rel=1e-12)
            assert (f"| {row['tokens_per_s']:.0f} |" if row["tokens"] else "| - |") in markdown_row(out, model, name)
            for other, ratio in row["ratios"].items():  # a ratio divides by the named variant's own median
                assert ratio == pytest.approx(row["seconds"] / rows[other]["seconds"], rel=1e-12), (model, name)
        # every step is compared with the same step without the head
        assert any(row["ratios"] for row in entry["rows"]), (model, step)
        for (costly_step, costly), cheaper in COSTLIER.items():
            if costly_step == step:
                assert rows[costly]["ratios"][cheaper] > 1.0, (model, step, costly, rows[costly]["ratios"])
    assert result["tiny"] and "CPU smoke run" in result["title"]
    markdown = out.with_suffix(".md").read_text()
    assert markdown.startswith("# CPU smoke run")
    for name in SHAPES:
        assert name in markdown and name in result["models"]
