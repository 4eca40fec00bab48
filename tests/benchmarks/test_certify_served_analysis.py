"""The analysis of benchmarks/certify_served.py on hand-made answers: a certificate depends only on the order of the
confidences, so a calibrator that keeps the raw order must get the same decisions (coverage difference 0 on every
halving, the same coverage and risk on all), and the halvings compare both methods on the same split."""

from __future__ import annotations

import numpy as np
import pytest
from certify_served import HALVINGS, analyse, halvings

from ats.evaluation.threshold import certify_threshold


def _answers(calibrated, n: int = 240, seed: int = 0) -> dict:
    """`n` answers, right more often when the raw confidence is high; Thermometer's confidence = calibrated(raw)."""
    rng = np.random.default_rng(seed)
    raw = rng.uniform(0.05, 0.95, n)
    correct = rng.random(n) < raw ** 2
    return {"rows": [{"task": ("nq_open", "triviaqa_pool")[i % 2], "index": i, "uncalibrated": float(raw[i]),
                      "confidence": float(calibrated(raw[i])), "correct": bool(correct[i]), "finish": "eos",
                      "text": ""} for i in range(n)]}


def test_a_calibrator_that_keeps_the_order_certifies_the_same_decisions():
    result = analyse(_answers(np.sqrt))  # strictly increasing: the same order, other numbers
    for target in result["targets"].values():
        for key in ("", "_started"):  # as `ats certify` does, and the sequence started at a fixed coverage
            full = target[f"all{key}"]
            assert full["thermometer"]["coverage"] == full["uncalibrated"]["coverage"]
            assert full["thermometer"]["risk"] == full["uncalibrated"]["risk"]
            assert target[f"halvings{key}"]["coverage_diff"] == {"mean": 0.0, "range": [0.0, 0.0]}
            assert target[f"halvings{key}"]["thermometer"] == target[f"halvings{key}"]["uncalibrated"]
    assert result["paired"]["auroc"]["diff"] == pytest.approx(0.0, abs=1e-12)
    assert result["paired"]["prr"]["diff"] == pytest.approx(0.0, abs=1e-12)
    assert result["smallest_risk"]["thermometer"] == result["smallest_risk"]["uncalibrated"]
    assert result["smallest_risk_started"]["thermometer"] == result["smallest_risk_started"]["uncalibrated"]
    assert result["n"] == 240 and set(result["per_task"]) == {"nq_open", "triviaqa_pool"}


def test_halvings_certify_on_one_half_and_measure_on_the_other_with_one_split_for_both():
    rows = _answers(lambda p: 1.0 - p)["rows"]  # the order reversed: a different method on the same questions
    correct = np.asarray([r["correct"] for r in rows])
    conf = {"uncalibrated": np.asarray([r["uncalibrated"] for r in rows]),
            "thermometer": np.asarray([r["confidence"] for r in rows])}
    got = halvings(conf, correct, 0.5)
    rng = np.random.default_rng(0)  # the same seeded splits, redone by hand
    coverage = {m: [] for m in conf}
    for _ in range(HALVINGS):
        order = rng.permutation(correct.size)
        a, b = order[: correct.size // 2], order[correct.size // 2:]
        for m, c in conf.items():
            threshold = certify_threshold(c[a], correct[a], target_risk=0.5, delta=0.1, start_coverage=0.0)
            coverage[m].append(float(threshold.answers(c[b]).mean()))
    for m in conf:
        assert got[m]["mean_coverage"] == pytest.approx(np.mean(coverage[m]), abs=1e-12)
    diff = np.subtract(coverage["thermometer"], coverage["uncalibrated"])
    assert got["coverage_diff"]["mean"] == pytest.approx(diff.mean(), abs=1e-12)
    assert got["uncalibrated"]["mean_coverage"] > got["thermometer"]["mean_coverage"]  # the reversed order abstains
