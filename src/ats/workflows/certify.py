"""A calibrator's certified answer-or-abstain threshold (`ats certify`), certified on answers made as they are served.

What is certified. Free-form questions of the QA pool (NQ-open, TriviaQA beyond every reported subset) that the
calibrator never trained on are answered exactly as `ats serve` answers a chat request (`evaluation.served`): the
question alone as one user turn through the backbone's chat template, greedy decoding on the calibrated logits by
the serving decoder, stopped by an end-of-sequence token or after `max_tokens` new tokens (64 by default, as `ats
generate`), and the served confidence `answer_confidence`. An answer is correct when a normalised alias of the
question occurs in it. The threshold then keeps the error rate among answered questions <= the target risk with
probability >= 1 - delta (`evaluation.threshold`) for questions drawn like this certification mix (NQ-open and
TriviaQA in equal parts), asked alone in one user turn and answered in that format (greedy, that max tokens), by that
calibrator (its digest) on that backbone (name, revision, sizes, chat template), with correctness judged by that
rule. Nothing holds for other questions (another domain, a conversation, a system prompt), sampled or longer
answers, or another judge: measure the risk there.

Disjoint by construction. A calibrator trained on answers records the tasks it trained on (sizes, seeds, offsets)
in its training record (`training.questions`); the certification sets start after them (`answer_pool
.certification_tasks`) and any overlap is refused (`answer_pool.check_disjoint`).

Where the sequence starts. Fixed-sequence testing starts at `start_coverage` of the answers (0.3 by default,
`evaluation.start_coverage`), or, with `start_coverage=None` (`--start-coverage choose`), at the start that
`start_choice.choose_start` picks at this target risk on the served answers to other questions: `selection_size` per
task after the certification sets (`selection_sets`), disjoint from them and from training by the same
construction. The start is then fixed before any certification answer is judged, so the guarantee is unchanged.

Early word. Before the full run, the first `ESTIMATE` answers (spread over the tasks) estimate the error rate, or
`prior_error` gives it; when even a perfect ranking could not certify the target risk at this size and delta (the
abstention floor and the Clopper-Pearson minimum, `threshold.unreachable`) it is said at once. After certifying,
the smallest target risk that would have passed is reported.

Saved beside the calibrator as `threshold.json` with what it certifies (`served`: format, calibrator digest,
backbone; `sets`), reused while nothing that made it changed (`fingerprint.check_reuse`), and checked by every
place that applies it (`Certificate.check`).

Resumed. The served answers (selection and certification) are saved beside it in `certify_answers.json` after
every batch, with what made them (format, backbone, calibrator digest, sets) and their questions' text: an
interrupted run goes on from the last batch, and another target risk, delta or start reuses them, when both match
(answers made otherwise are replaced). They are what the threshold rests on, kept for audit.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from itertools import zip_longest
from pathlib import Path

import numpy as np

from ..calibrators.base import CONFIG_NAME
from ..confidence import ANSWER_MAX_TOKENS
from ..errors import ATSError
from ..evaluation.metrics import summarize
from ..evaluation.served import ServedAnswers, answer_format, served_answers
from ..evaluation.start_choice import HALVINGS, START_GRID, choose_start
from ..evaluation.tasks.base import chunks, progress_bar
from ..evaluation.threshold import (
    DEFAULT_START_COVERAGE,
    THRESHOLD_NAME,
    CertifiedThreshold,
    backbone_identity,
    certify_threshold,
    smallest_certifiable_risk,
    unreachable,
)
from ..fingerprint import check_reuse, make_fingerprint
from ..io import read_json, write_json
from .answer_pool import FREE_FORM, certification_tasks, saved_training_record, task_range, trained_ranges

logger = logging.getLogger(__name__)

ESTIMATE = 32  # answers that estimate the error rate before the full run
BATCH = 16  # questions decoded together
ANSWERS_NAME = "certify_answers.json"  # the served answers a threshold rests on, saved after every batch


@dataclass(frozen=True)
class Certification:
    """What `certify` made: the threshold, whether it was reused, the early word on reachability (None: nothing
    to say), the smallest target risk these answers would have certified (None: none below 1), where the sequence
    started, and whether that start was chosen on selection answers (`start_coverage=None`)."""

    threshold: CertifiedThreshold
    reused: bool
    early: str | None
    smallest_risk: float | None
    start_coverage: float
    start_chosen: bool = False


def certification_sets(calibrator, size: int, *, names: tuple[str, ...] = FREE_FORM, where: str = "calibrator",
                       pool_size: int | None = None) -> dict:
    """name -> task of the certification questions of `calibrator` (None: the uncalibrated model): `size` per
    free-form pool task in `names`, after what its training record says it trained on (`answer_pool`).

    Raises:
        ATSError: as `trained_ranges` and `certification_tasks`.
    """
    return certification_tasks(_trained(calibrator, where, pool_size), size, names=names)


def _trained(calibrator, where: str, pool_size: int | None) -> list:
    """The free-form pool questions `calibrator` trained on, from its training record (`trained_ranges`)."""
    record = {} if calibrator is None else saved_training_record({"type": calibrator.name, **calibrator.config()})
    return trained_ranges(record, where=where, pool_size=pool_size)


def selection_sets(calibrator, certification: dict, size: int, *, names: tuple[str, ...] = FREE_FORM,
                   where: str = "calibrator", pool_size: int | None = None) -> dict:
    """name -> task of the questions that choose where the sequence starts (`start_coverage=None`): `size` per
    free-form pool task in `names` after the certification sets `certification` (`certification_sets`) and what the
    calibrator trained on, so disjoint from both by construction (checked as the certification sets are).

    Raises:
        ATSError: as `certification_sets`.
    """
    taken = _trained(calibrator, where, pool_size) + [task_range(task.describe()) for task in certification.values()]
    return certification_tasks(taken, size, names=names)


def load_questions(tasks: dict, what: str) -> dict[str, list]:
    """name -> question rows of each task in `tasks`.

    Raises:
        ATSError: if a task has no questions left (`what`: "certification" or "selection", named in the error).
    """
    questions = {name: task.load()[1] for name, task in tasks.items()}
    empty = [name for name, rows in questions.items() if not rows]
    if empty:
        raise ATSError(f"{what} set {empty[0]}: no questions left after what the calibrator trained on "
                       f"({tasks[empty[0]].describe()})")
    return questions


def _described(tasks: dict, questions: dict[str, list], suffix: str) -> list[dict]:
    """The sets as the threshold records them: positions of the data's seeded permutation (`answer_pool`)."""
    return [{"name": f"{name}_{suffix}", **task_range(task.describe()).describe(), "n": len(questions[name])}
            for name, task in tasks.items()]


