"""The analysis of benchmarks/start_coverage.py on hand-made answers: a start past a wrong top is chosen, a perfect
ranking keeps the start at 0 (every start up to the certified coverage gives the same threshold: a tie, the smallest
wins), the score is the held-out coverage redone by hand, and the test compares the two starts on the same answers."""

from __future__ import annotations

import numpy as np
import pytest
from start_coverage import GRID, TARGETS, analyse, paired_bootstrap, select

from ats.evaluation.threshold import certify_threshold


def _rows(conf: np.ndarray, correct: np.ndarray) -> list[dict]:
    """Answer rows with Thermometer's confidence `conf` and the raw one its square (the same order)."""
    return [{"task": "nq_open", "index": i, "confidence": float(c), "uncalibrated": float(c) ** 2,
             "correct": bool(k)} for i, (c, k) in enumerate(zip(conf, correct))]


def _wrong_top(n: int = 400, wrong: int = 6, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Right answers ranked above wrong ones, except that the `wrong` most confident answers are all wrong."""
    rng = np.random.default_rng(seed)
    conf = np.sort(rng.uniform(0.01, 0.99, n))[::-1].copy()  # descending
    correct = np.arange(n) < n // 2
    correct[:wrong] = False
    return conf, correct


def test_a_wrong_top_chooses_a_start_past_it_and_the_test_sees_the_gain():
    conf, correct = _wrong_top(wrong=3)
    assert certify_threshold(conf, correct, target_risk=0.2, delta=0.1, start_coverage=0.0).threshold is None
    assert certify_threshold(conf, correct, target_risk=0.2, delta=0.1, start_coverage=0.1).threshold is not None
    result = analyse(_rows(conf, correct), _rows(conf, correct), halvings=20, resamples=100)
    chosen = result["selection"]["chosen"]
    scores = {float(k): v["thermometer"]["score"] for k, v in result["selection"]["scores"].items()}
    assert chosen > 0 and scores[chosen] == max(scores.values()) and scores[chosen] > scores[0.0]
    gain = result["test"]["thermometer"]["targets"]["0.2"]
    assert gain["all"]["0.0"]["coverage"] == 0.0 and gain["all"][str(chosen)]["coverage"] > 0.0
    assert gain["paired"]["diff"] == gain["all"][str(chosen)]["coverage"]
    assert gain["paired"]["ci"][0] <= gain["paired"]["diff"] <= gain["paired"]["ci"][1]
    assert gain["paired"]["above"] > 0.5 and gain["paired"]["above"] + gain["paired"]["below"] <= 1.0
    for target, v in result["test"]["uncalibrated"]["targets"].items():  # the raw confidence keeps the order:
        same = result["test"]["thermometer"]["targets"][target]  # the same decisions, at other thresholds
        assert {s: {k: x for k, x in d.items() if k != "threshold"} for s, d in v["all"].items()} == \
            {s: {k: x for k, x in d.items() if k != "threshold"} for s, d in same["all"].items()}
        assert (v["paired"], v["halvings"]) == (same["paired"], same["halvings"])


def test_a_perfect_ranking_is_a_tie_and_keeps_the_start_at_zero():
    conf = np.linspace(0.99, 0.01, 300)
    correct = np.arange(300) < 240  # every right answer above every wrong one
    result = analyse(_rows(conf, correct), _rows(conf, correct), halvings=20, resamples=100)
    scores = result["selection"]["scores"]
    assert result["selection"]["chosen"] == 0.0 and result["test"] == {}
    assert scores["0.01"]["thermometer"]["score"] == scores["0.0"]["thermometer"]["score"]


def test_the_score_is_the_held_out_coverage_averaged_over_halvings_and_targets():
    conf, correct = _wrong_top(n=200, wrong=3, seed=1)
    got = select({"uncalibrated": conf ** 2, "thermometer": conf}, correct, halvings=4)
    start = GRID[3]
    by_hand = []
    for target in TARGETS:
        rng = np.random.default_rng(0)  # the seeded splits, redone by hand: the same for every target
        for _ in range(4):
            order = rng.permutation(correct.size)
            a, b = order[:100], order[100:]
            t = certify_threshold(conf[a], correct[a], target_risk=target, delta=0.1, start_coverage=start)
            by_hand.append(float(t.answers(conf[b]).mean()))
    assert got["scores"][str(start)]["thermometer"]["score"] == pytest.approx(np.mean(by_hand), abs=1e-12)


def test_the_paired_bootstrap_of_a_start_against_itself_is_zero():
    conf, correct = _wrong_top(n=120, wrong=2)
    same = paired_bootstrap(conf, correct, 0.3, 0.0, resamples=50)
    assert same == {"diff": 0.0, "ci": [0.0, 0.0], "above": 0.0, "below": 0.0}


def _strong_top(n: int = 400, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """A model whose 15% most confident answers are all right and the rest right half the time: only the top meets
    a target risk of 0.1, so a start at 0.3 certifies nothing there and an earlier one does."""
    rng = np.random.default_rng(seed)
    conf = np.linspace(0.99, 0.01, n)
    correct = np.where(np.arange(n) < int(0.15 * n), True, rng.random(n) < 0.5)
    return conf, correct


def test_choosing_per_target_picks_an_earlier_start_where_only_the_top_meets_the_target():
    select_conf, select_correct = _strong_top(seed=1)
    conf, correct = _strong_top(seed=2)
    assert certify_threshold(conf, correct, target_risk=0.1, delta=0.1, start_coverage=0.3).threshold is None
    result = analyse(_rows(select_conf, select_correct), _rows(conf, correct), halvings=20, resamples=100)
    at = result["choose"]["thermometer"]["targets"]["0.1"]
    assert at["start"] < 0.15 and at["default"] == 0.0  # chosen on the selection answers alone
    by_hand = certify_threshold(conf, correct, target_risk=0.1, delta=0.1, start_coverage=at["start"])
    assert at["coverage"] == by_hand.coverage > 0.05 and at["paired"]["diff"] == at["coverage"]
    assert at["paired"]["below"] == 0.0  # the default never certifies more here
    ties = result["choose"]["thermometer"]["targets"]["0.9"]  # everything certifies from any start: the default
    assert ties["start"] == 0.3 and ties["coverage"] == ties["default"] == 1.0
