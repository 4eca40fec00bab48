"""Risk-coverage metrics: hand-worked cases (ties included), sklearn's average precision, a brute-force rejection
curve and LM-Polygraph's prediction-rejection area computed from its definition; the tables and the figure."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from sklearn.metrics import average_precision_score, precision_recall_curve

from ats.errors import ATSError
from ats.evaluation.metrics import paired_differences, summarize
from ats.evaluation.selective import (
    aurc,
    error_auprc,
    excess_aurc,
    oracle_aurc,
    prr,
    risk_coverage,
    selective_metrics,
)


def test_hand_case_without_ties():
    # conf .9 .8 .7 .6, right / wrong / right / wrong. Answering the top 1..4: risk 0, 1/2, 1/3, 1/2.
    # AURC = (0 + 1/2 + 1/3 + 1/2) / 4 = 1/3. Oracle (2 right first): (1/3 + 2/4) / 4 = 5/24; excess = 1/8.
    # PRR = (E/N - AURC) / (E/N - oracle) = (1/2 - 1/3) / (1/2 - 5/24) = 4/7.
    # Errors found rejecting the least confident first: .6 (P 1, R 1/2), .7 (P 1/2), .8 (P 2/3, R 1), .9;
    # AP = 1/2 * 1 + 1/2 * 2/3 = 5/6.
    conf, correct = [0.9, 0.8, 0.7, 0.6], [1, 0, 1, 0]
    curve = risk_coverage(conf, correct)
    assert curve.thresholds.tolist() == [0.9, 0.8, 0.7, 0.6] and curve.n == 4
    assert curve.coverage.tolist() == [0.25, 0.5, 0.75, 1.0]
    assert curve.risk == pytest.approx([0, 1 / 2, 1 / 3, 1 / 2])
    m = selective_metrics(conf, correct)
    assert m == pytest.approx({"aurc": 1 / 3, "excess_aurc": 1 / 8, "prr": 4 / 7, "error_auprc": 5 / 6})
    assert oracle_aurc(4, 2) == pytest.approx(5 / 24)
    assert (aurc(conf, correct), excess_aurc(conf, correct), prr(conf, correct), error_auprc(conf, correct)) == (
        m["aurc"], m["excess_aurc"], m["prr"], m["error_auprc"])


def test_ties_are_answered_together_whatever_the_input_order():
    # conf .9 .9 | .5 .5 .5 with one wrong answer in each group: two points, not five.
    # risk(.9) = 1/2 on 2 of 5, risk(.5) = 2/5 on 5 of 5: AURC = 2/5 * 1/2 + 3/5 * 2/5 = 11/25.
    # Oracle (3 right first): (1/4 + 2/5) / 5 = 13/100; excess 31/100; PRR = (2/5 - 11/25) / (2/5 - 13/100) = -4/27
    # (worse than random: the most confident group is half wrong). Rejecting .5 first: P 1/3 at R 1/2, then P 2/5
    # at R 1: AP = 1/6 + 1/5 = 11/30.
    conf = [0.9, 0.9, 0.5, 0.5, 0.5]
    correct = [1, 0, 1, 1, 0]
    expected = {"aurc": 11 / 25, "excess_aurc": 31 / 100, "prr": -4 / 27, "error_auprc": 11 / 30}
    for order in itertools.permutations(range(5)):
        c, k = [conf[i] for i in order], [correct[i] for i in order]
        assert selective_metrics(c, k) == pytest.approx(expected)
    curve = risk_coverage(conf, correct)
    assert curve.thresholds.tolist() == [0.9, 0.5] and curve.answered.tolist() == [2, 5]
    assert curve.errors.tolist() == [1, 2]


def test_a_perfect_ranking_is_the_oracle_and_one_class_has_no_ratio():
    perfect = selective_metrics([0.9, 0.8, 0.3, 0.2], [1, 1, 0, 0])
    assert perfect["excess_aurc"] == pytest.approx(0.0, abs=1e-15) and perfect["prr"] == pytest.approx(1.0)
    assert perfect["error_auprc"] == pytest.approx(1.0)
    backwards = selective_metrics([0.2, 0.3, 0.8, 0.9], [1, 1, 0, 0])
    assert backwards["prr"] < 0 and backwards["error_auprc"] == pytest.approx((1 / 3 + 2 / 4) / 2)
    right = selective_metrics([0.4, 0.7, 0.7], [1, 1, 1])
    assert right["aurc"] == 0 and right["excess_aurc"] == 0 and math.isnan(right["prr"])
    assert math.isnan(right["error_auprc"])
    wrong = selective_metrics([0.4, 0.7, 0.7], [0, 0, 0])
    assert wrong["aurc"] == 1 and wrong["excess_aurc"] == 0 and math.isnan(wrong["prr"])
    assert wrong["error_auprc"] == 1.0 == average_precision_score([1, 1, 1], [0.6, 0.3, 0.3])


def _brute_aurc(conf: np.ndarray, correct: np.ndarray) -> float:
    """The risk when the threshold is each question's own confidence (its tie group answered with it), averaged."""
    return float(np.mean([np.mean(~correct[conf >= c]) for c in conf]))


