"""Calibration reports of real lm-eval `--log_samples` files: the ECE is ats.evaluation's on the softmax over the
choices' log-likelihoods, and netcal's and torchmetrics' to 1e-6; acc / acc_norm are lm-eval's own; two files of
one task are compared question by question; malformed files give one line naming the file and line."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from netcal.metrics import ECE
from sklearn.metrics import average_precision_score
from torchmetrics.functional.classification import binary_auroc, multiclass_calibration_error

from ats.cli.main import main
from ats.evaluation import metrics
from ats.evaluation.selective import selective_metrics
from ats.integrations.calibration_report import calibration_report
from ats.integrations.lm_eval_samples import parse_sample, read_samples

from lmeval_helpers import TASK, loglikelihoods, read_lines


def independent(path, norm: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """(probabilities (N, C), gold (N,)) from the raw lines: gold from the document itself, not from `target`."""
    rows = read_lines(path)
    scores = np.array([loglikelihoods(r) for r in rows])
    if norm:
        scores = scores / np.array([[len(c) for c in r["doc"]["choices"]] for r in rows])
    probs = torch.softmax(torch.tensor(scores, dtype=torch.float64), dim=1).numpy()
    return probs, np.array([r["doc"]["answer"] for r in rows])


def test_report_metrics_are_ats_netcal_and_torchmetrics_on_the_same_confidences(lm_eval_runs, tmp_path):
    path = lm_eval_runs["head"]
    samples = read_samples(path)
    assert (samples.task, len(samples.samples), samples.mismatches) == (TASK, 40, {})
    report = calibration_report([samples], tmp_path, bootstrap=200)
    row = report["results"][TASK][samples.label]
    probs, gold = independent(path)
    conf, correct = probs.max(axis=1), (probs.argmax(axis=1) == gold).astype(float)
    assert row["ece"] == pytest.approx(metrics.ece(conf, correct, n_bins=15), abs=1e-12)
    assert row["ece"] == pytest.approx(ECE(bins=15).measure(probs, gold), abs=1e-6)
    assert row["ece"] == pytest.approx(float(multiclass_calibration_error(
        torch.tensor(probs), torch.tensor(gold), num_classes=4, n_bins=15, norm="l1")), abs=1e-6)
    assert row["auroc"] == pytest.approx(float(binary_auroc(torch.tensor(conf), torch.tensor(correct).long())),
                                         abs=1e-6)
    assert row["adaptive_ece"] == pytest.approx(metrics.adaptive_ece(conf, correct), abs=1e-12)
    assert row["brier"] == pytest.approx(float(np.mean((conf - correct) ** 2)), abs=1e-12)
    assert row["ece_ci"][0] <= row["ece"] <= row["ece_ci"][1]
    # the answer-or-abstain metrics on the same confidences; error AUPRC is sklearn's average precision of the errors
    for key, value in selective_metrics(conf, correct).items():
        assert row[key] == pytest.approx(value, abs=1e-12) and row[f"{key}_ci"][0] <= row[key] <= row[f"{key}_ci"][1]
    assert row["error_auprc"] == pytest.approx(average_precision_score(1 - correct, 1 - conf), abs=1e-12)
    assert "| task | model | n | AURC | excess AURC | PRR | error AUPRC |" in (tmp_path / "calibration.md").read_text()
    # the accuracy is lm-eval's own, for acc and for acc_norm (per-character log-likelihoods)
    lm_eval = json.loads(next(path.parent.glob("results_*.json")).read_text())["results"][TASK]
    assert row["accuracy"] == pytest.approx(lm_eval["acc,none"], abs=1e-12)
    norm = report["results"][f"{TASK} (acc_norm)"][samples.label]
    probs_n, _ = independent(path, norm=True)
    assert norm["accuracy"] == pytest.approx(lm_eval["acc_norm,none"], abs=1e-12)
    assert norm["ece"] == pytest.approx(ECE(bins=15).measure(probs_n, gold), abs=1e-6)
    for name in ("calibration.json", "calibration.md", f"figures/{TASK}.png", f"figures/{TASK}_acc_norm.pdf",
                 f"figures/{TASK}_risk_coverage.png", f"figures/{TASK}_acc_norm_risk_coverage.pdf"):
        assert (tmp_path / name).stat().st_size > 0
    assert json.loads((tmp_path / "calibration.json").read_text())["files"][0]["lm_eval"]["acc"] == lm_eval["acc,none"]


def test_two_runs_of_a_task_are_compared_question_by_question(lm_eval_runs, tmp_path, capsys):
    head, none, hf = lm_eval_runs["head"], lm_eval_runs["none"], lm_eval_runs["hf"]
    assert main(["calibration-report", str(head), str(none), str(hf), "--out", str(tmp_path), "--bootstrap",
                 "100"]) == 0
    printed = capsys.readouterr().out
    report = json.loads((tmp_path / "calibration.json").read_text())
    labels = [f["label"] for f in report["files"]]
    assert labels[:2] == ["ats tiny-model0 calibrator=head", "ats tiny-model0 calibrator=none"]
    assert labels[2] == "hf tiny-model0" and "Paired differences" in printed and "AURC (" in printed
    eces = {}
    for label, path in zip(labels, (head, none, hf)):
        probs, gold = independent(path)
        eces[label] = metrics.ece(probs.max(axis=1), probs.argmax(axis=1) == gold)
    results = report["results"][TASK]
    pair = results[labels[1]]["paired"][labels[0]]["ece"]  # head minus none, on the same 40 questions
    assert pair["diff"] == pytest.approx(eces[labels[0]] - eces[labels[1]], abs=1e-12)
    assert pair["ci"][0] <= pair["diff"] <= pair["ci"][1]
    assert results[labels[2]]["ece"] == results[labels[1]]["ece"]  # hf and ats calibrator=none: the same numbers


def test_an_ambiguous_target_is_read_as_lm_eval_scored_it():
    row = {"doc_id": 0, "target": "0", "arguments": {"gen_args_0": {"arg_0": "Q:", "arg_1": " 1"},
                                                     "gen_args_1": {"arg_0": "Q:", "arg_1": " 0"}},
           "filtered_resps": [["-1.5", "False"], ["-2.5", "False"]]}
    assert parse_sample({**row, "acc": 1.0}, "f:1").gold == (0,)  # index 0: the prediction (choice 0) is right
    assert parse_sample({**row, "acc": 0.0}, "f:1").gold == (1,)  # the choice "0": choice 1
    sample = parse_sample({**row, "target": "[0, 1]"}, "f:1")
    assert sample.gold == (0, 1) and list(sample.lengths) == [1.0, 1.0]
    assert list(sample.scores("acc_norm")) == [-1.5, -2.5]


def _lines(path) -> list[str]:
    return path.read_text().splitlines()


def _write(path, lines) -> str:
    path.write_text("\n".join(lines) + "\n")
    return str(path)


@pytest.mark.parametrize("line, edit, message", [
    (3, lambda r: "{not json", "invalid JSON"),
    (2, lambda r: json.dumps({k: v for k, v in r.items() if k != "target"}), "missing field 'target'"),
    (1, lambda r: json.dumps({**r, "target": "7"}), "field 'target' 7 is not a choice index in 0-3"),
    (4, lambda r: json.dumps({**r, "filtered_resps": ["a generated answer"]}), "not a multiple-choice sample"),
    (2, lambda r: json.dumps({**r, "filtered_resps": [["nan", "False"]] * 4}), "log-likelihood is NaN"),
    (5, lambda r: json.dumps({**r, "doc_id": 0}), "doc_id 0 appears twice"),
])
def test_malformed_samples_files_give_one_line_with_file_and_line(lm_eval_runs, tmp_path, capsys, line, edit,
                                                                  message):
    lines = _lines(lm_eval_runs["none"])
    lines[line - 1] = edit(json.loads(lines[line - 1]))
    bad = _write(tmp_path / f"samples_{TASK}_2026-01-01T00-00-00.000000.jsonl", lines)
    assert main(["calibration-report", bad, "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"ats: error: {bad}:{line}: ") and message in err and "\n" not in err
    assert not (tmp_path / "out").exists()


def test_files_that_cannot_be_compared_or_read_are_refused(lm_eval_runs, tmp_path, capsys):
    lines = _lines(lm_eval_runs["head"])
    first = json.loads(lines[0])
    lines[0] = json.dumps({**first, "doc_hash": "another question"})
    other = _write(tmp_path / f"samples_{TASK}_2026-01-01T00-00-00.000000.jsonl", lines)
    assert main(["calibration-report", str(lm_eval_runs["none"]), other, "--out", str(tmp_path / "o")]) == 2
    assert "doc_id 0 is not the question of" in capsys.readouterr().err
    empty = _write(tmp_path / "samples_x_2026-01-01T00-00-00.000000.jsonl", [""])
    assert main(["calibration-report", empty]) == 2
    assert capsys.readouterr().err.strip() == f"ats: error: {empty}: empty samples file"
    (tmp_path / "nothing").mkdir()
    assert main(["calibration-report", str(tmp_path / "nothing")]) == 2
    assert "no lm-eval samples files" in capsys.readouterr().err
    assert main(["calibration-report", str(lm_eval_runs["none"]), "--label", "a", "--label", "b"]) == 2
    assert "2 label(s) for 1 file(s)" in capsys.readouterr().err
