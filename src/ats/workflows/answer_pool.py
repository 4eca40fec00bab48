"""The answer pool that `ats train --on answers` learns from: its tasks (only what ../shared/data/README.md allows
for training; TriviaQA questions disjoint from every reported one) and their sizes (`AnswerPool`); each task's
answers are cached by `pipeline.prepare_answers`. The pool also says which free-form questions it uses
(`QuestionRange`: positions of a seeded permutation), reads them back from a trained calibrator's record (whose
`training.questions` lists each set's task) and derives from them the certification sets of `ats certify`, which
start after them and may not overlap them."""
from __future__ import annotations

import logging
from dataclasses import dataclass

from ..training.config import TOKEN_MAX, TOKEN_WINDOW

logger = logging.getLogger(__name__)

POOL_MC = ("sciq", "social_iqa", "boolq", "winogrande")
TRIVIAQA_POOL_OFFSET = 1000  # reported TriviaQA subsets use the first <= 1000 questions after the few-shot ones


@dataclass(frozen=True)
class AnswerPool:
    """The pool's sizes and the token term of '+tokens' methods: the one source of `ats train --on answers`'
    defaults."""

    pool_size: int = 200  # questions per pool task
    mmlu_per_subject: int = 2  # MMLU validation questions per subject; 0: no MMLU in the pool
    token_weight: float = 1.0  # '+tokens': the answer loss plus this weight x the top-label loss on instruction tokens
    token_window: int = TOKEN_WINDOW  # the instruction sequence's first positions the token term reads (cost: the
    # head's pass)
    token_max: int = TOKEN_MAX  # response tokens of that window per step (a seeded random subset)


def pool_tasks(pool_size: int, mmlu_per_subject: int) -> dict:
    """name -> task of the training pool (local files under ATS_DATA_DIR, else the Hub: `qa_pool.pool_path`):
    `pool_size` questions per task, `mmlu_per_subject` MMLU validation questions per subject (0: none)."""
    from ..evaluation.tasks import MMLUTask, MultipleChoiceTask
    from ..evaluation.tasks.qa_pool import pool_path

    tasks = {}
    for name in POOL_MC:
        tasks[name] = MultipleChoiceTask(pool_path(name), "likelihood", limit=pool_size, seed=0)
    tasks.update(free_form_tasks(pool_size))
    if mmlu_per_subject > 0:
        mmlu = MMLUTask(limit=mmlu_per_subject, seed=0, split="validation")
        mmlu.name = "mmlu_validation"
        tasks["mmlu_validation"] = mmlu
    return tasks


FREE_FORM = ("nq_open", "triviaqa_pool")  # the pool's free-form tasks: answers scored as `ats serve` scores them
FREE_FORM_FIRST = {"nq_open": 0, "triviaqa_pool": TRIVIAQA_POOL_OFFSET}  # each one's pool starts after this offset


def free_form_tasks(size: int | None, offsets: dict[str, int] = FREE_FORM_FIRST) -> dict:
    """name -> task of `size` questions of each free-form pool data set (NQ-open; TriviaQA validation beyond every
    reported subset), seed 0, after `offsets[name]` questions of its permutation (the training pool's by default)."""
    from ..evaluation.tasks import NQOpenTask, TriviaQATask

    tasks = {}
    for name, offset in offsets.items():
        task = (NQOpenTask if name == "nq_open" else TriviaQATask)(limit=size, seed=0, offset=offset)
        task.name = name
        tasks[name] = task
    return tasks


def held_out_tasks(pool: AnswerPool, size: int, *, names: tuple[str, ...] = FREE_FORM) -> dict:
    """name -> task of `size` questions of each pool task in `names` that the pool of `pool`'s sizes does not hold:
    labelled answers a calibrator trained on that pool never saw, every pool task included (the held-out split of
    benchmarks/selective.py; `ats certify` derives its own from the calibrator's record: `certification_tasks`).
    Their names end in "_held_out".

    Raises:
        ATSError: if a name is not a pool task.
    """
    from ..errors import ATSError
    from ..evaluation.tasks import MMLUTask, MultipleChoiceTask, NQOpenTask, TriviaQATask
    from ..evaluation.tasks.qa_pool import pool_path

    known = pool_names(1)
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ATSError(f"certification tasks: unknown {', '.join(unknown)}; the pool's tasks are {', '.join(known)}")
    tasks = {}
    for name in names:
        if name == "nq_open":
            task = NQOpenTask(limit=size, seed=0, offset=pool.pool_size)
        elif name == "triviaqa_pool":
            task = TriviaQATask(limit=size, seed=0, offset=TRIVIAQA_POOL_OFFSET + pool.pool_size)
        elif name == "mmlu_validation":  # `size` per subject
            task = MMLUTask(limit=size, seed=0, split="validation", held_out_from=pool.mmlu_per_subject)
        else:
            task = MultipleChoiceTask(pool_path(name[3:-len("_likelihood")]), "likelihood", limit=size, seed=0,
                                      held_out_from=pool.pool_size)
        task.name = f"{name}_held_out"
        tasks[task.name] = task
    return tasks


def pool_names(mmlu_per_subject: int) -> list[str]:
    """The names of `pool_tasks`' tasks (and answer sets), in order, without reading any data."""
    names = [f"mc_{n}_likelihood" for n in POOL_MC] + ["nq_open", "triviaqa_pool"]
    return names + (["mmlu_validation"] if mmlu_per_subject > 0 else [])


