"""The user-facing experiments' configurations, torch-free so that `ats demo --help` and `ats ablate --help` build
their choices without the library: the demo's sizes (`ExperimentSize`, `SIZES`) and the ablations' rows
(`ABLATIONS`: what each row changes of `SHARED`)."""

from __future__ import annotations

from dataclasses import dataclass

from ..calibrators import BASELINES
from ..model.heads import HEAD_TYPES

CONTROLS = ("selective-temperature", "selective-linear")

# A small, varied set of MMLU subjects for quick runs (None = all 57).
QUICK_SUBJECTS = ["abstract_algebra", "anatomy", "astronomy", "college_biology", "high_school_geography",
                  "high_school_us_history", "marketing", "nutrition", "philosophy", "world_religions"]


@dataclass
class ExperimentSize:
    """How much data each step of the paper's experiment uses; `ats demo --size` picks one of SIZES."""

    limit: int = 300  # Alpaca-GPT4 examples (train + validation)
    max_length: int = 320
    epochs: int = 2
    lr: float = 1e-3  # the paper's 5e-5 is for ~13k steps; with a few hundred examples the head barely moves
    mmlu_per_subject: int = 3
    mmlu_subjects: list[str] | None = None
    triviaqa: int = 150
    truthfulqa: int = 150
    baselines: tuple[str, ...] = BASELINES
    controls: tuple[str, ...] = CONTROLS
    data: str = "alpaca_gpt4"


SIZES = {
    "tiny": ExperimentSize(limit=60, max_length=256, epochs=1, mmlu_per_subject=1, mmlu_subjects=QUICK_SUBJECTS,
                           triviaqa=20, truthfulqa=20, controls=("selective-temperature",)),
    "demo": ExperimentSize(limit=200, max_length=256, mmlu_per_subject=2, triviaqa=120, truthfulqa=120),
    "benchmark": ExperimentSize(limit=1000, max_length=512, mmlu_per_subject=8, triviaqa=400, truthfulqa=400),
}

ALPHAS = (0.1, 0.3, 0.5, 0.7, 0.9)
SHARED = {"head_type": "transformer", "loss_type": "selective", "alpha": 0.5}  # what every ablation varies from
ABLATIONS: dict[str, dict[str, dict]] = {  # ablation -> row label -> what the row changes of SHARED
    "smoothing": {loss: {"loss_type": loss} for loss in ("none", "full", "selective")},
    "alpha": {f"{a:g}": {"alpha": a} for a in ALPHAS},
    "head": {head: {"head_type": head} for head in HEAD_TYPES},
}
