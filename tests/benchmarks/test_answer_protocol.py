"""The answers protocol (benchmarks/protocols/answers.py) on the tiny model: leave-one-task-out splits, the baselines
fitted on the pool's answer confidences, and the whole protocol end to end (selection, leave one out, seeds,
reported tasks, the report), reused on a rerun and refused with another plan."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch
from protocols.answers import AnswerPlan, baselines_on_answers, leave_one_out_splits, run_answers
from protocols.answers_report import render

from ats.calibrators.base import Uncalibrated
from ats.errors import ATSError
from ats.evaluation.tasks import build_task
from ats.training.answers import score_answers

from helpers import fresh_ats, make_tiny_backbone, planted_answers


@pytest.fixture(scope="module")
def sharp(tokenizer):
    """A tiny random Llama that writes varied text with non-trivial confidences."""
    return make_tiny_backbone(tokenizer, tie_word_embeddings=False, output_scale=60.0)


def test_leave_one_out_never_trains_on_the_left_out_task():
    names = ["sciq", "boolq", "nq_open", "mmlu_validation"]
    splits = leave_one_out_splits(names, ("sciq", "boolq", "nq_open", "absent"))
    assert [out for out, _ in splits] == ["sciq", "boolq", "nq_open"]
    for out, train in splits:
        assert out not in train and sorted(train + [out]) == sorted(names)


def test_the_protocol_runs_end_to_end_and_refuses_another_plan(sharp, tmp_path):
    def mc(name, rows):
        path = tmp_path / f"{name}.jsonl"
        path.write_text("".join(json.dumps({"question": q, "choices": c, "answer": a}) + "\n" for q, c, a in rows))
        return build_task(f"mc:{path}:likelihood")

    rows = [(f"Pick {i}", ["yes", "no", "maybe"][: 2 + i % 2], i % 2) for i in range(10)]
    pool = {"alpha": mc("alpha", rows), "beta": mc("beta", rows[::-1]), "gamma": mc("gamma", rows[3:])}
    reported = {"delta": build_task(f"mc:{tmp_path / 'alpha.jsonl'}:letters")}
    plan = AnswerPlan(methods={"ats-answers": "linear", "control-answers": "constant",
                               "thermometer-answers": "thermometer"}, lr_grid=(1e-3, 1e-2),
                      epochs=1, batch_size=4, seeds=(0, 1), bootstrap=20, leave_one_out=("alpha", "beta"),
                      selection_tasks=("gamma",))
    results = run_answers(sharp, tmp_path / "run", plan, pool=pool, reported=reported, progress=False)
    assert set(results["selection"]) == {"ats-answers", "control-answers", "thermometer-answers"}
    for method, chosen in results["selection"].items():  # the chosen lr has the lowest held-out loss
        grid = chosen["grid"]
        assert chosen["lr"] == min(grid, key=lambda r: r["heldout_log_loss"])["lr"] and len(grid) == 2
    assert list(results["leave_one_out"]) == ["alpha", "beta"]
    assert results["leave_one_out"]["alpha"]["train"] == ["beta", "gamma"]
    delta = results["reported"]["delta"]
    assert len(delta["methods"]["ats-answers"]["seeds"]) == 2 and "minus_control" in delta["methods"]["ats-answers"]
    assert "minus_control" not in delta["methods"]["control-answers"]
    assert {"isotonic-answers", "histogram-answers", "scaling-binning-answers"} <= set(delta["methods"])
    assert len(delta["methods"]["thermometer-answers"]["seeds"]) == 2
    base = delta["methods"]["uncalibrated"]["seeds"][0]
    expected = build_task(f"mc:{tmp_path / 'alpha.jsonl'}:letters").run(sharp, {"u": Uncalibrated()}, progress=False)
    assert base["accuracy"] == pytest.approx(expected["u"].correct.mean())
    assert (tmp_path / "run" / "heads" / "ats-answers" / "seed1" / "model.safetensors").is_file()
    assert json.loads((tmp_path / "run" / "heads" / "thermometer-answers" / "seed1" / "calibrator_config.json")
                      .read_text())["type"] == "thermometer"
    md = render(tmp_path / "run" / "results.json", tmp_path / "committed").read_text()
    assert "### delta (10 questions)" in md and "alpha (left out)" in md and (tmp_path / "committed" / "figures"
                                                                             / "delta.png").is_file()
    # a rerun reuses every stage; another plan is refused
    again = run_answers(sharp, tmp_path / "run", plan, pool=pool, reported=reported, progress=False)
    assert again["selection"] == results["selection"]
    with pytest.raises(ATSError, match="another plan"):
        run_answers(sharp, tmp_path / "run", dataclasses.replace(plan, epochs=3), pool=pool, reported=reported,
                    progress=False)


def test_baselines_on_answers_by_hand():
    from ats.calibrators.binning import equal_mass_bins

    pool, other = planted_answers(300, 16, seed=0), planted_answers(50, 16, seed=2)
    control = fresh_ats("constant", 16)
    with torch.no_grad():
        control.head.tau.fill_(-0.7 / control.head.gain)  # s = exp(-0.7) everywhere
    maps = baselines_on_answers([pool], None, control, n_bins=4)
    base_conf, base_correct = score_answers(None, pool, None)
    # every planted answer has the same uncalibrated confidence: histogram binning and isotonic give the accuracy
    assert maps["histogram-answers"](other) == pytest.approx(np.full(50, base_correct.mean()))
    assert maps["isotonic-answers"](other) == pytest.approx(np.full(50, base_correct.mean()), abs=1e-9)
    scaled = score_answers(control, other, None)[0]
    assert not np.allclose(scaled, score_answers(None, other, None)[0])  # the control moved the confidence
    upper, values = equal_mass_bins(score_answers(control, pool, None)[0], score_answers(control, pool, None)[0], 4)
    assert maps["scaling-binning-answers"](other) == pytest.approx(values[np.searchsorted(upper, scaled)])
    assert set(baselines_on_answers([pool], None, None)) == {"isotonic-answers", "histogram-answers"}
