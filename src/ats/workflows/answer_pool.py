"""The answer pool of issue 21: the plan (sizes, methods, the selection rule, seeds), the pool and reported tasks,
the answers cache (generated once per backbone, checked on reuse), held-out and leave-one-out splits."""
from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..errors import ATSError
from ..evaluation.answers import AnswerSet, build_answer_set
from ..evaluation.tasks import (
    MMLUTask,
    MultipleChoiceTask,
    NQOpenTask,
    TriviaQATask,
    TruthfulQAGenTask,
    TruthfulQAMC1Task,
)
from ..io import read_json

logger = logging.getLogger(__name__)

POOL_MC = ("sciq", "social_iqa", "boolq", "winogrande")
TRIVIAQA_POOL_OFFSET = 1000  # reported TriviaQA subsets use the first <= 1000 questions after the few-shot ones


@dataclass
class AnswerPlan:
    """What `run_answers` does: sizes, methods, the selection grid and criterion, seeds (serialised beside the
    results, so a reader sees what was fixed before any reported task ran)."""

    pool_size: int = 300  # questions per pool task (MMLU validation: per subject, see mmlu_pool_per_subject)
    mmlu_pool_per_subject: int = 3  # 0: no MMLU in the pool
    reported: dict = field(default_factory=lambda: {"mmlu": 3, "triviaqa": 400, "truthfulqa_mc1": 300,
                                                     "truthfulqa_gen": 300})
    methods: dict = field(default_factory=lambda: {  # name -> what is trained (`method_spec`)
        "ats-answers": "transformer", "linear-answers": "linear", "control-answers": "constant",
        "thermometer-answers": "thermometer", "ats-answers-tokens": "transformer+tokens"})
    token_weight: float = 1.0  # "+tokens" methods: fixed before any run, not tuned (nothing held out measures it)
    token_window: int = 512  # the instruction sequence's first positions the token term reads (cost: the head's pass)
    token_max: int = 64  # response tokens of that window per step (a seeded random subset)
    loss_type: str = "answer-log"
    lr_grid: tuple = (3e-4, 1e-3, 3e-3)
    epochs: int = 2
    batch_size: int = 16
    seeds: tuple = (0, 1, 2)
    holdout_fraction: float = 0.2
    selection_tasks: tuple = ("triviaqa_pool", "mmlu_validation")  # never left out, so LOTO never selects on its task
    criterion: str = ("mean answer log loss on the held-out 20% of the selection tasks' questions (pooled), after "
                      "training on 80% of every pool task's questions; lowest wins")
    bootstrap: int = 1000
    leave_one_out: tuple = POOL_MC + ("nq_open",)


def pool_tasks(plan: AnswerPlan) -> dict:
    """name -> task of the training pool (local files under ATS_DATA_DIR, else the Hub: `qa_pool.pool_path`)."""
    from ..evaluation.tasks.qa_pool import pool_path

    tasks = {}
    for name in POOL_MC:
        tasks[name] = MultipleChoiceTask(pool_path(name), "likelihood", limit=plan.pool_size, seed=0)
    tasks["nq_open"] = NQOpenTask(limit=plan.pool_size, seed=0)
    trivia = TriviaQATask(limit=plan.pool_size, seed=0, offset=TRIVIAQA_POOL_OFFSET)
    trivia.name = "triviaqa_pool"
    tasks["triviaqa_pool"] = trivia
    if plan.mmlu_pool_per_subject > 0:
        mmlu = MMLUTask(limit=plan.mmlu_pool_per_subject, seed=0, split="validation")
        mmlu.name = "mmlu_validation"
        tasks["mmlu_validation"] = mmlu
    return tasks


def pool_names(plan: AnswerPlan) -> list[str]:
    """The names of `pool_tasks(plan)`'s tasks (and answer sets), in order, without reading any data."""
    names = [f"mc_{n}_likelihood" for n in POOL_MC] + ["nq_open", "triviaqa_pool"]
    return names + (["mmlu_validation"] if plan.mmlu_pool_per_subject > 0 else [])


def reported_tasks(plan: AnswerPlan) -> dict:
    """name -> task reported and never trained or selected on."""
    r = plan.reported
    if r.get("triviaqa", 0) > TRIVIAQA_POOL_OFFSET:
        raise ATSError(f"reported TriviaQA questions ({r['triviaqa']}) would overlap the pool (offset "
                       f"{TRIVIAQA_POOL_OFFSET})")
    return {"mmlu": MMLUTask(limit=r["mmlu"], seed=0), "triviaqa": TriviaQATask(limit=r["triviaqa"], seed=0),
            "truthfulqa_mc1": TruthfulQAMC1Task(limit=r["truthfulqa_mc1"], seed=0),
            "truthfulqa_gen": TruthfulQAGenTask(limit=r["truthfulqa_gen"], seed=0)}


def cached_answers(backbone, task, folder: Path, *, progress: bool = True) -> AnswerSet:
    """The task's answers from `folder` when they were made by this task and backbone with the default storage
    (float16 hidden states); built and saved otherwise (with the default scale summary). A set saved before answer
    sets carried a summary is reused as it is (scored by the exact route, which the summary matches to 1e-4), and so
    is one with other summary settings (each summary row carries its own range and nodes), said in one line.

    Raises:
        ATSError: if the folder holds another task's or backbone's answers, or other storage settings.
    """
    from ..model.scale_summary import ScaleSummarySpec

    want = {"task": task.describe(), "backbone": backbone.describe(), "dtype": "float16",
            "summary": dataclasses.asdict(ScaleSummarySpec())}
    if (folder / "answers.json").is_file():
        meta = read_json(folder / "answers.json")
        have = {key: meta.get(key) for key in want}
        if "summary" not in meta:  # made before answer sets had a summary: the exact route scores it
            have["summary"] = want["summary"]
        elif have["summary"] != want["summary"]:  # each row carries its own nodes: read as made, to 1e-4 of exact
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


def split_holdout(answers: AnswerSet, fraction: float, seed: int = 0) -> tuple[AnswerSet, AnswerSet]:
    """(train, held-out) subsets of a set's questions, a seeded `fraction` held out."""
    order = np.random.default_rng(seed).permutation(len(answers))
    n_out = max(1, round(fraction * len(answers)))
    return answers.subset(sorted(order[n_out:].tolist())), answers.subset(sorted(order[:n_out].tolist()))


def leave_one_out_splits(names: list[str], left_out: tuple) -> list[tuple[str, list[str]]]:
    """[(left-out task, the training tasks)]: every training list lacks its left-out task."""
    return [(out, [n for n in names if n != out]) for out in left_out if out in names]


def mean_log_loss(confidence: np.ndarray, correct: np.ndarray) -> float:
    """The mean binary log loss of answer confidences."""
    p = np.clip(confidence, 1e-7, 1 - 1e-7)
    return float(-np.mean(np.where(correct, np.log(p), np.log1p(-p))))

