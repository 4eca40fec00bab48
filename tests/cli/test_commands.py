"""The success paths of `ats eval`, `ats ablate` and `ats demo` as a user runs them, on the tiny model saved as a
model folder and the tiny data files (conftest): exit status 0, the printed tables are the saved numbers, one block
per task, and the paired differences name each method once per task."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from ats.cli import main
from ats.evaluation.report import TASK_LABELS

from helpers import calibrator_for, make_tiny_backbone

TINY_DATA = ["--limit", "12", "--max-length", "48", "--epochs", "1", "--batch-size", "2", "--micro-batch-size", "2"]


@pytest.fixture(scope="module")
def model_dir(tokenizer, tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("cli") / "tiny-model"
    backbone = make_tiny_backbone(tokenizer)
    backbone.model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def head_dir(model_dir, tmp_path_factory) -> Path:
    from ats.model.backbone import load_backbone

    folder = tmp_path_factory.mktemp("cli") / "head"
    calibrator_for(load_backbone(str(model_dir)), "linear").save_pretrained(folder)
    return folder


def blocks(text: str) -> dict[str, list[list[str]]]:
    """'### <task> ...' heading -> the rows (cells) of the table under it."""
    out, current = {}, None
    for line in text.splitlines():
        if line.startswith("### "):
            current = out.setdefault(line[4:].split(" (n = ")[0], [])
        elif current is not None and line.startswith("| ") and not line.startswith("| method"):
            current.append([c.strip() for c in line.strip("|").split("|")])
    return out


def test_eval_prints_one_block_per_task_and_each_method_once(model_dir, head_dir, tmp_path, capsys):
    out = tmp_path / "eval"
    code = main(["-q", "eval", "--model", str(model_dir), "--calibrator", "none", "--calibrator", str(head_dir),
                 "--calibrator", "selective-temperature,temperature,isotonic", "--tasks", "mmlu,truthfulqa_mc1",
                 "--task-limit", "1", "--bootstrap", "20", *TINY_DATA, "--out", str(out)])
    printed = capsys.readouterr().out
    assert code == 0
    results = json.loads((out / "results.json").read_text())
    methods = ["uncalibrated", "ats", "selective-temperature", "temperature", "isotonic"]
    assert sorted(results) == ["mmlu", "truthfulqa_mc1"] and all(sorted(r) == sorted(methods) for r in results.values())
    table, rest = printed.split("Answer or abstain")
    selective, paired = rest.split("Paired differences")
    for task, rows in blocks(table).items():  # the printed cells are the saved numbers
        name = {TASK_LABELS[t]: t for t in results}[task]
        assert [r[0] for r in rows] == methods  # each once, in the order given
        for row in rows:
            saved = results[name][row[0]]
            assert row[1].split(" [")[0] == f"{saved['accuracy']:.3f}" and row[2].startswith(f"{saved['ece']:.3f}")
    assert list(blocks(selective)) == ["MMLU", "TruthfulQA MC1"]
    for task, rows in blocks(selective).items():  # AURC, excess AURC, PRR, error AUPRC: the saved numbers too
        name = {TASK_LABELS[t]: t for t in results}[task]
        assert [r[0] for r in rows] == methods
        for row in rows:
            assert row[1].startswith(f"{results[name][row[0]]['aurc']:.3f}")
    assert list(blocks(paired)) == ["MMLU", "TruthfulQA MC1"]
    for task, rows in blocks(paired).items():  # the reference is ATS (the head's label); every other method once
        assert [r[0] for r in rows] == ["uncalibrated", "selective-temperature", "temperature", "isotonic"]
        name = {TASK_LABELS[t]: t for t in results}[task]
        for row in rows:
            d = results[name][row[0]]["paired"]["ats"]["ece"]
            assert row[1].startswith(f"{d['diff']:.3f} [{d['ci'][0]:.3f}, {d['ci'][1]:.3f}]")
    # accuracy is untouched by every calibrator
    assert len({results["mmlu"][m]["accuracy"] for m in methods}) == 1
    assert (out / "results.md").read_text().strip() == printed.split("\n\nresults:")[0].strip()


def test_ablate_prints_every_table_and_saves_the_numbers(model_dir, tmp_path, capsys):
    quiz = tmp_path / "quiz.jsonl"
    quiz.write_text("".join(json.dumps({"question": q, "choices": c, "answer": a}) + "\n" for q, c, a in [
        ("Which is a colour?", ["red", "seven"], 0), ("Pick the largest number.", ["1", "100"], 1)]))
    out = tmp_path / "ablate"
    code = main(["-q", "ablate", "--model", str(model_dir), "--ablations", "smoothing",
                 "--tasks", f"mc:{quiz}", *TINY_DATA, "--out", str(out)])
    printed = capsys.readouterr().out
    assert code == 0 and "## smoothing" in printed and f"all numbers: {out / 'ablations.json'}" in printed
    saved = json.loads((out / "ablations.json").read_text())
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in printed.splitlines()
            if re.match(r"\| (none|full|selective) ", line)]
    assert sorted(r[0] for r in rows) == ["full", "none", "selective"]
    assert json.dumps(saved)  # the numbers behind the table
    heads = sorted(p.name for p in (out / "heads").iterdir() if (p / "calibrator_config.json").is_file())
    assert len(heads) == 3 and [h.split("-")[1] for h in heads] == ["full", "none", "selective"]  # one per type


@pytest.mark.slow  # no embedded model, but the tiny demo fits every baseline and control on 60 examples: minutes
def test_demo_tiny_runs_end_to_end(model_dir, tmp_path, capsys):
    out = tmp_path / "demo"
    code = main(["-q", "demo", "--size", "tiny", "--model", str(model_dir), "--out", str(out)])
    printed = capsys.readouterr().out
    assert code == 0
    results = json.loads((out / "eval" / "results.json").read_text())
    assert list(results) == ["mmlu", "triviaqa", "truthfulqa_mc1"] and "ats" in results["mmlu"]
    assert printed.startswith("Token-level calibration on the held-out split:\n| method |")
    assert list(blocks(printed.split("Task-level calibration")[1].split("Paired differences")[0])) == [
        "MMLU", "TriviaQA", "TruthfulQA MC1"]
    assert (out / "eval" / "figures" / "mmlu.png").stat().st_size > 0


def test_eval_refuses_a_reference_that_is_no_method_before_evaluating(model_dir, tmp_path, capsys):
    out = tmp_path / "eval"
    code = main(["-q", "eval", "--model", str(model_dir), "--calibrator", "none,temperature", "--tasks", "mmlu",
                 "--task-limit", "1", "--reference", "temperature", "--reference", "platt", *TINY_DATA,
                 "--out", str(out)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and err == ["ats: error: --reference 'platt': not a method of this evaluation "
                                 "(uncalibrated, temperature)"], err
    assert not out.exists()