def interleaved_order(questions: dict[str, list]) -> list[tuple[str, int]]:
    """(task, index) of every question, the tasks taken in turn, so any prefix spreads over them: the order the
    certification answers are made in (benchmarks/monitor_shift.py replays traffic in it)."""
    turns = zip_longest(*[[(name, i) for i in range(len(rows))] for name, rows in questions.items()])
    return [item for turn in turns for item in turn if item is not None]


def certify(backbone, calibrator, folder: str | Path, *, target_risk: float, delta: float, size: int = 300,
            names: tuple[str, ...] = FREE_FORM, max_tokens: int = ANSWER_MAX_TOKENS, pool_size: int | None = None,
            prior_error: float | None = None, start_coverage: float | None = DEFAULT_START_COVERAGE,
            selection_size: int | None = None, overwrite: bool = False, progress: bool = True) -> Certification:
    """Certify `calibrator`'s threshold on `size` held-out questions of each free-form pool task in `names`,
    answered as served, and save it in `folder` (threshold.json); reuse the saved one when it was made the same way.

    Args:
        backbone: the frozen backbone.
        calibrator: the calibrator whose confidence is thresholded (None: the uncalibrated model).
        folder: the calibrator's folder (the threshold is saved beside it).
        target_risk: the highest error rate allowed among answered questions.
        delta: the probability allowed that the risk exceeds the target.
        size: certification questions per task.
        names: the free-form pool tasks to certify on.
        max_tokens: new tokens at most per answer (the served format's).
        pool_size: for a calibrator trained on answers before its record named its questions: its pool size.
        prior_error: the error rate expected, for the early word (None: estimated on the selection answers, or
            else on the first certification answers).
        start_coverage: the fraction of the answers the certification sequence starts at
            (`certify_threshold`; default `DEFAULT_START_COVERAGE`); 0: the fewest that can certify; None: chosen
            at `target_risk` by `start_choice.choose_start` on the served answers to `selection_sets`.
        selection_size: with `start_coverage=None`, the selection questions per task (None: `size`).
        overwrite: replace a threshold made otherwise instead of refusing.
        progress: show progress bars.

    Returns:
        The `Certification`.

    Raises:
        ATSError: if a saved threshold was made otherwise (without `overwrite`), the tasks are unknown, the sets
            would overlap the calibrator's training questions (or, selection sets, the certification ones), or a
            set is empty.
    """
    if selection_size is not None and start_coverage is not None:
        raise ATSError(f"selection_size {selection_size}: selection questions choose the start coverage; give "
                       f"start_coverage=None (--start-coverage choose) or drop it")
    folder = Path(folder)
    where = str(folder / CONFIG_NAME)
    tasks = certification_sets(calibrator, size, names=names, where=where, pool_size=pool_size)
    questions = load_questions(tasks, "certification")
    served = {"format": answer_format(backbone, max_tokens), "backbone": backbone_identity(backbone),
              "calibrator": None if calibrator is None else calibrator.digest()}
    sets = _described(tasks, questions, "held_out")
    choosing = start_coverage is None
    if choosing:
        selection_tasks = selection_sets(calibrator, tasks, selection_size or size, names=names, where=where,
                                         pool_size=pool_size)
        selection_questions = load_questions(selection_tasks, "selection")
        started = {"start_coverage": "choose", "start_choice": {
            "sets": _described(selection_tasks, selection_questions, "selection"), "grid": list(START_GRID),
            "halvings": HALVINGS}}
    else:
        started = {"start_coverage": start_coverage} if start_coverage else {}  # 0 unrecorded, as before the option
    fingerprint = make_fingerprint("threshold", served=served, target_risk=target_risk, delta=delta, sets=sets,
                                   **started)
    path = folder / THRESHOLD_NAME
    if path.is_file():
        stored = read_json(path)
        if check_reuse(path, "threshold", stored.get("fingerprint") if isinstance(stored, dict) else None,
                       fingerprint, overwrite=overwrite, keep="give the options that made it (a threshold certified "
                       f"before the start coverage's default became {DEFAULT_START_COVERAGE:g}: --start-coverage 0)"):
            reach = stored.get("reachable") or {}
            return Certification(CertifiedThreshold.from_dict(stored["threshold"], where=f"{path}: threshold"),
                                 True, reach.get("early"), reach.get("smallest_target_risk"),
                                 float(reach.get("start_coverage", 0.0)), choosing)
    log = AnswerLog(folder / ANSWERS_NAME, served)
    choice, error = None, prior_error
    if choosing:
        selection = _answer(backbone, calibrator, selection_questions, max_tokens=max_tokens, progress=progress,
                            desc="selection answers", log=log.part("selection", started["start_choice"]["sets"]))
        choice = choose_start(selection.confidence, selection.correct, target_risks=(target_risk,), delta=delta)
        start_coverage = choice.start
        logger.info("start coverage %g chosen on %d selection answers: held-out coverage %.3f (the default %g: "
                    "%.3f)", start_coverage, len(selection), choice.score(start_coverage), DEFAULT_START_COVERAGE,
                    choice.score(DEFAULT_START_COVERAGE))
        if error is None:
            error = float(1 - selection.correct.mean())
    order = interleaved_order(questions)
    n = len(order)
    early, said = None, False

    def say_early(answers: ServedAnswers) -> None:
        """The early word, once: from the given or selection error rate at once, else after `ESTIMATE` answers."""
        nonlocal early, said
        if said or (error is None and len(answers) < min(ESTIMATE, n)):
            return
        said = True
        rate = error if error is not None else float(1 - answers.correct.mean())
        early = unreachable(rate, n, target_risk, delta, start_coverage=start_coverage)
        if early is not None:
            basis = ("given" if prior_error is not None else f"estimated on the {len(selection)} selection answers"
                     if choosing else f"estimated on the first {len(answers)} answers")
            early = f"{early} (error rate {basis})"
            logger.warning("%s", early)

    say_early(ServedAnswers())  # a given or selection error rate: said before any certification answer
    answers = _answer(backbone, calibrator, questions, max_tokens=max_tokens, progress=progress,
                      desc="certification answers", each=say_early, log=log.part("certification", sets))
    threshold = certify_threshold(answers.confidence, answers.correct, target_risk=target_risk, delta=delta,
                                  start_coverage=start_coverage)
    smallest = smallest_certifiable_risk(answers.confidence, answers.correct, delta, start_coverage=start_coverage)
    per_task = {}
    for name in questions:
        pick = np.asarray([t == name for t, _ in order])
        conf, ok = answers.confidence[pick], answers.correct[pick]
        answered = threshold.answers(conf)
        per_task[f"{name}_held_out"] = {
            "n": int(conf.size), "accuracy": float(ok.mean()), "coverage": float(answered.mean()),
            "risk": float(1 - ok[answered].mean()) if answered.any() else None, "ece": summarize(conf, ok)["ece"],
            "cut_by_max_tokens": float(np.mean([f == "length" for f, p in zip(answers.finish, pick) if p]))}
    reach = {"early": early, "error_rate": float(1 - answers.correct.mean()), "smallest_target_risk": smallest,
             **({"start_coverage": start_coverage} if start_coverage or choosing else {})}
    chose = {} if choice is None else {"start_choice": {**started["start_choice"], **choice.to_dict(),
                                                        "error_rate": float(1 - selection.correct.mean())}}
    write_json(path, {"threshold": threshold.to_dict(), "served": served, "sets": sets, "tasks": per_task,
                      "reachable": reach, **chose, "fingerprint": fingerprint})
    logger.info("certified threshold %s on %d held-out served answers (target risk %g, delta %g): saved to %s",
                threshold.threshold, threshold.n, target_risk, delta, path)
    return Certification(threshold, False, early, smallest, start_coverage, choosing)


