"""evaluate(): per-example task files, results.json / results.md / figures, and reuse of finished tasks."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from ats.calibrators.base import Uncalibrated
from ats.errors import ATSError
from ats.evaluation.evaluate import evaluate, format_paired
from ats.evaluation.metrics import summarize
from ats.evaluation.report import format_table
from ats.evaluation.selective import selective_metrics
from ats.evaluation.tasks import MMLUTask, build_task

from helpers import HalfTemperature


class Counting:
    """A real task, counting how often it actually runs."""

    def __init__(self, task):
        self.task = task
        self.name = task.name
        self.runs = 0

    def describe(self):
        return self.task.describe()

    def run(self, backbone, calibrators, *, progress=True):
        self.runs += 1
        return self.task.run(backbone, calibrators, progress=progress)


@pytest.fixture
def quiz(tmp_path):
    rows = [{"question": "Which is a colour?", "choices": ["red", "seven", "dog"], "answer": 0},
            {"question": "Pick the largest number.", "choices": ["1", "10", "100"], "answer": 2},
            {"question": "Is water wet?", "choices": ["yes", "no"], "answer": 0}]
    path = tmp_path / "my quiz.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_evaluate_writes_everything_and_reuses_finished_tasks(tiny_backbone, tmp_path, quiz):
    out = tmp_path / "eval"
    calibrators = {"uncalibrated": Uncalibrated(), "half": HalfTemperature()}
    mmlu = Counting(MMLUTask(limit=1, subjects=["anatomy", "astronomy"], n_shots=1))
    mc = Counting(build_task(f"mc:{quiz}"))
    results = evaluate(tiny_backbone, calibrators, [mmlu, mc], out, n_bins=5, progress=False)

    assert list(results) == ["mmlu", "mc_my_quiz"] and mmlu.runs == 1 and mc.runs == 1
    assert json.loads((out / "results.json").read_text()) == results
    for task in results:
        assert list(results[task]) == ["uncalibrated", "half"]
        for stem in ("png", "pdf"):
            assert (out / "figures" / f"{task}.{stem}").stat().st_size > 0
            assert (out / "figures" / f"{task}_risk_coverage.{stem}").stat().st_size > 0
    stored = json.loads((out / "tasks" / "mmlu.json").read_text())
    assert stored["task"]["subjects"] == ["anatomy", "astronomy"]
    conf = np.array(stored["methods"]["half"]["confidence"])
    correct = np.array(stored["methods"]["half"]["correct"])
    assert conf.shape == (2,) and correct.dtype == bool
    expected = summarize(conf, correct, n_bins=5)
    assert results["mmlu"]["half"]["ece"] == pytest.approx(expected["ece"])
    assert results["mmlu"]["half"]["n"] == 2 and results["mc_my_quiz"]["uncalibrated"]["n"] == 3
    assert stored["methods"]["half"]["correct"] == stored["methods"]["uncalibrated"]["correct"]
    md = (out / "results.md").read_text()
    assert md.startswith(format_table(results) + "\n\nAnswer or abstain")
    # the answer-or-abstain table holds the risk-coverage metrics of the stored per-example results
    selective = [f"{v:.3f}" if math.isfinite(v) else "-" for v in selective_metrics(conf, correct).values()]
    assert "| method | AURC | excess AURC | PRR | error AUPRC |" in md and f"| half | {' | '.join(selective)} |" in md
    assert md.startswith("### MMLU (n = 2)\n\n| method | Acc | ECE | Brier |\n|---|---:|---:|---:|\n| uncalibrated | ")
    assert "\n\n### mc_my_quiz (n = 3)\n\n| method | Acc | ECE | Brier |\n" in md

    # a second call with the same out_dir reuses both finished task files
    mtimes = {p.name: p.stat().st_mtime_ns for p in (out / "tasks").iterdir()}
    again = evaluate(tiny_backbone, calibrators, [mmlu, mc], out, n_bins=5, progress=False)
    assert mmlu.runs == 1 and mc.runs == 1 and again == results
    assert mtimes == {p.name: p.stat().st_mtime_ns for p in (out / "tasks").iterdir()}

    # a subset of the methods is served from the file; a new method re-runs the task
    subset = evaluate(tiny_backbone, {"half": HalfTemperature()}, [mmlu], out, n_bins=5, progress=False)
    assert mmlu.runs == 1 and subset["mmlu"]["half"] == results["mmlu"]["half"]
    evaluate(tiny_backbone, {**calibrators, "other": Uncalibrated()}, [mmlu], out, n_bins=5, progress=False)
    assert mmlu.runs == 2

    # other task settings, or another calibrator under the same name, are refused by name; --overwrite re-runs
    mc2 = Counting(build_task(f"mc:{quiz}", limit=2))
    with pytest.raises(ATSError, match=r"mc_my_quiz.json: task results made with other options: task.limit None -> 2"):
        evaluate(tiny_backbone, calibrators, [mc2], out, n_bins=5, progress=False)
    assert mc2.runs == 0
    evaluate(tiny_backbone, calibrators, [mc2], out, n_bins=5, overwrite=True, progress=False)
    assert mc2.runs == 1
    swapped = {"uncalibrated": Uncalibrated(), "half": Uncalibrated()}
    with pytest.raises(ATSError, match=r"mmlu.json: task results of method 'half' made with other options: "
                                       r"calibrator_digest"):
        evaluate(tiny_backbone, swapped, [mmlu], out, n_bins=5, progress=False)
    assert mmlu.runs == 2
    redone = evaluate(tiny_backbone, swapped, [mmlu], out, n_bins=5, overwrite=True, progress=False)
    assert mmlu.runs == 3 and redone["mmlu"]["half"] == redone["mmlu"]["uncalibrated"]


def test_evaluate_string_specs_bootstrap_and_errors(tiny_backbone, tmp_path, quiz):
    out = tmp_path / "eval"
    results = evaluate(tiny_backbone, {"none": Uncalibrated()}, [f"mc:{quiz}:likelihood"], out, bootstrap=20,
                       progress=False)
    assert (out / "tasks" / "mc_my_quiz_likelihood.json").is_file()
    summary = results["mc_my_quiz_likelihood"]["none"]
    stored = json.loads((out / "tasks" / "mc_my_quiz_likelihood.json").read_text())["methods"]["none"]
    again = summarize(np.array(stored["confidence"]), np.array(stored["correct"]), bootstrap=20, seed=0)
    assert summary["ece_ci"] == pytest.approx(list(again["ece_ci"])) and summary["ece"] == pytest.approx(again["ece"])
    lo, hi = again["ece_ci"]
    assert f"| none | {again['accuracy']:.3f} [" in format_table(results)
    assert f" | {again['ece']:.3f} [{lo:.3f}, {hi:.3f}] | " in format_table(results)  # the interval beside the value
    with pytest.raises(ATSError, match="unknown task"):
        evaluate(tiny_backbone, {"none": Uncalibrated()}, ["nope"], out, progress=False)
    with pytest.raises(ATSError, match="more than once"):
        evaluate(tiny_backbone, {"none": Uncalibrated()}, [f"mc:{quiz}", f"mc:{quiz}:letters"], out, progress=False)


def test_format_table_has_one_block_per_task():
    results = {"mmlu": {"none": {"accuracy": 0.5, "ece": 0.12345, "brier": 0.25, "n": 4},
                        "ats": {"accuracy": 0.5, "ece": 0.0456, "brier": 0.2, "n": 4}},
               "triviaqa": {"none": {"accuracy": 1 / 3, "ece": None, "brier": 0.1, "ece_ci": [0.1, 0.2]}}}
    assert format_table(results) == (
        "### MMLU (n = 4)\n\n"
        "| method | Acc | ECE | Brier |\n"
        "|---|---:|---:|---:|\n"
        "| none | 0.500 | 0.123 | 0.250 |\n"
        "| ats | 0.500 | 0.046 | 0.200 |\n\n"
        "### TriviaQA\n\n"
        "| method | Acc | ECE | Brier |\n"
        "|---|---:|---:|---:|\n"
        "| none | 0.333 | - | 0.100 |")


def _pair(diff, lo, hi):
    return {"diff": diff, "ci": [lo, hi], "excludes_zero": lo > 0 or hi < 0}


def test_paired_table_shows_each_method_once_per_task():
    """Two references (ats and selective-temperature) and two baselines: each task has one block, each method one row
    with a column per reference and metric; a reference's own columns read "-"."""
    def metrics(pairs):
        return {"ece": 0.1, "n": 5, "paired": {ref: {"ece": _pair(*d)} for ref, d in pairs.items()}}

    by_method = {
        "uncalibrated": metrics({"ats": (-0.1, -0.2, -0.05), "selective-temperature": (-0.08, -0.1, 0.02)}),
        "ats": metrics({"selective-temperature": (0.02, -0.01, 0.05)}),
        "selective-temperature": metrics({"ats": (-0.02, -0.05, 0.01)}),
        "temperature": metrics({"ats": (0.03, 0.01, 0.04), "selective-temperature": (0.05, 0.0, 0.1)}),
        "isotonic": metrics({"ats": (0.0, -0.1, 0.1), "selective-temperature": (0.02, -0.1, 0.1)}),
    }
    text = format_paired({"mmlu": by_method, "triviaqa": by_method}, keys=(("ECE", "ece"),))
    block = ("| method | ECE (ats - method) | ECE (selective-temperature - method) |\n"
             "|---|---:|---:|\n"
             "| uncalibrated | -0.100 [-0.200, -0.050] * | -0.080 [-0.100, 0.020] |\n"
             "| ats | - | 0.020 [-0.010, 0.050] |\n"
             "| selective-temperature | -0.020 [-0.050, 0.010] | - |\n"
             "| temperature | 0.030 [0.010, 0.040] * | 0.050 [0.000, 0.100] |\n"
             "| isotonic | 0.000 [-0.100, 0.100] | 0.020 [-0.100, 0.100] |")
    assert text == ("Paired differences, reference minus each method (95% paired bootstrap; * = interval excludes 0):"
                    f"\n\n### MMLU (n = 5)\n\n{block}\n\n### TriviaQA (n = 5)\n\n{block}")
    assert format_paired({"mmlu": {"none": {"ece": 0.1}}}) == ""
