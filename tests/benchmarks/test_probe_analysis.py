"""benchmarks/probe.py's analysis on hand-made scores: the probe against the best logit method per metric (chosen
per set), its paired difference, the certification at its target risks and the report."""

from __future__ import annotations

import numpy as np
import probe as bench
import pytest

from ats.evaluation.selective import prr

SETS = ["nq_open_held_out", "triviaqa_pool_held_out", "mc_sciq_likelihood_held_out", "mc_boolq_likelihood_held_out",
        "triviaqa", "mmlu"]


def scores() -> dict:
    """Each set: 40 answers, half right. Every logit method ranks at random (confidence 0.6 for all but a seeded
    shuffle of 0.55 / 0.65), the thermometer ranks a little (right answers 0.65 more often); the probe ranks
    perfectly (0.9 right, 0.1 wrong)."""
    rng = np.random.default_rng(0)
    correct = [True] * 20 + [False] * 20
    per = {}
    for m in bench.METHODS:
        per[m] = {}
        for name in SETS:
            if m == "probe":
                conf = [0.9] * 20 + [0.1] * 20
            elif m == "thermometer":
                conf = [0.65] * 14 + [0.55] * 6 + [0.65] * 6 + [0.55] * 14
            else:
                conf = list(rng.choice([0.55, 0.65], size=40))
            per[m][name] = {"confidence": conf, "correct": correct}
    left_out = {"nq_open_held_out": {m: per[m]["nq_open_held_out"] for m in bench.METHODS}}
    return {"model": "hand", "command": "c", "machine": {}, "sizes": {}, "seconds": 0.0, "scores": per,
            "left_out": left_out, "probe": {"layers": [3], "views": ["prompt_last"], "c": 0.03,
                                            "temperature": 1.1, "selection": {}}}


@pytest.fixture(scope="module")
def result() -> dict:
    return bench.analyse_probe(scores(), bootstrap=50)


def test_the_probe_is_compared_with_the_best_logit_method_per_metric(result):
    table = result["tables"]["triviaqa"]
    prrs = {m: table["values"][m]["prr"] for m in bench.LOGIT_METHODS}
    best = max(prrs, key=prrs.get)
    assert best == "thermometer" and table["vs_best"]["prr"]["best"] == "thermometer"
    hand = prr(np.array([0.65] * 14 + [0.55] * 6 + [0.65] * 6 + [0.55] * 14), np.array([True] * 20 + [False] * 20))
    assert prrs["thermometer"] == pytest.approx(hand)
    d = table["vs_best"]["prr"]
    perfect = prr(np.array([0.9] * 20 + [0.1] * 20), np.array([True] * 20 + [False] * 20))
    assert d["diff"] == pytest.approx(perfect - hand) and d["excludes_zero"] and d["ci"][0] > 0
    assert table["values"]["probe"]["auroc"] == 1.0
    assert result["left_out"]["nq_open_held_out"]["vs_best"]["auroc"]["diff"] > 0


def test_the_probe_certifies_where_the_logit_methods_abstain_and_the_report_says_so(result, tmp_path):
    row = result["certified"]["results"]["free-form"]["probe"]["0.2"]
    # 40 right answers at 0.9 certified on the two free-form held-out sets (80 answers): the bound 1 - 0.1 ** (1/40)
    assert row["threshold"]["threshold"] == 0.9 and row["threshold"]["coverage"] == 0.5
    assert result["certified"]["results"]["free-form"]["uncalibrated"]["0.2"]["threshold"]["threshold"] is None
    assert set(result["certified"]["alphas"]) == {0.2, 0.3, 0.4}
    bench.write_json(tmp_path / "scores" / "hand.json", scores())
    bench.write_report(tmp_path)
    text = (tmp_path / "README.md").read_text()
    assert "## hand" in text and "| probe - best logit method |" in text and "vs thermometer" in text


def test_the_summary_counts_the_targets_the_probe_meets(result):
    lines = bench.summary_table([result])
    mmlu = next(line for line in lines if line.startswith("| hand | MMLU |"))
    # 40 answers, half right; the probe's PRR (perfect order) against the thermometer's, its interval above 0
    assert "| 40 | 0.50 |" in mmlu and "vs thermometer" in mmlu and "*" in mmlu.split("|")[6]
    targets = next(line for line in lines if line.startswith("| hand | targets |"))
    # only MMLU and TriviaQA of the four reported tasks are in the hand-made scores: both met by PRR; the probe's
    # ECE (|0.9 - 1| and |0.1 - 0| = 0.1) against the logit methods' (|0.6 - 0.5| = 0.1 at best) within +0.01
    within = 0
    for task in ("mmlu", "triviaqa"):
        ece = {m: result["tables"][task]["values"][m]["ece"] for m in bench.METHODS}
        within += ece["probe"] <= min(ece[m] for m in bench.LOGIT_METHODS) + 0.01
    assert "interval excluding 0: 2 of 2" in targets and f"ECE within +0.01 of the best: {within} of 2" in targets
