"""Evaluation tasks: MMLU, TriviaQA, TruthfulQA MC1 and generation, and any multiple-choice JSONL file.

`build_task(spec)` accepts 'mmlu', 'triviaqa', 'truthfulqa_mc1', 'truthfulqa_gen', 'nq_open', 'mc:PATH',
'mc:PATH:letters', 'mc:PATH:likelihood'.
Every task runs the backbone once per example and applies every calibrator to that same forward.
"""

from __future__ import annotations

from ...errors import ATSError
from .base import Task, TaskResult
from .mmlu import MMLUTask
from .multiple_choice import MODES, MultipleChoiceTask
from .nq_open import NQOpenTask
from .triviaqa import TriviaQATask
from .truthfulqa import TruthfulQAMC1Task
from .truthfulqa_gen import TruthfulQAGenTask

TASKS = {"mmlu": MMLUTask, "triviaqa": TriviaQATask, "truthfulqa_mc1": TruthfulQAMC1Task,
         "truthfulqa_gen": TruthfulQAGenTask, "nq_open": NQOpenTask}
KNOWN_SPECS = ("mmlu", "triviaqa", "truthfulqa_mc1", "truthfulqa_gen", "nq_open", "mc:PATH", "mc:PATH:letters",
               "mc:PATH:likelihood")


def build_task(spec: str, *, limit: int | None = None, seed: int = 0, **options) -> Task:
    """A task from its spec; `limit` = questions (per subject for MMLU), `options` go to the task's constructor.

    Args:
        spec: one of `KNOWN_SPECS` ('mc:PATH' with an optional ':letters' or ':likelihood').
        limit: questions to evaluate (per subject for MMLU); None: all.
        seed: the seed of the subset (and of TriviaQA's few-shot examples).
        **options: further constructor options of the task (e.g. MMLU's `n_shots`).

    Returns:
        The task (an mc file is read and validated here).

    Raises:
        ATSError: if the spec is empty or unknown, an mc spec has no path, an option is unknown, or the task
            rejects its options or its file.
    """
    if not isinstance(spec, str) or not spec.strip():
        raise ATSError(f"task spec must be a non-empty string, got {spec!r}; known: {', '.join(KNOWN_SPECS)}")
    spec = spec.strip()
    if spec.startswith("mc:"):
        path, mode = spec[3:], "letters"
        head, sep, tail = path.rpartition(":")
        if sep and tail in MODES:
            path, mode = head, tail
        if not path:
            raise ATSError(f"task {spec!r}: missing file path; expected mc:PATH[:letters|likelihood]")
        cls, args = MultipleChoiceTask, (path, mode)
    elif spec in TASKS:
        cls, args = TASKS[spec], ()
    else:
        raise ATSError(f"unknown task {spec!r}; known: {', '.join(KNOWN_SPECS)}")
    try:
        return cls(*args, limit=limit, seed=seed, **options)
    except TypeError as err:
        raise ATSError(f"task {spec!r}: bad option ({err})") from None


def build_tasks(tasks, task_limit=None, *, seed: int = 0, mmlu_options: dict | None = None) -> list[Task]:
    """Task objects from specs (Task objects are kept); `task_limit`: an int for all, or spec -> int ('mc' for every
    mc:PATH); `mmlu_options` go to MMLU (n_shots, subjects, split).

    Args:
        tasks: task specs or Task objects.
        task_limit: None (all questions), an int for every task, or spec -> int (a missing spec: all).
        seed: the seed of the subsets.
        mmlu_options: constructor options for the 'mmlu' spec.

    Returns:
        The tasks, in order.

    Raises:
        ATSError: as `build_task`.
    """
    built = []
    for t in tasks:
        if not isinstance(t, str):
            built.append(t)
            continue
        spec = t.strip()
        limit = task_limit
        if isinstance(task_limit, dict):
            limit = task_limit.get("mc" if spec.startswith("mc:") and "mc" in task_limit else spec)
        options = dict(mmlu_options or {}) if spec == "mmlu" else {}
        built.append(build_task(spec, limit=limit, seed=seed, **options))
    return built


__all__ = ["build_tasks", "KNOWN_SPECS", "MMLUTask", "MultipleChoiceTask", "NQOpenTask", "Task", "TaskResult",
           "TriviaQATask", "TruthfulQAGenTask", "TruthfulQAMC1Task", "build_task"]
