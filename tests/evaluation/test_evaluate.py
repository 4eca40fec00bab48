"""evaluate(): per-example task files, results.json / results.md / figures, and reuse of finished tasks."""

from __future__ import annotations

import json

import numpy as np
import pytest

from ats.calibrators.base import Uncalibrated
from ats.errors import ATSError
from ats.evaluation.evaluate import evaluate
from ats.evaluation.metrics import summarize
from ats.evaluation.report import format_table
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
    assert md.strip() == format_table(results)
    assert "| method | MMLU Acc | MMLU ECE | MMLU Brier | mc_my_quiz Acc |" in md

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
    assert len(summary["ece_ci"]) == 2 and summary["ece_ci"][0] <= summary["ece_ci"][1]
    assert "[" in format_table(results)  # confidence intervals shown
    with pytest.raises(ATSError, match="unknown task"):
        evaluate(tiny_backbone, {"none": Uncalibrated()}, ["nope"], out, progress=False)
    with pytest.raises(ATSError, match="more than once"):
        evaluate(tiny_backbone, {"none": Uncalibrated()}, [f"mc:{quiz}", f"mc:{quiz}:letters"], out, progress=False)


def test_format_table():
    results = {"mmlu": {"none": {"accuracy": 0.5, "ece": 0.12345, "brier": 0.25},
                        "ats": {"accuracy": 0.5, "ece": 0.0456, "brier": 0.2}},
               "triviaqa": {"none": {"accuracy": 1 / 3, "ece": None, "brier": 0.1}}}
    assert format_table(results) == (
        "| method | MMLU Acc | MMLU ECE | MMLU Brier | TriviaQA Acc | TriviaQA ECE | TriviaQA Brier |\n"
        "|---|---:|---:|---:|---:|---:|---:|\n"
        "| none | 0.500 | 0.123 | 0.250 | 0.333 | - | 0.100 |\n"
        "| ats | 0.500 | 0.046 | 0.200 | - | - | - |")
