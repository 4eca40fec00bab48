"""`start_choice`: the held-out coverage of a start redone by hand on the seeded halvings, a wrong top moves the
choice past it, and a tie keeps the preferred start (the default) or else the smallest."""

from __future__ import annotations

import numpy as np
import pytest

from ats.evaluation.start_choice import START_GRID, choose_start, halves, halving_coverage
from ats.evaluation.threshold import certify_threshold


def _wrong_top(n: int = 400, wrong: int = 3) -> tuple[np.ndarray, np.ndarray]:
    """Every right answer above every wrong one, except that the `wrong` most confident answers are wrong."""
    conf = np.linspace(0.99, 0.01, n)
    correct = np.arange(n) < n // 2
    correct[:wrong] = False
    return conf, correct


def test_the_halvings_are_seeded_disjoint_halves_and_the_coverage_is_the_other_halfs():
    splits = list(halves(11, 5))
    assert len(splits) == 5 and splits[0][0].tolist() != splits[1][0].tolist()
    for a, b in splits:
        assert len(a) == 5 and len(b) == 6 and sorted(a.tolist() + b.tolist()) == list(range(11))
    assert [(a.tolist(), b.tolist()) for a, b in halves(11, 5)] == [(a.tolist(), b.tolist()) for a, b in splits]
    conf, correct = _wrong_top(n=120, wrong=2)
    by_hand = []
    rng = np.random.default_rng(0)  # the seeded permutations, redone by hand
    for _ in range(6):
        order = rng.permutation(120)
        a, b = order[:60], order[60:]
        t = certify_threshold(conf[a], correct[a], target_risk=0.4, delta=0.1, start_coverage=0.1)
        by_hand.append(np.mean(conf[b] >= t.threshold) if t.threshold is not None else 0.0)
    got = halving_coverage(conf, correct, target_risk=0.4, delta=0.1, start_coverage=0.1, halvings=6)
    assert got.shape == (6,) and got.tolist() == pytest.approx(by_hand, abs=1e-12)
    assert max(by_hand) > 0  # the case certifies something, so the comparison is not of zeros


def test_a_wrong_top_moves_the_start_past_it():
    conf, correct = _wrong_top()
    assert certify_threshold(conf, correct, target_risk=0.2, delta=0.1, start_coverage=0.0).threshold is None
    choice = choose_start(conf, correct, target_risks=(0.2,), delta=0.1, halvings=10)
    assert choice.start > 0.0 and choice.score(choice.start) == max(choice.score(s) for s in START_GRID)
    assert choice.score(choice.start) > choice.score(0.0) + 0.3  # halves that hold fewer of the wrong top certify
    saved = choice.to_dict()
    assert saved["start"] == choice.start and saved["halvings"] == 10
    assert saved["scores"]["0"] == choice.score(0.0) and set(saved["coverage"]["0.3"]) == {"0.2"}


def test_a_tie_keeps_the_preferred_start_else_the_smallest():
    conf = np.linspace(0.99, 0.01, 300)
    correct = np.arange(300) < 240  # a perfect ranking: every start up to the certified coverage gives one threshold
    tie = choose_start(conf, correct, target_risks=(0.1, 0.2), delta=0.1, grid=(0.0, 0.05, 0.1), halvings=8)
    assert tie.score(0.0) == tie.score(0.05) == tie.score(0.1) > 0
    assert tie.start == 0.0  # the default (0.3) is not in this grid: the smallest
    assert choose_start(conf, correct, target_risks=(0.1, 0.2), delta=0.1, grid=(0.0, 0.05, 0.1), halvings=8,
                        prefer=0.05).start == 0.05
    nothing = choose_start(conf[:20], np.zeros(20, bool), target_risks=(0.1,), delta=0.1, halvings=4)
    assert {nothing.score(s) for s in START_GRID} == {0.0} and nothing.start == 0.3  # all tied: the default
