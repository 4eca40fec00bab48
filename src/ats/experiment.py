"""The paper's main experiment in one call: train ATS, fit every baseline on the same tokens, evaluate all methods.

Used by `ats demo` (the README's main job) and by `benchmarks/paper_table.py` at larger sizes. Every step reuses
what an earlier, interrupted run of the same command already finished.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from .backbone import Backbone
from .calibrators.base import Uncalibrated
from .evaluate import evaluate, format_table
from .metrics import summarize
from .pipeline import BASELINES, DataOptions, fit_baselines, prepare_features, train_head
from .tasks import build_task
from .token_eval import token_confidences
from .training import TrainingConfig

# A small, varied set of MMLU subjects for quick runs (None = all 57).
QUICK_SUBJECTS = ["abstract_algebra", "anatomy", "astronomy", "college_biology", "high_school_geography",
                  "high_school_us_history", "marketing", "nutrition", "philosophy", "world_religions"]


@dataclass
class ExperimentSize:
    """How much data each step uses; `ats demo --size` picks one of SIZES."""

    limit: int = 300  # Alpaca-GPT4 examples (train + validation)
    max_length: int = 320
    epochs: int = 2
    lr: float = 1e-3  # the paper's 5e-5 is for ~13k steps; with a few hundred examples the head barely moves
    mmlu_per_subject: int = 3
    mmlu_subjects: list[str] | None = None
    triviaqa: int = 150
    truthfulqa: int = 150
    baselines: tuple[str, ...] = BASELINES
    data: str = "alpaca_gpt4"


SIZES = {
    "tiny": ExperimentSize(limit=60, max_length=256, epochs=1, mmlu_per_subject=1, mmlu_subjects=QUICK_SUBJECTS,
                           triviaqa=20, truthfulqa=20),
    "demo": ExperimentSize(limit=200, max_length=256, mmlu_per_subject=2, triviaqa=120, truthfulqa=120),
    "benchmark": ExperimentSize(limit=1000, max_length=512, mmlu_per_subject=8, triviaqa=400, truthfulqa=400),
}


@dataclass
class ExperimentResult:
    token_level: dict[str, dict] = field(default_factory=dict)  # method -> summarize() on held-out tokens
    tasks: dict[str, dict] = field(default_factory=dict)  # task -> method -> summarize()
    seconds: dict[str, float] = field(default_factory=dict)


def token_table(rows: dict[str, dict]) -> str:
    lines = ["| method | Acc | ECE | Brier | NLL |", "|---|---:|---:|---:|---:|"]
    for name, m in rows.items():
        lines.append(f"| {name} | {m['accuracy']:.3f} | {m['ece']:.3f} | {m['brier']:.3f} | {m['nll']:.3f} |")
    return "\n".join(lines)


def run_experiment(backbone: Backbone, out_dir: str | Path, size: ExperimentSize, *, head_type: str = "transformer",
                   progress: bool = True, bootstrap: int = 0) -> ExperimentResult:
    """Features -> ATS head -> baselines -> token-level and task-level evaluation, all under `out_dir`."""
    out = Path(out_dir)
    result = ExperimentResult()
    clock = time.time()

    def lap(name: str) -> None:
        nonlocal clock
        result.seconds[name] = round(time.time() - clock, 1)
        clock = time.time()

    print(f"[features] {size.data}: {size.limit} examples, max length {size.max_length}")
    train_store, val_store = prepare_features(
        backbone, out / "features", DataOptions(source=size.data, limit=size.limit, max_length=size.max_length),
        progress=progress)
    lap("features")
    print(f"[train] {head_type} ATS head on {train_store.meta['response_tokens']} response tokens")
    ats = train_head(backbone, train_store, val_store, out / f"ats-{head_type}", head_type=head_type,
                     training=TrainingConfig(epochs=size.epochs, lr=size.lr), progress=progress)
    lap("train")
    print(f"[baselines] {', '.join(size.baselines)}")
    calibrators = {"uncalibrated": Uncalibrated(), **fit_baselines(backbone, train_store, out / "baselines",
                                                                   size.baselines), "ats": ats}
    lap("baselines")
    token = token_confidences(val_store, backbone, calibrators, progress=progress)
    result.token_level = {name: summarize(*value) for name, value in token.items()}
    print("\nToken-level calibration on the held-out split:\n" + token_table(result.token_level))
    lap("token_eval")
    tasks = [build_task("mmlu", limit=size.mmlu_per_subject, subjects=size.mmlu_subjects),
             build_task("triviaqa", limit=size.triviaqa), build_task("truthfulqa_mc1", limit=size.truthfulqa)]
    result.tasks = evaluate(backbone, calibrators, tasks, out / "eval", progress=progress, bootstrap=bootstrap)
    print("\n" + format_table(result.tasks))
    lap("tasks")
    return result


def size_record(size: ExperimentSize) -> dict:
    return asdict(size)
