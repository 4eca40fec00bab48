"""The answer pool that `ats train --on answers` learns from: its tasks (only what ../shared/data/README.md allows
for training; TriviaQA questions disjoint from every reported one) and their sizes (`AnswerPool`); each task's
answers are cached by `pipeline.prepare_answers`."""
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
    from ..evaluation.tasks import MMLUTask, MultipleChoiceTask, NQOpenTask, TriviaQATask
    from ..evaluation.tasks.qa_pool import pool_path

    tasks = {}
    for name in POOL_MC:
        tasks[name] = MultipleChoiceTask(pool_path(name), "likelihood", limit=pool_size, seed=0)
    tasks["nq_open"] = NQOpenTask(limit=pool_size, seed=0)
    trivia = TriviaQATask(limit=pool_size, seed=0, offset=TRIVIAQA_POOL_OFFSET)
    trivia.name = "triviaqa_pool"
    tasks["triviaqa_pool"] = trivia
    if mmlu_per_subject > 0:
        mmlu = MMLUTask(limit=mmlu_per_subject, seed=0, split="validation")
        mmlu.name = "mmlu_validation"
        tasks["mmlu_validation"] = mmlu
    return tasks


FREE_FORM = ("nq_open", "triviaqa_pool")  # the pool's free-form tasks: answers scored as `ats serve` scores them


def held_out_tasks(pool: AnswerPool, size: int, *, names: tuple[str, ...] = FREE_FORM) -> dict:
    """name -> task of `size` questions of each pool task in `names` that the pool of `pool`'s sizes does not hold:
    labelled answers a calibrator trained on that pool never saw (the certification split of `ats certify`). The
    free-form tasks are the default, because served answers are free-form; their names end in "_held_out".

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
