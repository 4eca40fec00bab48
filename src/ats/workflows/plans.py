"""The experiments as plans: serialisable config dataclasses that say what each run does, read by the runner.

    ExperimentSize   the paper's experiment (ats demo, benchmarks/paper_table.py)
    EvidencePlan     issue 12's evidence: lr selected on held-out data, controls, the trade-off heads
    ScalingPlan      the evidence methods at fixed learning rates on growing training data
    AblationPlan     the ablations (smoothing, alpha, head) on one feature cache
    AlignmentPlan    aligned chat model vs. base model, before and after ATS

`plan_record(plan)` is the one JSON form of a plan (what results files record).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from ..calibrators import BASELINES
from ..evaluation.report import jsonable
from ..training.config import TrainingConfig
from ..training.data import DataConfig
from .variants import ABLATIONS, names

CONTROLS = ("selective-temperature", "selective-linear")

# A small, varied set of MMLU subjects for quick runs (None = all 57).
QUICK_SUBJECTS = ["abstract_algebra", "anatomy", "astronomy", "college_biology", "high_school_geography",
                  "high_school_us_history", "marketing", "nutrition", "philosophy", "world_religions"]


def plan_record(plan) -> dict:
    """A plan as JSON-ready data: every field, nested configs as dicts, tuples as lists."""
    return jsonable(asdict(plan))


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


@dataclass
class EvidencePlan:
    """The evidence experiment's settings: data, training, the learning-rate grid, the methods, tasks and bootstrap."""

    data: DataConfig = field(default_factory=lambda: DataConfig(pack=2048))
    training: TrainingConfig = field(default_factory=lambda: TrainingConfig(batch_size=2, micro_batch_size=1))
    lr_grid: tuple[float, ...] = (3e-4, 1e-3, 3e-3)
    selected: tuple[str, ...] = names("selected")
    tradeoff: tuple[str, ...] = names("tradeoff")
    baselines: tuple[str, ...] = BASELINES
    fit_tokens: int | None = 30000
    tasks: tuple[str, ...] = ("mmlu", "triviaqa", "truthfulqa_mc1")
    task_limit: dict = field(default_factory=lambda: {"mmlu": 20, "triviaqa": 1000, "truthfulqa_mc1": None})
    mmlu_subjects: list[str] | None = None  # None: all 57
    bootstrap: int = 1000
    seed: int = 0


@dataclass
class ScalingPlan:
    """How the result moves with training data: the same methods at the learning rates the main run chose."""

    sizes: tuple[tuple[str, int], ...] = (("alpaca_cleaned", 2000), ("alpaca_cleaned", 5000))
    methods: tuple[str, ...] = ("ats", "ats-top-label", "selective-temperature")
    lrs: dict = field(default_factory=dict)  # method -> lr (the main run's choice)
    data: DataConfig = field(default_factory=lambda: DataConfig(pack=2048))
    training: TrainingConfig = field(default_factory=lambda: TrainingConfig(batch_size=2, micro_batch_size=1))
    tasks: tuple[str, ...] = ("mmlu", "triviaqa", "truthfulqa_gen")
    task_limit: dict = field(default_factory=lambda: {"mmlu": 10, "triviaqa": 400, "truthfulqa_gen": 300})
    bootstrap: int = 1000
    seed: int = 0


@dataclass
class AblationPlan:
    """The ablations on one feature cache: which ablations, the tasks, the base training options of every head."""

    tasks: list = field(default_factory=list)  # task specs or Task objects
    task_limit: object = None  # an int for every task, or spec -> int ('mc' for every mc:PATH)
    ablations: tuple[str, ...] = ABLATIONS
    training: TrainingConfig = field(default_factory=TrainingConfig)
    n_bins: int = 15
    bootstrap: int = 0
    seed: int = 0
    task_options: dict | None = None  # registered task name -> constructor options


@dataclass
class AlignmentPlan:
    """Aligned chat model vs. base model: per backbone one ATS head on the same data, on the same tasks."""

    tasks: list = field(default_factory=list)  # task specs or Task objects
    task_limit: object = None
    data: DataConfig | None = None  # None: DataConfig()
    training: TrainingConfig = field(default_factory=TrainingConfig)
    n_bins: int = 15
    seed: int = 0
    task_options: dict | None = None
