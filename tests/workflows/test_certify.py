"""`ats certify`: the certification split holds only pool questions that `ats train --on answers` never trains on;
the saved threshold is `certify_threshold` of the calibrator's answers to that split (computed here independently,
task by task), reused on a rerun and refused with other options; `ats serve`'s `ats` field and `generate_calibrated`
decide answer-or-abstain by it."""

from __future__ import annotations

import json

import numpy as np
import pytest

from ats.cli.main import main
from ats.errors import ATSError
from ats.evaluation.tasks.base import seeded_subset
from ats.evaluation.threshold import THRESHOLD_NAME, CertifiedThreshold, certify_threshold, read_threshold
from ats.generation import generate_calibrated
from ats.generation.logprobs import TokenLogprob
from ats.serving.responses import summary
from ats.workflows.answer_pool import AnswerPool, held_out_tasks, pool_names, pool_tasks
from ats.workflows.certify import certify

from helpers import calibrator_for


def questions(task) -> list[str]:
    if hasattr(task, "selected"):
        return [r["question"] for r in task.selected()]
    if hasattr(task, "load") and task.name.startswith("mmlu"):
        per_subject, _ = task.load()
        return [r["question"] for rows in per_subject.values() for r in rows]
    return [r["question"] for r in task.load()[1]]


def test_held_out_subset_leaves_the_first_subset_out():
    for n, first, size in ((12, 5, 4), (12, 5, 7), (100, 30, 20)):
        taken = set(seeded_subset(n, first, 0, salt="x"))
        held = seeded_subset(n, size, 0, salt="x", held_out_from=first)
        assert len(held) == size and held == sorted(held) and not taken & set(held)
        assert held == seeded_subset(n, size, 0, salt="x", held_out_from=first)  # deterministic
    assert seeded_subset(12, None, 0, salt="x", held_out_from=5) == \
        sorted(set(range(12)) - set(seeded_subset(12, 5, 0, salt="x")))


def test_certification_split_is_disjoint_from_the_training_pool():
    pool = AnswerPool(pool_size=5, mmlu_per_subject=2)
    training = {task.name: task for task in pool_tasks(pool.pool_size, pool.mmlu_per_subject).values()}
    held = held_out_tasks(pool, 4, names=tuple(pool_names(1)))
    assert sorted(held) == sorted(f"{n}_held_out" for n in training)
    for name, task in training.items():
        seen, new = set(questions(task)), questions(held[f"{name}_held_out"])
        assert new and not seen & set(new), name
        assert held[f"{name}_held_out"].describe() != task.describe()
    with pytest.raises(ATSError, match="unknown bogus"):
        held_out_tasks(pool, 4, names=("bogus",))


def test_certify_saves_the_threshold_of_the_held_out_answers_and_reuses_it(tiny_backbone, tmp_path):
    calibrator = calibrator_for(tiny_backbone, "linear")
    calibrator.save_pretrained(tmp_path / "head")
    pool = AnswerPool(pool_size=5, mmlu_per_subject=2)
    names = ("nq_open", "mc_sciq_likelihood")
    threshold, reused = certify(tiny_backbone, calibrator, tmp_path / "head", alpha=0.9, delta=0.2, pool=pool,
                                size=7, names=names, progress=False)
    assert not reused
    # the same numbers computed here, task by task
    conf, ok = [], []
    for task in held_out_tasks(pool, 7, names=names).values():
        result = task.run(tiny_backbone, {"c": calibrator}, progress=False)["c"]
        conf.append(result.confidence)
        ok.append(result.correct)
    expected = certify_threshold(np.concatenate(conf), np.concatenate(ok), alpha=0.9, delta=0.2)
    assert threshold == expected == read_threshold(tmp_path / "head")
    record = json.loads((tmp_path / "head" / THRESHOLD_NAME).read_text())
    assert sorted(record["tasks"]) == ["mc_sciq_likelihood_held_out", "nq_open_held_out"]
    # 12 NQ rows: 5 few-shot examples, 5 in the training pool, 2 left; 7 of SciQ's 12 - 5
    assert {k: t["n"] for k, t in record["tasks"].items()} == {"nq_open_held_out": 2, "mc_sciq_likelihood_held_out": 7}
    assert threshold.n == 9
    again, reused = certify(tiny_backbone, calibrator, tmp_path / "head", alpha=0.9, delta=0.2, pool=pool, size=7,
                            names=names, progress=False)
    assert reused and again == threshold
    with pytest.raises(ATSError, match=r"threshold made with other options: alpha 0.9 -> 0.5"):
        certify(tiny_backbone, calibrator, tmp_path / "head", alpha=0.5, delta=0.2, pool=pool, size=7, names=names,
                progress=False)
    other, reused = certify(tiny_backbone, calibrator, tmp_path / "head", alpha=0.5, delta=0.2, pool=pool, size=7,
                            names=names, overwrite=True, progress=False)
    assert not reused and other.alpha == 0.5 and read_threshold(tmp_path / "head") == other


