"""The paper's main experiment in one call: train ATS, fit every baseline on the same tokens, evaluate all methods.

Used by `ats demo` (the README's main job) and by `benchmarks/paper_table.py` at larger sizes. The plan is an
`ExperimentSize` (`SIZES`: what `ats demo --size` offers); the steps are the runner's, so every step reuses what an
earlier, interrupted run of the same command already finished.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..evaluation.report import format_table, token_table
from ..evaluation.tasks import build_task
from ..model.backbone import Backbone
from ..training.config import TrainingConfig
from ..training.data import DataConfig
from .configs import CONTROLS, QUICK_SUBJECTS, SIZES, ExperimentSize
from .runner import HeadJob, Laps, Runner

logger = logging.getLogger(__name__)

__all__ = ["CONTROLS", "QUICK_SUBJECTS", "SIZES", "ExperimentResult", "ExperimentSize", "run_experiment",
           "size_record"]

@dataclass
class ExperimentResult:
    """What `run_experiment` returns: token-level and task-level metrics per method, and the seconds per step."""

    token_level: dict[str, dict] = field(default_factory=dict)  # method -> summarize() on held-out tokens
    tasks: dict[str, dict] = field(default_factory=dict)  # task -> method -> summarize()
    seconds: dict[str, float] = field(default_factory=dict)


def run_experiment(backbone: Backbone, out_dir: str | Path, size: ExperimentSize, *, head_type: str = "transformer",
                   overwrite: bool = False, progress: bool = True, bootstrap: int = 0) -> ExperimentResult:
    """Features -> ATS head -> controls and baselines -> token-level and task-level evaluation, under `out_dir`.

    Args:
        backbone: the frozen backbone.
        out_dir: the run folder (features/, ats-<head_type>/, baselines/, eval/).
        size: how much data each step uses.
        head_type: the ATS head's type.
        overwrite: replace results made with other options instead of refusing.
        progress: show progress bars.
        bootstrap: bootstrap resamples for the task metrics; 0: none.

    Returns:
        The metrics and timings.

    Raises:
        ATSError: if a step's stored results were made with other options (without `overwrite`) or a step fails.
    """
    runner = Runner(backbone, out_dir, overwrite=overwrite, progress=progress)
    result = ExperimentResult()
    training = TrainingConfig(epochs=size.epochs, lr=size.lr)
    logger.info("features: %s, %d examples, max length %d; then the %s ATS head, the controls and baselines %s",
                size.data, size.limit, size.max_length, head_type, ", ".join((*size.controls, *size.baselines)))
    arm = runner.arm(DataConfig(source=size.data, limit=size.limit, max_length=size.max_length),
                     [HeadJob("ats", f"ats-{head_type}", training, head_type=head_type)],
                     baselines=(*size.controls, *size.baselines), baseline_options={"training": training},
                     laps=result.seconds)
    result.token_level = arm.token_level
    logger.info("token-level calibration on the held-out split:\n%s", token_table(result.token_level))
    lap = Laps(result.seconds)
    tasks = [build_task("mmlu", limit=size.mmlu_per_subject, subjects=size.mmlu_subjects),
             build_task("triviaqa", limit=size.triviaqa), build_task("truthfulqa_mc1", limit=size.truthfulqa)]
    result.tasks = runner.tasks(arm.calibrators, tasks, bootstrap=bootstrap)
    logger.info("task-level calibration:\n%s", format_table(result.tasks))
    lap.done("tasks")
    return result


def size_record(size: ExperimentSize) -> dict:
    """The size as a JSON-ready record.

    Args:
        size: the experiment size.

    Returns:
        Its fields as a dict.
    """
    return asdict(size)
