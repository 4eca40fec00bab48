"""Evaluation tasks: MMLU, TriviaQA, TruthfulQA MC1 and generation, and any multiple-choice JSONL file.

`build_task(spec)` accepts every registered spec (`KNOWN_SPECS`: 'mmlu', 'triviaqa', 'nq_open', 'truthfulqa_mc1',
'truthfulqa_gen', 'mc:PATH', 'mc:PATH:letters', 'mc:PATH:likelihood'); a new task is one line in `registry.py` (or
`@register_task` on a class elsewhere). The task classes are imported when first built or named (`ats.lazy`): the
names load without torch.
Every task runs the backbone once per example and applies every calibrator to that same forward.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ...errors import ATSError
from ...lazy import lazy_exports
from .registry import REGISTRY, known_specs, register_task, resolve

if TYPE_CHECKING:
    from .base import Task

KNOWN_SPECS = known_specs()  # the built-in tasks (registry.py)


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
    entry, args = resolve(spec)
    try:
        return entry.cls(*args, limit=limit, seed=seed, **options)
    except TypeError as err:
        raise ATSError(f"task {spec.strip()!r}: bad option ({err})") from None


def build_tasks(tasks, task_limit=None, *, seed: int = 0, task_options: dict | None = None) -> list[Task]:
    """Task objects from specs (Task objects are kept).

    Args:
        tasks: task specs or Task objects.
        task_limit: None (all questions), an int for every task, or a dict keyed by a spec or by a registered name
            (e.g. 'mc' for every mc:PATH); a task in neither: all questions.
        seed: the seed of the subsets.
        task_options: registered name -> constructor options of its tasks (e.g. {"mmlu": {"subjects": [...]}}).

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
        entry, _ = resolve(spec)
        limit = task_limit
        if isinstance(task_limit, dict):
            limit = task_limit.get(spec, task_limit.get(entry.name))
        built.append(build_task(spec, limit=limit, seed=seed, **dict((task_options or {}).get(entry.name, {}))))
    return built


__getattr__ = lazy_exports(__name__, {
    "Task": ".base", "TaskResult": ".base", "MMLUTask": ".mmlu", "MultipleChoiceTask": ".multiple_choice",
    "NQOpenTask": ".nq_open", "TriviaQATask": ".triviaqa", "TruthfulQAMC1Task": ".truthfulqa",
    "TruthfulQAGenTask": ".truthfulqa_gen"})

__all__ = ["KNOWN_SPECS", "MMLUTask", "MultipleChoiceTask", "NQOpenTask", "REGISTRY", "Task", "TaskResult",
           "TriviaQATask", "TruthfulQAGenTask", "TruthfulQAMC1Task", "build_task", "build_tasks", "register_task"]
