"""`ats certify`: the certification split holds only pool questions that `ats train --on answers` never trains on;
the saved threshold is `certify_threshold` of the calibrator's answers to that split (computed here independently,
task by task), reused on a rerun and refused with other options; `ats serve`'s `ats` field and `generate_calibrated`
decide answer-or-abstain by it."""

from __future__ import annotations

import json
import shutil
import socket

import numpy as np
import pytest

from ats.cli.main import main
from ats.errors import ATSError
from ats.evaluation.served import answer_format, served_answers
from ats.evaluation.tasks.base import seeded_subset
from ats.evaluation.threshold import (
    THRESHOLD_NAME,
    CertifiedThreshold,
    backbone_identity,
    certify_threshold,
    read_threshold,
    smallest_certifiable_risk,
    unreachable,
)
from ats.generation import generate_calibrated
from ats.generation.logprobs import TokenLogprob
from ats.serving.responses import summary
from ats.training.answer_objective import answer_record
from ats.training.config import TrainingConfig
from ats.workflows.answer_pool import (
    FREE_FORM_FIRST,
    AnswerPool,
    QuestionRange,
    certification_tasks,
    check_disjoint,
    free_form_tasks,
    held_out_tasks,
    pool_names,
    pool_ranges,
    pool_tasks,
    trained_ranges,
)
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


def test_certification_sets_start_after_what_the_record_says_was_trained_on():
    """The record and the derivation alone, without a backbone: `ats train --pool-size 400` records NQ-open
    positions 5-405 and TriviaQA 1005-1405, so certification starts there, not after the default pool of 200."""
    record = answer_record(TrainingConfig(loss_type="answer-log"), tasks=pool_names(2), token_weight=0.0,
                           token_max=None, token_window=None,
                           questions=[t.describe() for t in pool_tasks(400, 2).values()])  # what training writes
    trained = trained_ranges(json.loads(json.dumps(record)), where="head/calibrator_config.json")
    assert [r.describe() for r in trained] == [{"data": "nq_open", "seed": 0, "start": 5, "stop": 405},
                                               {"data": "triviaqa_pool", "seed": 0, "start": 1005, "stop": 1405}]
    assert trained == pool_ranges(AnswerPool(pool_size=400))
    tasks = certification_tasks(trained, 300)
    assert {n: (t.offset, t.limit, t.seed) for n, t in tasks.items()} == {"nq_open": (400, 300, 0),
                                                                          "triviaqa_pool": (1400, 300, 0)}
    # no training on answers (token-trained heads, fitted baselines, none): the pool's own start
    assert trained_ranges({"data": "alpaca_gpt4"}, where="x") == [] == trained_ranges({}, where="x")
    assert {n: t.offset for n, t in certification_tasks([], 300).items()} == {"nq_open": 0, "triviaqa_pool": 1000}
    # a record written before records named their questions: the pool size must be given, and only then
    old = {k: v for k, v in record.items() if k != "questions"}
    with pytest.raises(ATSError, match=r"^head/calibrator_config.json: field training.questions is missing .*pass "
                                       r"--pool-size N"):
        trained_ranges(old, where="head/calibrator_config.json")
    assert trained_ranges(old, where="x", pool_size=400) == trained
    with pytest.raises(ATSError, match=r"--pool-size 400: x names the questions it trained on"):
        trained_ranges(record, where="x", pool_size=400)
    # another seed is another permutation: any range may share questions, so it is refused
    reseeded = [QuestionRange("nq_open", 1, 5, 10)]
    with pytest.raises(ATSError, match=r"certification set nq_open .* overlaps what the calibrator trained on"):
        certification_tasks(reseeded, 300, names=("nq_open",))
    with pytest.raises(ATSError, match="trained on every nq_open question"):
        certification_tasks([QuestionRange("nq_open", 0, 5, None)], 300)
    with pytest.raises(ATSError, match="unknown mc_sciq_likelihood; certified answers are free-form"):
        certification_tasks([], 300, names=("mc_sciq_likelihood",))
    assert QuestionRange("nq_open", 0, 5, 10).overlaps(QuestionRange("nq_open", 0, 9, 20))
    assert not QuestionRange("nq_open", 0, 5, 10).overlaps(QuestionRange("nq_open", 0, 10, 20))
    assert not QuestionRange("nq_open", 0, 5, 10).overlaps(QuestionRange("triviaqa_pool", 0, 5, 10))


