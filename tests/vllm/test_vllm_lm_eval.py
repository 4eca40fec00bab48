"""`ats lm-eval --model vllm --model_args pretrained=EXPORT` (lm-eval's own vllm model on an `ats export` folder)
prints the calibration table that `--model ats` prints for the same head on a multiple-choice task: same accuracy,
ECE, Brier and mean confidence within 1e-3. Both run as a user runs them, as commands."""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ats.integrations.vllm.export import export_for_vllm

from vllm_helpers import calibrators

sys.path.insert(0, str(Path(__file__).parents[1] / "integrations"))
from lmeval_helpers import TASK, toy_rows, write_task  # noqa: E402

ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0", "VLLM_CPU_OMP_THREADS_BIND": "0-1",
       "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
       "VLLM_LOGGING_LEVEL": "INFO"}  # the shutdown line read below is vLLM's INFO (`ats -q` in this process quiets it)


def lm_eval(model: str, model_args: str, tasks: Path, out: Path) -> dict:
    """`ats lm-eval` on TASK as a command; the calibration.json it wrote. For vLLM, the engine has shut down before
    the report is printed, not from vLLM's exit hook (where its output thread could abort the process at exit:
    `ats.integrations.vllm.shut_down_engines`)."""
    argv = [sys.executable, "-m", "ats", "lm-eval", "--model", model, "--model_args", model_args, "--tasks", TASK,
            "--include_path", str(tasks), "--device", "cpu", "--log_samples", "--output_path", str(out)]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=900, env={**os.environ, **ENV})
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert f"| {TASK} |" in proc.stdout  # the table is printed
    if model == "vllm":
        shut = proc.stdout.find("[shutdown] MPClient: complete")  # vLLM's log line (stdout)
        assert 0 <= shut < proc.stdout.find("| task | model |"), "engine not shut down before the report"
    (path,) = glob.glob(str(out / "*" / "calibration_*" / "calibration.json"))
    return json.loads(Path(path).read_text())["results"]


@pytest.mark.slow
def test_lm_eval_vllm_prints_the_calibration_of_the_ats_model(tiny_models, tmp_path):
    folder, backbone = tiny_models["llama"]
    head = calibrators(backbone, tmp_path, ["transformer"])["transformer"]
    export = export_for_vllm(str(folder), head, tmp_path / "export")
    tasks = write_task(tmp_path / "tasks", toy_rows())
    ours = lm_eval("ats", f"pretrained={folder},calibrator={head},dtype=float32", tasks, tmp_path / "ats")
    theirs = lm_eval("vllm", f"pretrained={export},dtype=float32,enforce_eager=True,max_model_len=512,"
                             "gpu_memory_utilization=0.3", tasks, tmp_path / "vllm")
    assert set(ours) == set(theirs) == {TASK, f"{TASK} (acc_norm)"}
    for task in ours:
        (a,) = ours[task].values()
        (b,) = theirs[task].values()
        assert a["n"] == b["n"] == 40 and a["accuracy"] == b["accuracy"]
        for metric in ("ece", "brier", "mean_confidence"):
            assert abs(a[metric] - b[metric]) <= 1e-3, (task, metric)