# --- the question ranges of the free-form tasks: what training used, what certification may use ---------------------
@dataclass(frozen=True)
class QuestionRange:
    """Questions [start, stop) of the seeded permutation of one free-form data set (`TriviaQATask.load`: the first
    `n_shots` positions are the few-shot examples, then `offset` skipped, then `limit` taken)."""

    data: str  # "nq_open" or "triviaqa_pool" (TriviaQA validation from TRIVIAQA_POOL_OFFSET on)
    seed: int
    start: int  # position in the permutation
    stop: int | None  # None: to the end

    def overlaps(self, other: "QuestionRange") -> bool:
        """Whether the two may share a question: same data and intersecting positions, or the same data under
        other seeds (other permutations: any two ranges can share questions)."""
        if self.data != other.data:
            return False
        if self.seed != other.seed:
            return True
        return (other.stop is None or self.start < other.stop) and (self.stop is None or other.start < self.stop)

    def describe(self) -> dict:
        """{"data", "seed", "start", "stop"}: JSON-ready."""
        return {"data": self.data, "seed": self.seed, "start": self.start, "stop": self.stop}


def task_range(task: dict) -> QuestionRange | None:
    """The range of a free-form pool task from its `describe()` (as a training record keeps it), None for another
    task (multiple choice, MMLU: other data)."""
    data = task.get("name")
    if data not in FREE_FORM:
        return None
    start = int(task.get("n_shots", 5)) + int(task.get("offset", 0))
    limit = task.get("limit")
    return QuestionRange(data, int(task.get("seed", 0)), start, None if limit is None else start + int(limit))


def pool_ranges(pool: AnswerPool) -> list[QuestionRange]:
    """The free-form questions the pool of `pool`'s sizes holds (what `ats train --on answers` trains on)."""
    return [task_range(task.describe()) for task in free_form_tasks(pool.pool_size).values()]


def trained_ranges(record: dict | None, *, where: str, pool_size: int | None = None) -> list[QuestionRange]:
    """The free-form pool questions a calibrator trained on, from its training record.

    Args:
        record: the saved training record (`saved_training_record`); None or not trained on answers: none.
        where: the calibrator's config file, named in errors.
        pool_size: the pool size it was trained with, for a record written before records named their questions.

    Raises:
        ATSError: if the record is of answers but names no questions and no `pool_size` is given, or names them
            and `pool_size` is given too.
    """
    from ..errors import ATSError

    if not record or record.get("data") != "answers":
        return []
    questions = record.get("questions")
    if questions is None:
        if pool_size is None:
            raise ATSError(f"{where}: field training.questions is missing (a calibrator trained on answers before its "
                           f"record named them): pass --pool-size N, the --pool-size it was trained with, or retrain")
        return pool_ranges(AnswerPool(pool_size=pool_size))
    if pool_size is not None:
        raise ATSError(f"--pool-size {pool_size}: {where} names the questions it trained on (training.questions); "
                       f"drop the option")
    return [r for r in (task_range(t) for t in questions if isinstance(t, dict)) if r is not None]


def saved_training_record(config: dict) -> dict:
    """The training record a saved calibrator keeps, from its calibrator_config.json: an ATS head's `training`,
    Thermometer's first history entry; {} without one."""
    if config.get("type") == "thermometer":
        return (config.get("history") or [{}])[0] or {}
    return config.get("training") or {}


def certification_tasks(trained: list[QuestionRange], size: int, *, names: tuple[str, ...] = FREE_FORM) -> dict:
    """name -> task of `size` questions of each free-form pool data set in `names`, starting after every question
    `trained` covers (the pool's own start when it covers none): the certification sets of `ats certify`, disjoint
    from what the calibrator trained on by construction, and checked (`check_disjoint`).

    Raises:
        ATSError: if a name is not a free-form pool task, or trained ranges run to the end of the data.
    """
    from ..errors import ATSError

    unknown = [n for n in names if n not in FREE_FORM]
    if unknown:
        raise ATSError(f"certification tasks: unknown {', '.join(unknown)}; certified answers are free-form, of "
                       f"{', '.join(FREE_FORM)}")
    shots = free_form_tasks(0)["nq_open"].n_shots  # the permutation's first positions: few-shot examples
    offsets = {}
    for name in names:
        ends = [r.stop for r in trained if r.data == name]
        if None in ends:
            raise ATSError(f"certification tasks: the calibrator trained on every {name} question; certify on "
                           f"another task")
        offsets[name] = max([FREE_FORM_FIRST[name]] + [stop - shots for stop in ends])
    tasks = free_form_tasks(size, offsets)
    check_disjoint(trained, tasks)
    return tasks


def check_disjoint(trained: list[QuestionRange], tasks: dict) -> None:
    """Refuse certification sets that may share a question with what the calibrator trained on.

    Raises:
        ATSError: naming the set and the trained range it overlaps.
    """
    from ..errors import ATSError

    for name, task in tasks.items():
        mine = task_range(task.describe())
        for used in trained:
            if mine is not None and mine.overlaps(used):
                raise ATSError(f"certification set {name} (questions {mine.start}-{mine.stop} of seed {mine.seed}) "
                               f"overlaps what the calibrator trained on ({used.describe()})")
