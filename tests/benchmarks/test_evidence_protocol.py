"""The evidence protocol (benchmarks/protocols/evidence.py) end to end on the tiny model and the tiny data files:
`run_evidence` with `select_learning_rates`, `run_scaling`; and the heads it trains, named and configured as the
committed results record them."""

from __future__ import annotations

import json
from dataclasses import asdict

import pytest
from protocols.evidence import (
    SELECTED,
    TRADEOFF,
    EvidencePlan,
    ScalingPlan,
    head_job,
    plan_record,
    run_evidence,
    run_scaling,
)

from ats.errors import ATSError
from ats.evaluation.metrics import summarize
from ats.evaluation.report import jsonable
from ats.model.labels import IGNORE_INDEX
from ats.training.config import TrainingConfig
from ats.training.data import DataConfig
from ats.training.validation import heldout_objective
from ats.workflows.pipeline import prepare_features

from helpers import hand_token_metrics

DATA = DataConfig(limit=12, max_length=48, val_fraction=0.34)
TRAINING = TrainingConfig(lr=1e-3, epochs=1, batch_size=2, micro_batch_size=2)


def test_run_evidence_selects_the_lowest_heldout_objective(tiny_backbone, tmp_path):
    from ats.calibrators import load_calibrator

    plan = EvidencePlan(data=DATA, training=TRAINING, lr_grid=(1e-3, 3e-2), selected=("ats", "selective-temperature"),
                        tradeoff=("nll",), baselines=("temperature",), fit_tokens=None, tasks=("mmlu",),
                        task_limit={"mmlu": 1}, mmlu_subjects=["anatomy"], bootstrap=20)
    out = tmp_path / "evidence"
    result = run_evidence(tiny_backbone, out, plan, progress=False)
    assert json.loads((out / "evidence.json").read_text()) == result
    _, val = prepare_features(tiny_backbone, out / "features", DATA, progress=False)
    for name in ("ats", "selective-temperature"):
        rows = result["selection"][name]["grid"]
        assert [r["lr"] for r in rows] == [1e-3, 3e-2]
        assert result["selection"][name]["chosen_lr"] == min(rows, key=lambda r: r["objective"])["lr"]
        for row in rows:  # each recorded objective is the held-out objective of the saved head, recomputed here
            head = load_calibrator(out / "heads" / name / f"lr{row['lr']:g}", backbone=tiny_backbone)
            assert row["objective"] == pytest.approx(heldout_objective(head, val, tiny_backbone, TRAINING),
                                                     rel=1e-4)
    methods = {"uncalibrated", "ats", "selective-temperature", "nll", "temperature"}
    assert set(result["token_level"]) == methods and set(result["tasks"]["mmlu"]) == methods
    assert set(result["tasks"]["mmlu"]["temperature"]["paired"]) == {"ats"}  # ATS minus each other method
    assert all((out / name).stat().st_size > 0 for name in result["figures"])


def test_run_scaling_evaluates_every_size_in_one_pass(tiny_backbone, tmp_path):
    plan = ScalingPlan(sizes=(("alpaca_gpt4", 9), ("alpaca_cleaned", 12)), methods=("ats", "selective-temperature"),
                       lrs={"ats": 1e-3, "selective-temperature": 1e-2}, data=DataConfig(max_length=48),
                       training=TRAINING, tasks=("truthfulqa_mc1",), task_limit={"truthfulqa_mc1": 3}, bootstrap=20)
    out = tmp_path / "scaling"
    result = run_scaling(tiny_backbone, out, plan, progress=False)
    assert list(result["sizes"]) == ["alpaca_gpt4-9", "alpaca_cleaned-12"]
    names = ["uncalibrated"] + [f"{m}@{s}" for s in result["sizes"] for m in plan.methods]
    assert list(result["tasks"]["truthfulqa_mc1"]) == names
    assert set(result["tasks"]["truthfulqa_mc1"]["uncalibrated"]["paired"]) == {"ats@alpaca_gpt4-9",
                                                                              "ats@alpaca_cleaned-12"}
    stored = json.loads((out / "scaling.json").read_text())
    assert stored["tasks"] == result["tasks"] and stored["plan"]["lrs"] == plan.lrs
    for tag, size in result["sizes"].items():  # each size's own held-out tokens
        source, limit = tag.rsplit("-", 1)
        _, val = prepare_features(tiny_backbone, out / tag / "features", DataConfig(max_length=48, source=source,
                                                                                      limit=int(limit)),
                                  progress=False)
        assert size["val_response_tokens"] == sum(int((y != IGNORE_INDEX).sum()) for _, y in val.sequences())
        conf, correct = hand_token_metrics(val, tiny_backbone)
        assert size["token_level"]["uncalibrated"]["ece"] == pytest.approx(summarize(conf, correct)["ece"], rel=1e-4)


def test_the_heads_keep_the_names_folders_and_options_of_the_committed_runs():
    """A rerun of benchmarks/evidence.py reuses the heads of an earlier run only if each head's name, folder, method
    and training options are what they were (they enter its fingerprint and the results' keys)."""
    assert tuple(SELECTED) == EvidencePlan().selected == ("ats", "ats-top-label", "selective-temperature",
                                                          "selective-linear")
    assert EvidencePlan().tradeoff == ("selective-a0.1", "selective-a0.3", "selective-a0.7", "selective-a0.9", "nll")
    base = TrainingConfig(alpha=0.9)
    top = head_job(SELECTED, "ats-top-label", "heads/ats-top-label/lr0.001", base, lr=1e-3)
    assert (top.method, top.label, top.head_type, top.folder) == ("ats", "ats-top-label", None,
                                                                  "heads/ats-top-label/lr0.001")
    assert top.training == TrainingConfig(alpha=0.9, loss_type="top-label", lr=1e-3)
    control = head_job(SELECTED, "selective-linear", "x", base)
    assert (control.method, control.training) == ("selective-linear", base)
    assert head_job(TRADEOFF, "selective-a0.3", "x", base).training == TrainingConfig(alpha=0.3)
    assert head_job(TRADEOFF, "nll", "x", base, lr=0.01).training == TrainingConfig(alpha=0.9, loss_type="none",
                                                                                    lr=0.01)
    with pytest.raises(ATSError, match=r"unknown head 'nl'; known: selective-a0.1, .*nll"):
        head_job(TRADEOFF, "nl", "x", base)


def test_plan_record_is_the_old_hand_serialised_form():
    for plan in (EvidencePlan(), ScalingPlan(lrs={"ats": 1e-3})):
        old = {**asdict(plan), "data": plan.data.to_dict(), "training": plan.training.to_dict()}
        assert plan_record(plan) == jsonable(old)
    assert plan_record(EvidencePlan())["lr_grid"] == [3e-4, 1e-3, 3e-3]