def test_certify_saves_the_threshold_of_the_served_answers_and_reuses_it(tiny_backbone, tmp_path):
    calibrator = calibrator_for(tiny_backbone, "linear")
    calibrator.save_pretrained(tmp_path / "head")
    done = certify(tiny_backbone, calibrator, tmp_path / "head", target_risk=0.9, delta=0.2, size=7, max_tokens=5,
                   progress=False)
    assert not done.reused
    # the same numbers computed here, task by task: NQ has 12 rows, 5 few-shot positions, so 7 certification
    # questions (a linear head trained on no answers leaves the pool's start); TriviaQA 7 from position 1005 on
    conf, ok, sets = [], [], {}
    for name, task in free_form_tasks(7).items():
        rows = task.load()[1]
        sets[name] = rows
        got = served_answers(tiny_backbone, calibrator, rows, max_tokens=5)
        conf.append(got.confidence)
        ok.append(got.correct)
    expected = certify_threshold(np.concatenate(conf), np.concatenate(ok), target_risk=0.9, delta=0.2)
    assert done.threshold == expected == read_threshold(tmp_path / "head")
    assert done.smallest_risk == smallest_certifiable_risk(np.concatenate(conf), np.concatenate(ok), 0.2)
    record = json.loads((tmp_path / "head" / THRESHOLD_NAME).read_text())
    assert {k: t["n"] for k, t in record["tasks"].items()} == {"nq_open_held_out": 7, "triviaqa_pool_held_out": 7}
    assert record["sets"] == [
        {"name": "nq_open_held_out", "data": "nq_open", "seed": 0, "start": 5, "stop": 12, "n": 7},
        {"name": "triviaqa_pool_held_out", "data": "triviaqa_pool", "seed": 0, "start": 1005, "stop": 1012, "n": 7}]
    served = record["served"]
    assert served["calibrator"] == calibrator.digest() and served["backbone"] == backbone_identity(tiny_backbone)
    assert served["format"] == answer_format(tiny_backbone, 5) and served["format"]["chat_template"] is True
    assert done.threshold.n == 14
    again = certify(tiny_backbone, calibrator, tmp_path / "head", target_risk=0.9, delta=0.2, size=7, max_tokens=5,
                    progress=False)
    assert again.reused and again.threshold == done.threshold and again.smallest_risk == done.smallest_risk
    with pytest.raises(ATSError, match=r"threshold made with other options: target_risk 0.9 -> 0.5"):
        certify(tiny_backbone, calibrator, tmp_path / "head", target_risk=0.5, delta=0.2, size=7, max_tokens=5,
                progress=False)
    with pytest.raises(ATSError, match=r"threshold made with other options: served.format.max_tokens 5 -> 6"):
        certify(tiny_backbone, calibrator, tmp_path / "head", target_risk=0.9, delta=0.2, size=7, max_tokens=6,
                progress=False)
    other = certify(tiny_backbone, calibrator, tmp_path / "head", target_risk=0.5, delta=0.2, size=7, max_tokens=5,
                    overwrite=True, progress=False)
    assert not other.reused and other.threshold.target_risk == 0.5
    assert read_threshold(tmp_path / "head") == other.threshold
    # a sequence started at half the answers: the library's certificate of the same answers, recorded and guarded
    with pytest.raises(ATSError, match=r"threshold made with other options: .*start_coverage"):
        certify(tiny_backbone, calibrator, tmp_path / "head", target_risk=0.5, delta=0.2, size=7, max_tokens=5,
                start_coverage=0.5, progress=False)
    started = certify(tiny_backbone, calibrator, tmp_path / "head", target_risk=0.9, delta=0.2, size=7,
                      max_tokens=5, start_coverage=0.5, overwrite=True, progress=False)
    answers = (np.concatenate(conf), np.concatenate(ok))
    assert started.threshold == certify_threshold(*answers, target_risk=0.9, delta=0.2, start_coverage=0.5)
    assert started.smallest_risk == smallest_certifiable_risk(*answers, 0.2, start_coverage=0.5)
    assert started.threshold.threshold is None or started.threshold.coverage >= 0.5
    assert json.loads((tmp_path / "head" / THRESHOLD_NAME).read_text())["reachable"]["start_coverage"] == 0.5
    # from the fewest answers (the start before the default): recorded without the key, as thresholds made before
    # the option were, so those are reused with --start-coverage 0 and refused by the default with that way out
    fewest = certify(tiny_backbone, calibrator, tmp_path / "head", target_risk=0.9, delta=0.2, size=7, max_tokens=5,
                     start_coverage=0.0, overwrite=True, progress=False)
    assert fewest.threshold == certify_threshold(*answers, target_risk=0.9, delta=0.2, start_coverage=0.0)
    assert "start_coverage" not in json.loads((tmp_path / "head" / THRESHOLD_NAME).read_text())["reachable"]
    with pytest.raises(ATSError, match=r"start_coverage '<unset>' -> 0.3; .* --start-coverage 0\)$"):
        certify(tiny_backbone, calibrator, tmp_path / "head", target_risk=0.9, delta=0.2, size=7, max_tokens=5,
                progress=False)


