"""`ats certify` keeps its served answers (certify_answers.json, after every batch): an interrupted run goes on
from them and ends exactly where an uninterrupted one does (to the last bit: it goes on at a batch boundary, so every
question is decoded in the same batch); another target risk reuses them; answers made otherwise (another format,
other questions) are answered again; a damaged file is named in one line. Batches of 4 here, so that the tiny
data's 14 questions make several."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from ats.errors import ATSError
from ats.evaluation.served import ServedAnswers, served_answers
from ats.evaluation.threshold import THRESHOLD_NAME, certify_threshold, read_threshold
from ats.workflows import certify as certify_module
from ats.workflows.answer_pool import free_form_tasks
from ats.workflows.certify import ANSWERS_NAME, certify, interleaved_order

from helpers import calibrator_for

OPTIONS = {"target_risk": 0.9, "delta": 0.2, "size": 7, "max_tokens": 5, "progress": False}
BATCH = 4


@pytest.fixture(scope="module", autouse=True)
def _small_batches():
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(certify_module, "BATCH", BATCH)
        yield


@pytest.fixture(scope="module")
def certified(tiny_backbone, tmp_path_factory):
    """A calibrator certified without interruption: (backbone, calibrator, its folder, the answers file's JSON)."""
    folder = tmp_path_factory.mktemp("certified") / "head"
    calibrator = calibrator_for(tiny_backbone, "linear")
    calibrator.save_pretrained(folder)
    certify(tiny_backbone, calibrator, folder, **OPTIONS)
    return tiny_backbone, calibrator, folder, json.loads((folder / ANSWERS_NAME).read_text())


def _copy(folder, to, log: dict | None):
    """The calibrator of `folder` in `to`, without its threshold, and with `log` as its answers file."""
    shutil.copytree(folder, to)
    (to / THRESHOLD_NAME).unlink()
    (to / ANSWERS_NAME).unlink()
    if log is not None:
        (to / ANSWERS_NAME).write_text(json.dumps(log))
    return to


def _cut(log: dict, keep: int, text: str = "PLANTED") -> dict:
    """`log` with its certification part cut to the first `keep` answers, the first one's text replaced by `text`
    (a mark that shows whether a later run reused the saved answer or made it again)."""
    log = json.loads(json.dumps(log))
    part = log["certification"]
    part["questions"] = part["questions"][:keep]
    part["answers"] = {name: column[:keep] for name, column in part["answers"].items()}
    part["answers"]["text"][0] = text
    return log


def test_the_saved_answers_are_the_served_answers_in_certification_order(certified):
    backbone, calibrator, folder, log = certified
    questions = {name: task.load()[1] for name, task in free_form_tasks(7).items()}
    order = interleaved_order(questions)
    rows = [questions[t][i] for t, i in order]
    got = served_answers(backbone, calibrator, rows, max_tokens=5, batch_size=BATCH)
    part = log["certification"]
    assert part["questions"] == [r["question"] for r in rows]
    assert part["answers"] == got.to_dict()
    threshold = json.loads((folder / THRESHOLD_NAME).read_text())
    assert part["made"] == {"served": threshold["served"], "sets": threshold["sets"]}
    assert set(log) == {"certification"}  # a fixed start answers no selection questions


def test_an_interrupted_run_goes_on_from_its_answers_and_ends_as_an_uninterrupted_one(certified, tmp_path):
    backbone, calibrator, folder, log = certified
    resumed = _copy(folder, tmp_path / "head", _cut(log, 2 * BATCH))  # stopped after two batches
    done = certify(backbone, calibrator, resumed, **OPTIONS)
    assert done.threshold == read_threshold(folder)
    assert (resumed / THRESHOLD_NAME).read_text() == (folder / THRESHOLD_NAME).read_text()
    after = json.loads((resumed / ANSWERS_NAME).read_text())["certification"]
    assert after["answers"]["text"][0] == "PLANTED"  # the saved answers were reused, not made again
    assert after["answers"]["text"][1:] == log["certification"]["answers"]["text"][1:]
    assert {k: v for k, v in after["answers"].items() if k != "text"} == {
        k: v for k, v in log["certification"]["answers"].items() if k != "text"}


def test_another_target_risk_reuses_the_answers(certified, tmp_path):
    backbone, calibrator, folder, log = certified
    other = _copy(folder, tmp_path / "head", _cut(log, len(log["certification"]["questions"])))
    done = certify(backbone, calibrator, other, **{**OPTIONS, "target_risk": 0.5})
    answers = ServedAnswers.from_dict(log["certification"]["answers"], where="log")
    assert done.threshold == certify_threshold(answers.confidence, answers.correct, target_risk=0.5, delta=0.2)
    assert json.loads((other / ANSWERS_NAME).read_text())["certification"]["answers"]["text"][0] == "PLANTED"


@pytest.mark.parametrize("change", ["max_tokens", "question"])
def test_answers_made_otherwise_are_answered_again(certified, tmp_path, change):
    backbone, calibrator, folder, log = certified
    stale = _cut(log, 5)
    if change == "question":  # the data changed under the same positions
        stale["certification"]["questions"][2] += " (edited)"
    again = _copy(folder, tmp_path / "head", stale)
    options = {**OPTIONS, "max_tokens": 6} if change == "max_tokens" else OPTIONS
    certify(backbone, calibrator, again, **options)
    after = json.loads((again / ANSWERS_NAME).read_text())["certification"]
    assert "PLANTED" not in after["answers"]["text"] and len(after["questions"]) == 14
    assert after["made"]["served"]["format"]["max_tokens"] == options["max_tokens"]
    if change == "question":
        assert after == log["certification"]


@pytest.mark.parametrize("damage, message", [
    (lambda a: a["correct"].__setitem__(1, "yes"), ": certification: field 'correct' must be a list of bool"),
    (lambda a: a["finish"].pop(), ": certification: field 'finish' has 4 answers, 'confidence' 5"),
    (lambda a: a.pop("confidence"), ": certification: field 'confidence' must be a list of number"),
    (lambda a: [column.pop() for column in a.values()], ": certification: 5 questions but 4 answers"),
    (None, ":1: invalid JSON"),
])
def test_a_damaged_answers_file_is_named_in_one_line(certified, tmp_path, damage, message):
    backbone, calibrator, folder, log = certified
    damaged = _cut(log, 5)
    target = _copy(folder, tmp_path / "head", damaged)
    if damage is None:
        (target / ANSWERS_NAME).write_text('{"certification": ')
    else:
        damage(damaged["certification"]["answers"])
        (target / ANSWERS_NAME).write_text(json.dumps(damaged))
    with pytest.raises(ATSError, match=rf"^{target / ANSWERS_NAME}{message}.*; delete {ANSWERS_NAME} to answer "
                                       rf"again$"):
        certify(backbone, calibrator, target, **OPTIONS)
    assert not (target / THRESHOLD_NAME).exists()


def test_the_chosen_start_keeps_its_selection_answers_too(tiny_backbone, tmp_path):
    calibrator = calibrator_for(tiny_backbone, "linear")
    calibrator.save_pretrained(tmp_path / "head")
    certify(tiny_backbone, calibrator, tmp_path / "head", target_risk=0.9, delta=0.2, size=3, max_tokens=4,
            start_coverage=None, progress=False)
    log = json.loads((tmp_path / "head" / ANSWERS_NAME).read_text())
    record = json.loads((tmp_path / "head" / THRESHOLD_NAME).read_text())
    assert log["selection"]["made"]["sets"] == record["start_choice"]["sets"]
    assert log["certification"]["made"]["sets"] == record["sets"]
    selection = {n: t.load()[1] for n, t in free_form_tasks(3, {"nq_open": 3, "triviaqa_pool": 1003}).items()}
    assert log["selection"]["questions"] == [selection[t][i]["question"] for t, i in interleaved_order(selection)]
    assert len(np.asarray(log["selection"]["answers"]["confidence"])) == 6
    # another target risk reuses both parts (a mark planted in each stays)
    for part in ("selection", "certification"):
        log[part]["answers"]["text"][0] = "PLANTED"
    (tmp_path / "head" / ANSWERS_NAME).write_text(json.dumps(log))
    certify(tiny_backbone, calibrator, tmp_path / "head", target_risk=0.8, delta=0.2, size=3, max_tokens=4,
            start_coverage=None, overwrite=True, progress=False)
    after = json.loads((tmp_path / "head" / ANSWERS_NAME).read_text())
    assert after == log