def token(p: float) -> TokenLogprob:
    return TokenLogprob(token=1, logprob=float(np.log(p)), uncalibrated=float(np.log(p)), tau=0.0, confidence=p)


def test_served_summary_and_generation_decide_by_the_threshold(tiny_backbone):
    certified = CertifiedThreshold(threshold=0.5, alpha=0.2, delta=0.1, n=100, coverage=0.4, risk=0.1, bound=0.18)
    never = CertifiedThreshold(threshold=None, alpha=0.2, delta=0.1, n=100)
    high, low = [token(0.9), token(0.7)], [token(0.3), token(0.5)]  # answer confidence 0.8 and 0.4
    assert summary(high, threshold=certified)["answered"] is True
    assert summary(low, threshold=certified)["answered"] is False
    assert summary(high, threshold=never)["answered"] is False
    out = summary(high, {"calibrator": "x"}, certified)
    assert (out["threshold"], out["target_risk"], out["delta"]) == (0.5, 0.2, 0.1) and out["calibrator"] == "x"
    assert "answered" not in summary(high)  # no threshold: no decision
    assert summary([], threshold=certified)["answered"] is False  # nothing generated: nothing to answer
    calibrator = calibrator_for(tiny_backbone, "linear")
    (gen,) = generate_calibrated(tiny_backbone, calibrator, ["The capital of France is"], max_new_tokens=4)
    for t in (gen.answer_confidence - 1e-6, gen.answer_confidence + 1e-6):
        rule = CertifiedThreshold(threshold=t, alpha=0.2, delta=0.1, n=100, coverage=0.4, risk=0.1, bound=0.18)
        (out,) = generate_calibrated(tiny_backbone, calibrator, ["The capital of France is"], max_new_tokens=4,
                                     threshold=rule)
        assert out.answered is (gen.answer_confidence >= t) and out.threshold == t


def test_certify_command_and_generate_read_the_saved_threshold(tiny_backbone, tokenizer, tmp_path, capsys):
    model = tmp_path / "tiny-model"
    tiny_backbone.model.save_pretrained(model)
    tokenizer.save_pretrained(model)
    from ats.model.backbone import load_backbone

    calibrator_for(load_backbone(str(model)), "linear").save_pretrained(tmp_path / "head")
    argv = ["certify", "--model", str(model), "--calibrator", str(tmp_path / "head"), "--target-risk", "0.9",
            "--delta", "0.2", "--size", "6", "--pool-size", "5", "--tasks", "nq_open,mc_boolq_likelihood"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "saved to" in out and str(tmp_path / "head" / THRESHOLD_NAME) in out
    assert main(argv) == 0 and "reused" in capsys.readouterr().out
    threshold = read_threshold(tmp_path / "head")
    assert main(["generate", "--model", str(model), "--calibrator", str(tmp_path / "head"), "--max-new-tokens", "3",
                 "Hello"]) == 0
    printed = capsys.readouterr().out
    assert ("answered (" in printed or "abstains (" in printed) and (threshold.threshold is None or
                                                                     f"{threshold.threshold:.3f}" in printed)
    assert main(["certify", "--model", str(model), "--calibrator", "someone/remote-head"]) == 2
    assert "make a local copy first" in capsys.readouterr().err
