"""The prepared GPU check (benchmarks/gpu_check.py) runs end to end in its CPU smoke mode, as the GPU machine would run
it: from the source tree (PYTHONPATH=src), offline, with `datasets`, `fastapi` and `uvicorn` absent."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ABSENT = ("datasets", "fastapi", "uvicorn")  # not installed on the GPU machine
SHAPES = ("llama-2-7b-shape", "qwen2.5-7b-shape")
STEPS = ("build", "extraction", "training_cached", "training_online", "scoring", "decoding")

RUN = """
import runpy, sys
for name in {absent!r}:
    sys.modules[name] = None  # `import name` now fails, as where the package is not installed
sys.argv = ["benchmarks/gpu_check.py", "--tiny", "--device", "cpu", "--out", {out!r}]
runpy.run_path("benchmarks/gpu_check.py", run_name="__main__")
"""


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
        for row in entry["rows"]:
            assert row["seconds"] > 0, (model, step, row["variant"])
    # every step but the build is compared with the same step without the head
    for (model, step), entry in steps.items():
        if step != "build":
            assert any(row["ratios"] for row in entry["rows"]), (model, step)
    assert result["tiny"] and "CPU smoke run" in result["title"]
    markdown = out.with_suffix(".md").read_text()
    assert markdown.startswith("# CPU smoke run")
    for name in SHAPES:
        assert name in markdown and name in result["models"]
