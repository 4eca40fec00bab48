"""The answer pool that `ats train --data answers` learns from: its tasks (only what ../shared/data/README.md allows
for training; TriviaQA questions disjoint from every reported one), their sizes (`AnswerPool`), and the answers
cache (generated once per backbone, checked on reuse)."""
from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass
from pathlib import Path

from ..errors import ATSError
from ..evaluation.answers import build_answer_set
from ..evaluation.tasks import MMLUTask, MultipleChoiceTask, NQOpenTask, TriviaQATask
from ..io import read_json
from ..training.answers import AnswerSet

logger = logging.getLogger(__name__)

POOL_MC = ("sciq", "social_iqa", "boolq", "winogrande")
TRIVIAQA_POOL_OFFSET = 1000  # reported TriviaQA subsets use the first <= 1000 questions after the few-shot ones


@dataclass(frozen=True)
class AnswerPool:
    """The pool's sizes and the token term of '+tokens' methods: the one source of `ats train --data answers`'
    defaults."""

    pool_size: int = 200  # questions per pool task
    mmlu_per_subject: int = 2  # MMLU validation questions per subject; 0: no MMLU in the pool
    token_weight: float = 1.0  # '+tokens': the answer loss plus this weight x the top-label loss on instruction tokens
    token_window: int = 512  # the instruction sequence's first positions the token term reads (cost: the head's pass)
    token_max: int = 64  # response tokens of that window per step (a seeded random subset)


def pool_tasks(pool_size: int, mmlu_per_subject: int) -> dict:
    """name -> task of the training pool (local files under ATS_DATA_DIR, else the Hub: `qa_pool.pool_path`):
    `pool_size` questions per task, `mmlu_per_subject` MMLU validation questions per subject (0: none)."""
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


def pool_names(mmlu_per_subject: int) -> list[str]:
    """The names of `pool_tasks`' tasks (and answer sets), in order, without reading any data."""
    names = [f"mc_{n}_likelihood" for n in POOL_MC] + ["nq_open", "triviaqa_pool"]
    return names + (["mmlu_validation"] if mmlu_per_subject > 0 else [])


def cached_answers(backbone, task, folder: Path, *, progress: bool = True) -> AnswerSet:
    """The task's answers from `folder` when they were made by this task and backbone with the default storage
    (float16 hidden states); built and saved otherwise (with the default scale summary). A set with other summary
    settings is reused as it is (each summary row carries its own range and nodes), said in one line.

    Raises:
        ATSError: if the folder holds another task's or backbone's answers, or other storage settings.
    """
    from ..model.scale_summary import ScaleSummarySpec

    want = {"task": task.describe(), "backbone": backbone.describe(), "dtype": "float16",
            "summary": dataclasses.asdict(ScaleSummarySpec())}
    if (folder / "answers.json").is_file():
        meta = read_json(folder / "answers.json")
        have = {key: meta.get(key) for key in want}
        if have["summary"] != want["summary"]:  # each row carries its own nodes: read as made, to 1e-4 of exact
            logger.info("%s: answers with scale summary %s (default now %s), reused as they are", folder,
                        have["summary"], want["summary"])
            have["summary"] = want["summary"]
        if have != want:
            raise ATSError(f"{folder}: answers of {have}, not of {want}; remove the folder or use another --out")
        logger.info("reusing the answers in %s", folder)
        return AnswerSet.load(folder)
    start = time.perf_counter()
    answers = build_answer_set(backbone, task, progress=progress)
    answers.meta["seconds"] = round(time.perf_counter() - start, 1)
    answers.save(folder)
    logger.info("%s: %d answers in %.0f s", task.name, len(answers), answers.meta["seconds"])
    return answers
