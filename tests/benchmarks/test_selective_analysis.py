"""benchmarks/selective.py's analysis on hand-made scores: the certified threshold, the left-out rule for pool sets of
the certifying kind, realised risk / coverage on other sets and the report, checked against numbers worked by hand."""

from __future__ import annotations

import pytest
import selective

SETS = [*selective.KINDS["free-form"], *selective.KINDS["multiple-choice"], "triviaqa", "truthfulqa_gen", "mmlu",
        "truthfulqa_mc1"]


def scores() -> dict:
    """Every set: 30 right answers at confidence 0.9 and 30 wrong at 0.1, except mmlu: 10 right and 20 wrong at 0.9
    (a harder task whose confident answers are mostly wrong); the same for every method."""
    per_set = {}
    for name in SETS:
        right, wrong_high = (10, 20) if name == "mmlu" else (30, 0)
        conf = [0.9] * (right + wrong_high) + [0.1] * 30
        correct = [True] * right + [False] * wrong_high + [False] * 30
        per_set[name] = {"confidence": conf, "correct": correct}
    return {"model": "hand", "command": "c", "machine": {}, "sizes": {}, "seconds": 0.0,
            "scores": {m: per_set for m in selective.METHODS}}


@pytest.fixture(scope="module")
def result() -> dict:
    return selective.analyse(scores(), repeats=5, bootstrap=20)  # fewer resamples: nothing below depends on them


def test_certified_threshold_and_realised_risk_by_hand(result):
    row = result["results"]["free-form"]["uncalibrated"]["0.1"]
    # 60 free-form answers at 0.9, all right: Clopper-Pearson bound 1 - 0.1 ** (1 / 60) = 0.0377 <= 0.1; then the
    # 0.1 block adds 60 wrong answers (risk 0.5): the sequence stops, so t = 0.9 answering half of the 120
    t = row["threshold"]
    assert t["threshold"] == 0.9 and t["coverage"] == 0.5 and t["risk"] == 0.0
    assert t["bound"] == pytest.approx(1 - 0.1 ** (1 / 60), rel=1e-9)
    # a free-form pool set is judged with the threshold certified on the other one alone (30 right: bound 0.074)
    left_out = row["tasks"]["nq_open_held_out"]
    assert left_out["coverage"] == 0.5 and left_out["risk"] == 0.0
    # the harder task: everything at 0.9 answered, 20 of 30 wrong, an exceedance with its exact interval
    mmlu = row["tasks"]["mmlu"]
    assert mmlu["answered"] == 30 and mmlu["risk"] == pytest.approx(2 / 3) and mmlu["exceeds"]
    lo, hi = mmlu["risk_ci"]
    from scipy.stats import binom
    assert binom.sf(19, 30, lo) == pytest.approx(0.025, abs=1e-6)  # P(X >= 20 | lo) = 2.5%
    assert binom.cdf(20, 30, hi) == pytest.approx(0.025, abs=1e-6)  # P(X <= 20 | hi) = 2.5%
    # same confidences for every method: no coverage or ranking difference
    assert row["tasks"]["triviaqa"]["coverage"] == 0.5
    other = result["results"]["free-form"]["thermometer"]["0.1"]["tasks"]["triviaqa"]["coverage_vs_uncalibrated"]
    assert other == {"diff": 0.0, "ci": [0.0, 0.0]}
    paired = result["ranking"]["triviaqa"]["thermometer"]["vs_uncalibrated"]["prr"]
    assert paired["diff"] == 0.0 and paired["ci"] == [0.0, 0.0] and not paired["excludes_zero"]
    assert result["accuracy"]["control"]["mmlu"] == pytest.approx(1 / 6)


def test_report_flags_the_exceedance(result):
    text = "\n".join(selective.model_markdown(result))
    hi = 1 - 0.025 ** (1 / 30)  # two-sided 95% Clopper-Pearson upper end with no error in 30: 0.116
    clean = f"50% / 0.00 [0.00, {hi:.2f}]"
    # free-form certification, alpha 0.1: nq, triviaqa pool (left out), triviaqa, truthfulqa_gen, mmlu, truthfulqa_mc1
    assert f"| uncalibrated | {clean} | {clean} | {clean} | {clean} | 50% / 0.67 [" in text
    assert "] **over** |" in text  # mmlu: even the interval's lower end (0.47) is above 0.1