class AnswerLog:
    """The served answers `certify` makes, in one JSON file (`ANSWERS_NAME`): per part ("selection",
    "certification") what made them (`served` and the part's sets), their questions and the answers so far."""

    def __init__(self, path: Path, served: dict) -> None:
        self.path, self.served = path, served

    def part(self, name: str, sets: list[dict]) -> "AnswerLogPart":
        """The part `name` ("selection", "certification") of the answers to `sets`."""
        made = json.loads(json.dumps({"served": self.served, "sets": sets}))  # as JSON reads it back
        return AnswerLogPart(self, name, made)

    def read(self) -> dict:
        """The file's parts ({} when there is none).

        Raises:
            ATSError: if the file is damaged (named, with the way out).
        """
        try:
            stored = read_json(self.path) if self.path.is_file() else {}
        except ATSError as err:
            raise self.damaged(err) from None
        return stored if isinstance(stored, dict) else {}

    def damaged(self, err: ATSError) -> ATSError:
        return ATSError(f"{err}; delete {self.path.name} to answer again")


@dataclass(frozen=True)
class AnswerLogPart:
    """One part of an `AnswerLog`: `made` is what its answers must have been made with to be reused."""

    log: AnswerLog
    name: str
    made: dict

    def resume(self, questions: list[str]) -> ServedAnswers:
        """The answers saved for the first of `questions` (in order) by a run made the same way; none otherwise."""
        entry = self.log.read().get(self.name)
        if not isinstance(entry, dict):
            return ServedAnswers()
        saved = entry.get("questions")
        if entry.get("made") != self.made or not isinstance(saved, list) or saved != questions[:len(saved)]:
            logger.info("%s: the %s answers there were made otherwise; answering again", self.log.path, self.name)
            return ServedAnswers()
        try:
            answers = ServedAnswers.from_dict(entry.get("answers"), where=f"{self.log.path}: {self.name}")
            if len(answers) != len(saved):
                raise ATSError(f"{self.log.path}: {self.name}: {len(saved)} questions but {len(answers)} answers")
        except ATSError as err:
            raise self.log.damaged(err) from None
        if answers:
            logger.info("%s: %d of %d %s answers made by an earlier run, reused", self.log.path, len(answers),
                        len(questions), self.name)
        return answers

    def save(self, questions: list[str], answers: ServedAnswers) -> None:
        """Save `answers`, to the first of `questions`, as this part (the other part kept)."""
        stored = self.log.read()
        stored[self.name] = {"made": self.made, "questions": questions[:len(answers)], "answers": answers.to_dict()}
        write_json(self.log.path, stored)


def _answer(backbone, calibrator, questions: dict[str, list], *, max_tokens: int, progress: bool, desc: str,
            each=None, log: AnswerLogPart | None = None) -> ServedAnswers:
    """The served answers to `questions` in `interleaved_order`, `BATCH` at a time; `each(answers so far)` after
    every batch. With `log`, the answers are saved there after every batch, and those it holds from a run made the
    same way are reused."""
    order = interleaved_order(questions)
    texts = [questions[t][i]["question"] for t, i in order]
    answers = ServedAnswers() if log is None else log.resume(texts)
    if len(answers) and each is not None:
        each(answers)
    for batch in progress_bar(chunks(order[len(answers):], BATCH), enabled=progress, desc=desc):
        answers.extend(served_answers(backbone, calibrator, [questions[t][i] for t, i in batch],
                                      max_tokens=max_tokens, batch_size=BATCH))
        if log is not None:
            log.save(texts, answers)
        if each is not None:
            each(answers)
    return answers