def _lm_polygraph_prr(conf: np.ndarray, correct: np.ndarray) -> float:
    """LM-Polygraph's PredictionRejectionArea (max_rejection = 1) on the uncertainty -confidence, the oracle on the
    uncertainty -correct, random as the mean over 2000 seeded shuffles; PRR from the three areas."""
    def area(uncertainty: np.ndarray) -> float:
        kept = correct[np.argsort(uncertainty, kind="stable")]  # least uncertain first
        return float(np.sum((np.cumsum(kept) / np.arange(1, kept.size + 1))[::-1]) / kept.size)

    rng = np.random.default_rng(0)
    random = np.mean([area(rng.permutation(conf.size).astype(float)) for _ in range(2000)])
    return (area(-conf) - random) / (area(-correct) - random)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_against_sklearn_a_brute_force_curve_and_lm_polygraph(seed):
    rng = np.random.default_rng(seed)
    conf = rng.uniform(0.2, 1.0, size=300)
    correct = rng.uniform(size=300) < conf
    m = selective_metrics(conf, correct)
    assert m["error_auprc"] == pytest.approx(average_precision_score(~correct, 1 - conf), abs=1e-12)
    assert m["aurc"] == pytest.approx(_brute_aurc(conf, correct), abs=1e-12)
    assert m["prr"] == pytest.approx(_lm_polygraph_prr(conf, correct.astype(float)), abs=2e-3)  # random: sampled
    # rounding makes ties: sklearn's precision-recall curve has one point per distinct score, as ours
    tied = np.round(conf, 1)
    m = selective_metrics(tied, correct)
    precision, recall, thresholds = precision_recall_curve(~correct, 1 - tied)
    assert thresholds.size == np.unique(tied).size
    assert m["error_auprc"] == pytest.approx(-np.sum(np.diff(recall) * precision[:-1]), abs=1e-12)
    assert m["error_auprc"] == pytest.approx(average_precision_score(~correct, 1 - tied), abs=1e-12)
    assert m["aurc"] == pytest.approx(_brute_aurc(tied, correct), abs=1e-12)
    assert m["excess_aurc"] >= 0


def test_bad_inputs_are_named():
    with pytest.raises(ATSError, match="confidence: value 1.5 outside"):
        aurc([1.5], [1])
    with pytest.raises(ATSError, match="correct: length 1 does not match"):
        prr([0.5, 0.6], [1])


def test_bootstrap_intervals_and_paired_differences_include_the_ranking_metrics():
    rng = np.random.default_rng(5)
    conf = rng.uniform(0.2, 1.0, size=400)
    correct = rng.uniform(size=400) < conf
    noisy = np.clip(conf + rng.normal(0, 0.3, size=400), 0, 1)  # the same answers, ranked worse
    out = summarize(conf, correct, bootstrap=100, seed=2)
    for key in ("aurc", "excess_aurc", "prr", "error_auprc"):
        assert out[key] == pytest.approx(selective_metrics(conf, correct)[key])
        assert out[f"{key}_ci"][0] <= out[key] <= out[f"{key}_ci"][1]
    pairs = paired_differences((conf, correct), (noisy, correct), bootstrap=200, seed=1)
    assert pairs["aurc"]["diff"] == pytest.approx(aurc(conf, correct) - aurc(noisy, correct))
    assert pairs["aurc"]["excludes_zero"] and pairs["aurc"]["ci"][1] < 0  # better ranking: lower AURC
    assert pairs["prr"]["excludes_zero"] and pairs["prr"]["ci"][0] > 0
    assert pairs["error_auprc"]["diff"] == pytest.approx(error_auprc(conf, correct) - error_auprc(noisy, correct))


def test_risk_coverage_figure_draws_each_curve_and_the_oracle(tmp_path):
    from ats.evaluation.plots import make_risk_coverage_figure, risk_coverage_figure

    conf, correct = np.array([0.9, 0.9, 0.5, 0.5, 0.5]), np.array([1, 0, 1, 1, 0])
    fig = make_risk_coverage_figure({"a": (conf, correct), "b": (1 - conf, correct)}, title="quiz")
    ax = fig.axes[0]
    a = ax.lines[0]
    assert list(a.get_xdata()) == pytest.approx([0, 0.4, 1.0]) and list(a.get_ydata()) == pytest.approx(
        [0.5, 0.5, 0.4])  # the step curve of the two tie groups, its area the AURC 11/25
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert labels == ["a (AURC 0.440)", f"b (AURC {aurc(1 - conf, correct):.3f})", "oracle (AURC 0.130)",
                      "random (0.400)"]
    # answers that differ between methods have no common oracle
    fig = make_risk_coverage_figure({"a": (conf, correct), "b": (conf, 1 - correct)})
    assert [t.get_text() for t in fig.axes[0].get_legend().get_texts()] == ["a (AURC 0.440)", "b (AURC 0.560)"]
    paths = risk_coverage_figure({"a": (conf, correct)}, tmp_path / "quiz_risk_coverage")
    assert [p.name for p in paths] == ["quiz_risk_coverage.png", "quiz_risk_coverage.pdf"]
    assert paths[0].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(ATSError, match="results"):
        make_risk_coverage_figure({})