def test_certify_says_early_when_the_target_cannot_be_reached(tiny_backbone, tmp_path, caplog):
    # 14 questions: even with no error, certifying 0.1 at delta 0.1 needs 22 answered; said from the prior at once
    calibrator = calibrator_for(tiny_backbone, "linear")
    calibrator.save_pretrained(tmp_path / "head")
    with caplog.at_level("WARNING", logger="ats.workflows.certify"):
        done = certify(tiny_backbone, calibrator, tmp_path / "head", target_risk=0.1, delta=0.1, size=7, max_tokens=3,
                       prior_error=0.0, progress=False)
    assert done.early == unreachable(0.0, 14, 0.1, 0.1) + " (error rate given)"
    assert "certifying needs 22 answered" in caplog.text and done.threshold.threshold is None
    estimated = certify(tiny_backbone, calibrator, tmp_path / "head", target_risk=0.2, delta=0.1, size=7,
                        max_tokens=3, overwrite=True, progress=False)
    assert estimated.early is not None and "estimated on the first 14 answers" in estimated.early


def token(p: float) -> TokenLogprob:
    return TokenLogprob(token=1, logprob=float(np.log(p)), uncalibrated=float(np.log(p)), tau=0.0, confidence=p)


def test_served_summary_and_generation_decide_by_the_threshold(tiny_backbone):
    certified = CertifiedThreshold(threshold=0.5, target_risk=0.2, delta=0.1, n=100, coverage=0.4, risk=0.1,
                                   bound=0.18)
    never = CertifiedThreshold(threshold=None, target_risk=0.2, delta=0.1, n=100)
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
        rule = CertifiedThreshold(threshold=t, target_risk=0.2, delta=0.1, n=100, coverage=0.4, risk=0.1, bound=0.18)
        (out,) = generate_calibrated(tiny_backbone, calibrator, ["The capital of France is"], max_new_tokens=4,
                                     threshold=rule)
        assert out.answered is (gen.answer_confidence >= t) and out.threshold == t


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_certify_command_and_generate_read_the_saved_threshold_and_refuse_another_calibrator(
        tiny_backbone, tokenizer, tmp_path, capsys):
    model = tmp_path / "tiny-model"
    tiny_backbone.model.save_pretrained(model)
    tokenizer.save_pretrained(model)
    from ats.model.backbone import load_backbone

    loaded = load_backbone(str(model))
    calibrator_for(loaded, "linear").save_pretrained(tmp_path / "head")
    argv = ["certify", "--model", str(model), "--calibrator", str(tmp_path / "head"), "--target-risk", "0.9",
            "--delta", "0.2", "--size", "6", "--max-tokens", "4", "--tasks", "nq_open"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "saved to" in out and str(tmp_path / "head" / THRESHOLD_NAME) in out
    assert "the smallest target risk these answers certify" in out or "no target risk below 1" in out
    assert ", the sequence started at 30% of them (--start-coverage 0.3)\n" in out  # the default start, said
    assert main(argv) == 0 and "reused" in capsys.readouterr().out
    threshold = read_threshold(tmp_path / "head")
    assert main(["generate", "--model", str(model), "--calibrator", str(tmp_path / "head"), "--max-new-tokens", "3",
                 "Hello"]) == 0
    printed = capsys.readouterr()
    assert "answered (" in printed.out or "abstains (" in printed.out
    assert threshold.threshold is None or f"{threshold.threshold:.3f}" in printed.out
    assert "at most 4 new tokens, and this one may have 3" in printed.err  # another length: said, not refused
    # the threshold beside another calibrator: refused in one line by generate and serve, naming file and field
    calibrator_for(loaded, "linear", seed=1).save_pretrained(tmp_path / "other")
    shutil.copyfile(tmp_path / "head" / THRESHOLD_NAME, tmp_path / "other" / THRESHOLD_NAME)
    for command in (["generate", "--model", str(model), "--calibrator", str(tmp_path / "other"), "Hello"],
                    ["serve", "--model", str(model), "--calibrator", str(tmp_path / "other"), "--port",
                     str(free_port())]):
        assert main(command) == 2
        err = [line for line in capsys.readouterr().err.splitlines() if line.strip()][-1]  # after loading bars
        assert f"{tmp_path / 'other' / THRESHOLD_NAME}: field served.calibrator is" in err, err
    assert main(["certify", "--model", str(model), "--calibrator", "someone/remote-head"]) == 2
    assert "make a local copy first" in capsys.readouterr().err
    assert main(["certify", "--model", str(model), "--calibrator", str(tmp_path / "head"), "--tasks",
                 "mc_boolq_likelihood"]) == 2
    assert "--tasks: unknown mc_boolq_likelihood; certified answers are free-form" in capsys.readouterr().err


def test_train_on_a_pool_of_4_then_certify_with_defaults_leaves_the_trained_questions_out(tiny_backbone, tokenizer,
                                                                                          tmp_path, capsys):
    """`ats train --pool-size 400` then `ats certify` on the real data, in miniature: the tiny NQ-open has 12
    questions (5 few-shot positions), so a pool of 4 trains on permutation positions 5-8 and certification must
    take 9-11, whatever its defaults."""
    model = tmp_path / "tiny-model"
    tiny_backbone.model.save_pretrained(model)
    tokenizer.save_pretrained(model)
    out = tmp_path / "run"
    assert main(["-q", "train", "--model", str(model), "--on", "answers", "--method", "linear", "--pool-size", "4",
                 "--mmlu-pool", "0", "--epochs", "1", "--batch-size", "4", "--micro-batch-size", "4", "--out",
                 str(out)]) == 0
    record = json.loads((out / "head" / "calibrator_config.json").read_text())["training"]
    trained = {t["name"]: t for t in record["questions"]}
    assert trained["nq_open"]["limit"] == 4 and trained["triviaqa_pool"]["offset"] == 1000
    assert main(["-q", "certify", "--model", str(model), "--calibrator", str(out / "head"), "--target-risk", "0.9",
                 "--max-tokens", "3"]) == 0
    capsys.readouterr()
    sets = {s["name"]: s for s in json.loads((out / "head" / THRESHOLD_NAME).read_text())["sets"]}
    assert (sets["nq_open_held_out"]["start"], sets["nq_open_held_out"]["n"]) == (9, 3)  # positions 9-11
    assert (sets["triviaqa_pool_held_out"]["start"], sets["triviaqa_pool_held_out"]["n"]) == (1009, 15)
    for name in ("nq_open", "triviaqa_pool"):  # the questions themselves: none trained on, all the rest taken
        seen = {r["question"] for r in free_form_tasks(4)[name].load()[1]}
        task = free_form_tasks(None, {name: sets[f"{name}_held_out"]["start"] - 5})[name]
        certified = [r["question"] for r in task.load()[1]]
        everything = free_form_tasks(None, {name: FREE_FORM_FIRST[name]})[name].load()[1]
        assert not seen & set(certified) and len(seen) + len(certified) == len(everything)
    # what `ats certify --pool-size 200` took before: the first questions after the default pool, with no record
    before = free_form_tasks(300, {"nq_open": 200, "triviaqa_pool": 1200})
    at_400 = trained_ranges({"data": "answers", "questions": [t.describe() for t in free_form_tasks(400).values()]},
                            where="x")
    with pytest.raises(ATSError, match=r"certification set nq_open \(questions 205-505 of seed 0\) overlaps what the "
                                       r"calibrator trained on"):
        check_disjoint(at_400, before)
