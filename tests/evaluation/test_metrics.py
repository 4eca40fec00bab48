"""Metrics against small hand-computed cases (worked out in the comments)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from ats.errors import ATSError
from ats.evaluation.metrics import (
    accuracy,
    adaptive_ece,
    auroc,
    brier_score,
    ece,
    nll,
    reliability_bins,
    summarize,
)


def test_ece_hand_case():
    # 5 bins of width 0.2. Top bin [0.8, 1]: conf 1.0, 0.9 -> mean 0.95, acc 1/2 -> gap 0.45, weight 2/4.
    # Bin [0.2, 0.4): conf 0.3, 0.25 -> mean 0.275, acc 1/2 -> gap 0.225, weight 2/4. ECE = 0.225 + 0.1125.
    conf = [1.0, 0.9, 0.3, 0.25]
    correct = [1, 0, 1, 0]
    assert ece(conf, correct, n_bins=5) == pytest.approx(0.3375)


def test_confidence_one_lands_in_top_bin():
    # One confident wrong answer at exactly 1.0: the ECE is |0 - 1| = 1 (the reference code drops it and gets 0).
    assert ece([1.0], [0]) == pytest.approx(1.0)
    stats = reliability_bins([1.0, 14 / 15, 0.0], [1, 1, 0])
    assert stats.counts[-1] == 2 and stats.counts[0] == 1 and stats.counts.sum() == 3


def test_bin_edges_are_left_closed():
    # With 5 bins, 0.2 belongs to [0.2, 0.4) (bin 1), 0.1999 to bin 0.
    stats = reliability_bins([0.2, 0.1999], [1, 1], n_bins=5)
    assert stats.counts.tolist() == [1, 1, 0, 0, 0]


def test_reliability_stats_fields():
    stats = reliability_bins([0.05, 0.15, 0.95], [0, 1, 1], n_bins=10)
    assert stats.edges.shape == (11,) and stats.edges[0] == 0.0 and stats.edges[-1] == 1.0
    assert stats.counts.tolist() == [1, 1, 0, 0, 0, 0, 0, 0, 0, 1]
    assert np.isnan(stats.accuracy[2]) and np.isnan(stats.mean_confidence[2])
    assert stats.accuracy[1] == 1.0 and stats.mean_confidence[1] == pytest.approx(0.15)
    # ECE = (|0 - .05| + |1 - .15| + |1 - .95|) / 3 = 0.95 / 3
    assert stats.ece == pytest.approx(0.95 / 3) and stats.n == 3


def test_adaptive_ece_hand_split():
    # Sorted: {0.1, 0.2} mean .15 acc 0 -> .15; {0.3, 0.4} mean .35 acc .5 -> .15; {0.6, 0.9} mean .75 acc 1 -> .25.
    # AECE = (2 * .15 + 2 * .15 + 2 * .25) / 6 = 1.1 / 6. The input is shuffled to check the sort.
    conf = [0.9, 0.3, 0.1, 0.6, 0.4, 0.2]
    correct = [1, 1, 0, 1, 0, 0]
    assert adaptive_ece(conf, correct, n_bins=3) == pytest.approx(1.1 / 6)


def test_adaptive_ece_uneven_groups():
    # 5 examples in 2 bins: sizes 3 and 2. {0.1, 0.2, 0.3} mean .2 acc 1/3 -> 2/15 gap; {0.8, 1.0} mean .9 acc 1 -> .1.
    # AECE = (3 * 2/15 + 2 * 0.1) / 5 = (0.4 + 0.2) / 5 = 0.12
    assert adaptive_ece([0.1, 0.2, 0.3, 0.8, 1.0], [0, 0, 1, 1, 1], n_bins=2) == pytest.approx(0.12)


def test_brier_nll_accuracy():
    # Brier: ((0.8 - 1)^2 + (0.6 - 0)^2) / 2 = (0.04 + 0.36) / 2 = 0.2
    assert brier_score([0.8, 0.6], [1, 0]) == pytest.approx(0.2)
    # NLL: -(ln 0.8 + ln(1 - 0.6)) / 2
    assert nll([0.8, 0.6], [1, 0]) == pytest.approx(-(math.log(0.8) + math.log(0.4)) / 2)
    # Clipped: a wrong answer at confidence 1 costs -ln(1e-12), not inf.
    assert nll([1.0], [0]) == pytest.approx(-math.log(1e-12))
    assert accuracy([1, 0, 1, 1]) == 0.75
    assert accuracy(np.array([True, False])) == 0.5


def _pairwise_auroc(conf, correct) -> float:
    pos = [c for c, y in zip(conf, correct) if y]
    neg = [c for c, y in zip(conf, correct) if not y]
    wins = sum(1.0 if p > n else 0.5 if p == n else 0.0 for p in pos for n in neg)
    return wins / (len(pos) * len(neg))


def test_auroc_hand_and_pairwise():
    # pos {0.9, 0.7}, neg {0.8, 0.6, 0.7}: 0.9 beats all 3; 0.7 loses to .8, beats .6, ties .7 (0.5) -> 4.5 / 6.
    conf = [0.9, 0.8, 0.7, 0.6, 0.7]
    correct = [1, 0, 1, 0, 0]
    assert auroc(conf, correct) == pytest.approx(0.75)
    rng = np.random.default_rng(0)
    conf = np.round(rng.uniform(size=60), 1)  # rounding makes ties
    correct = rng.uniform(size=60) < conf
    assert auroc(conf, correct) == pytest.approx(_pairwise_auroc(conf, correct))
    assert math.isnan(auroc([0.2, 0.9], [1, 1]))


def test_accepts_tensors_and_lists():
    conf = torch.tensor([0.8, 0.6])
    correct = torch.tensor([True, False])
    assert brier_score(conf, correct) == pytest.approx(brier_score([0.8, 0.6], [1, 0]))


@pytest.mark.parametrize(
    "conf, correct, field",
    [([0.5, 0.6], [1], "correct"), ([1.5], [1], "confidence"), ([float("nan")], [1], "confidence"),
     ([], [], "confidence"), ([0.5], [2], "correct"), ([-0.1], [0], "confidence")],
)
def test_validation(conf, correct, field):
    with pytest.raises(ATSError, match=field):
        ece(conf, correct)


def test_bad_n_bins():
    with pytest.raises(ATSError, match="n_bins"):
        ece([0.5], [1], n_bins=0)


def test_summarize_keys_and_bootstrap():
    rng = np.random.default_rng(1)
    conf = rng.uniform(0.2, 1.0, size=400)
    correct = rng.uniform(size=400) < conf ** 2
    plain = summarize(conf, correct)
    assert set(plain) == {"n", "accuracy", "mean_confidence", "ece", "adaptive_ece", "brier", "nll", "auroc",
                          "aurc", "excess_aurc", "prr", "error_auprc"}
    assert plain["mean_confidence"] == pytest.approx(conf.mean())
    assert plain["n"] == 400 and plain["ece"] == pytest.approx(ece(conf, correct))
    out = summarize(conf, correct, bootstrap=200, seed=3)
    json.dumps(out)  # JSON-ready
    for key in ("accuracy", "brier", "nll", "auroc", "ece", "adaptive_ece", "aurc", "excess_aurc", "prr",
                "error_auprc"):
        lo, hi = out[f"{key}_ci"]
        assert lo <= out[key] <= hi, key
    assert summarize(conf, correct, bootstrap=200, seed=3) == out  # reproducible
    assert summarize(conf, correct, bootstrap=200, seed=4)["ece_ci"] != out["ece_ci"]
    with pytest.raises(ATSError, match="bootstrap"):
        summarize(conf, correct, bootstrap=-1)


def test_paired_differences_resample_the_same_examples():
    from ats.evaluation.metrics import paired_differences

    rng = np.random.default_rng(3)
    good = rng.uniform(0.3, 0.7, size=600)
    correct = rng.uniform(size=600) < good  # `good` is calibrated by construction
    shifted = good + 0.25  # the same ranking, 0.25 more confident: worse calibrated
    out = paired_differences((good, correct), (shifted, correct), bootstrap=300, seed=7)
    assert out["ece"]["diff"] == pytest.approx(ece(good, correct) - ece(shifted, correct))
    assert out["brier"]["diff"] == pytest.approx(brier_score(good, correct) - brier_score(shifted, correct))
    assert out["ece"]["excludes_zero"] and out["ece"]["ci"][1] < 0
    # the interval is computed on the SAME resampled indices for both methods: rebuild it by hand
    draws = np.random.default_rng(7)
    diffs = []
    for _ in range(300):
        idx = draws.integers(0, 600, size=600)
        diffs.append(ece(good[idx], correct[idx]) - ece(shifted[idx], correct[idx]))
    assert out["ece"]["ci"] == pytest.approx(list(np.percentile(diffs, [2.5, 97.5])))
    # a method against itself: difference 0, interval [0, 0], not excluding 0
    same = paired_differences((good, correct), (good, correct), bootstrap=50)
    assert same["ece"]["diff"] == 0 and same["ece"]["ci"] == [0.0, 0.0] and not same["ece"]["excludes_zero"]
    with pytest.raises(ATSError, match="same examples"):
        paired_differences((good, correct), (good[:10], correct[:10]))

