"""The workflow behind `ats demo`, end to end on the tiny model and the tiny data files (conftest): `run_experiment`;
and the two helpers the workflows rest on, `heldout_objective` and `gathered_token_confidences`, against computations
done here."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from ats.calibrators.base import Uncalibrated
from ats.evaluation.metrics import summarize
from ats.evaluation.token_eval import gathered_token_confidences, token_confidences
from ats.model.labels import IGNORE_INDEX
from ats.training.config import TrainingConfig
from ats.training.data import DataConfig
from ats.training.distributed import SINGLE
from ats.training.validation import heldout_objective
from ats.workflows.pipeline import prepare_features

from helpers import calibrator_for, hand_token_metrics

DATA = DataConfig(limit=12, max_length=48, val_fraction=0.34)
TRAINING = TrainingConfig(lr=1e-3, epochs=1, batch_size=2, micro_batch_size=2)


@torch.no_grad()
def test_heldout_objective_is_the_mean_nll_of_the_calibrated_logits(tiny_backbone, tmp_path):
    _, val = prepare_features(tiny_backbone, tmp_path / "f", DATA, progress=False)
    head = calibrator_for(tiny_backbone, "linear")
    objective = heldout_objective(head, val, tiny_backbone, TRAINING.replace(loss_type="none"))
    nll, n = 0.0, 0
    for hidden, labels in val.sequences():
        keep = labels != IGNORE_INDEX
        h = hidden.double()
        s = torch.exp(head.log_scale(hidden.float()[None])[0].double()).clamp(max=10.0)  # (T,)
        q = (h @ tiny_backbone.output_weight.double().T) * s[:, None]
        nll -= torch.log_softmax(q, -1)[keep].gather(1, labels[keep][:, None]).sum().item()
        n += int(keep.sum())
    assert n > 20 and objective == pytest.approx(nll / n, rel=1e-4)


def test_gathered_token_confidences_of_one_process_are_the_hand_computed_ones(tiny_backbone, tmp_path):
    _, val = prepare_features(tiny_backbone, tmp_path / "f", DATA, progress=False)
    head = calibrator_for(tiny_backbone, "linear")
    cals = {"none": Uncalibrated(), "head": head}
    got = gathered_token_confidences(val, tiny_backbone, cals, SINGLE, progress=False)
    assert set(got) == {"none", "head"}
    for name, calibrator in (("none", None), ("head", head)):
        conf, correct = hand_token_metrics(val, tiny_backbone, calibrator)
        np.testing.assert_allclose(got[name][0], conf, rtol=1e-4)
        np.testing.assert_array_equal(got[name][1], correct)
    plain = token_confidences(val, tiny_backbone, cals, progress=False)
    np.testing.assert_array_equal(plain["head"][0], got["head"][0])


@pytest.mark.slow  # a whole experiment, run twice (about 13 s)
def test_run_experiment_end_to_end_then_reused(tiny_backbone, tmp_path):
    from ats.workflows.experiment import ExperimentSize, run_experiment

    size = ExperimentSize(limit=12, max_length=48, epochs=1, mmlu_per_subject=1, mmlu_subjects=["anatomy", "astronomy"],
                          triviaqa=2, truthfulqa=2, baselines=("temperature", "isotonic"),
                          controls=("selective-temperature",))
    out = tmp_path / "run"
    result = run_experiment(tiny_backbone, out, size, head_type="linear", progress=False, bootstrap=10)
    methods = ["uncalibrated", "selective-temperature", "temperature", "isotonic", "ats"]
    assert list(result.token_level) == methods
    assert list(result.tasks) == ["mmlu", "triviaqa", "truthfulqa_mc1"]
    assert all(list(by_method) == methods for by_method in result.tasks.values())
    assert result.tasks["mmlu"]["uncalibrated"]["n"] == 2 and result.tasks["triviaqa"]["ats"]["n"] == 2
    assert json.loads((out / "eval" / "results.json").read_text()) == result.tasks
    # the token-level numbers, recomputed here from the held-out features
    _, val = prepare_features(tiny_backbone, out / "features", DataConfig(limit=12, max_length=48), progress=False)
    conf, correct = hand_token_metrics(val, tiny_backbone)
    expected = summarize(conf, correct)
    assert result.token_level["uncalibrated"]["ece"] == pytest.approx(expected["ece"], rel=1e-4)
    assert all(m["accuracy"] == pytest.approx(expected["accuracy"]) for m in result.token_level.values())
    # a rerun reuses every step: the same numbers, no file rewritten
    files = {p: p.stat().st_mtime_ns for p in out.rglob("*") if p.is_file()}
    again = run_experiment(tiny_backbone, out, size, head_type="linear", progress=False, bootstrap=10)
    assert again.tasks == result.tasks and again.token_level == result.token_level
    assert {p: p.stat().st_mtime_ns for p in files if p.name != "results.md" and p.suffix not in (".png", ".pdf")
            and p.name != "results.json"} == {p: t for p, t in files.items() if p.name != "results.md"
                                               and p.suffix not in (".png", ".pdf") and p.name != "results.json"}
