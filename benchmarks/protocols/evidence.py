"""The evidence experiment: does a per-token temperature beat simpler controls on tasks it never saw?

Protocol, fixed before any task is looked at:

1. Features of the instruction data (train / held-out split), packed so the head sees the positions of long prompts.
2. Model selection that never sees a task: every trained method (the ATS head, the ATS head with our top-label
   objective, and the two controls: `SELECTED`) is trained once per learning rate of the grid; the one with the
   lowest value of its own training objective on the held-out instruction split is kept. The grid, the criterion and
   the values go into the results.
3. Trade-off heads at the learning rate chosen for ATS (`TRADEOFF`): the selective loss at other alphas and plain
   NLL, one point each in the token-ECE vs task-ECE figure.
4. Baselines fitted on the same training tokens.
5. Every method on the held-out tokens and on the tasks, with bootstrap intervals and paired differences of ATS
   (and of the top-label head) minus every other method on the same questions.
"""

from __future__ import annotations

import logging
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ats.calibrators.base import Uncalibrated
from ats.errors import ATSError
from ats.evaluation.plots import tradeoff_figure
from ats.evaluation.report import jsonable, markdown_table
from ats.evaluation.tasks import build_tasks
from ats.io import read_json
from ats.model.backbone import Backbone
from ats.training.config import TrainingConfig
from ats.training.data import DataConfig
from ats.workflows.pipeline import BASELINES
from ats.workflows.runner import REFERENCE, HeadJob, Runner

logger = logging.getLogger(__name__)

__all__ = ["CRITERION", "SELECTED", "TRADEOFF", "EvidencePlan", "ScalingPlan", "head_job", "plan_record",
           "run_evidence", "run_scaling", "select_learning_rates", "selection_table", "size_tag"]

CRITERION = ("the method's own training objective (its loss type, alpha and weighting) averaged over the response "
             "tokens of the held-out instruction split after the last epoch; lowest wins")

# name -> (the registry method trained, the training options it changes); each head records its name as its method
SELECTED = {  # the methods whose learning rate is selected on the held-out instruction split
    "ats": ("ats", {}),
    "ats-top-label": ("ats", {"loss_type": "top-label"}),
    "selective-temperature": ("selective-temperature", {}),
    "selective-linear": ("selective-linear", {}),
}
TRADEOFF = {  # the trade-off figure's points: the selective loss at other alphas, and plain NLL
    **{f"selective-a{a:g}": ("ats", {"alpha": a}) for a in (0.1, 0.3, 0.7, 0.9)},
    "nll": ("ats", {"loss_type": "none"}),
}


def head_job(group: dict, name: str, folder: str | Path, base: TrainingConfig, **changes) -> HeadJob:
    """The head `name` of `group` (`SELECTED` or `TRADEOFF`) in `folder`, trained with `base` plus its options plus
    `changes` (e.g. the learning rate).

    Raises:
        ATSError: naming the known names, if `group` has no such head.
    """
    if name not in group:
        raise ATSError(f"unknown head {name!r}; known: {', '.join(group)}")
    method, options = group[name]
    return HeadJob(name, str(folder), base.replace(**{**options, **changes}), method=method, label=name)


def plan_record(plan) -> dict:
    """A plan as JSON-ready data: every field, nested configs as dicts, tuples as lists."""
    return jsonable(asdict(plan))


@dataclass
class EvidencePlan:
    """The evidence experiment's settings: data, training, the learning-rate grid, the methods, tasks and bootstrap."""

    data: DataConfig = field(default_factory=lambda: DataConfig(pack=2048))
    training: TrainingConfig = field(default_factory=lambda: TrainingConfig(batch_size=2, micro_batch_size=1))
    lr_grid: tuple[float, ...] = (3e-4, 1e-3, 3e-3)
    selected: tuple[str, ...] = tuple(SELECTED)
    tradeoff: tuple[str, ...] = tuple(TRADEOFF)
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


def select_learning_rates(runner: Runner, train_store, val_store, plan: EvidencePlan) -> tuple[dict, dict]:
    """Train each selected method at every learning rate of the grid; keep the lowest held-out objective.

    Args:
        runner: the run's steps (heads go to `heads/<name>/lr<lr>` of its folder).
        train_store: the training features.
        val_store: the held-out features (the selection criterion is computed on them).
        plan: gives the methods, the grid and the training options.

    Returns:
        (name -> chosen head, the selection record: per method the grid rows {lr, objective, val_token_ece},
        "chosen_lr" and the training "overrides").

    Raises:
        ATSError: if a method is not in `SELECTED`, a saved head was made with other options (without
            `overwrite`) or training fails.
    """
    chosen, record = {}, {}
    for name in plan.selected:
        jobs = {lr: head_job(SELECTED, name, Path("heads") / name / f"lr{lr:g}", plan.training, lr=lr)
                for lr in plan.lr_grid}
        heads = {lr: runner.heads([job], train_store, val_store)[0][name] for lr, job in jobs.items()}
        rows = []
        for lr, job in jobs.items():
            last = read_json(runner.out / job.folder / "training_history.json")["epochs"][-1]
            rows.append({"lr": lr, "objective": last["objective"], "val_token_ece": last["ece"]})
        best = min(rows, key=lambda r: r["objective"])
        chosen[name] = heads[best["lr"]]
        record[name] = {"grid": rows, "chosen_lr": best["lr"], "overrides": SELECTED[name][1]}
        logger.info("%s: lr %g chosen (held-out objective %.5f)", name, best["lr"], best["objective"])
    return chosen, record


def run_evidence(backbone: Backbone, out_dir: str | Path, plan: EvidencePlan, *, overwrite: bool = False,
                 progress: bool = True) -> dict:
    """The whole protocol (module docstring); every step is reused on a rerun with the same options.

    Writes evidence.json, the trade-off figure and every step's folder under `out_dir`.

    Args:
        backbone: the frozen backbone.
        out_dir: the run folder.
        plan: the settings.
        overwrite: replace results made with other options instead of refusing.
        progress: show progress bars.

    Returns:
        What evidence.json holds: the plan, the criterion, the selection, token-level and task metrics, sizes,
        figure names and the baselines' fit seconds.

    Raises:
        ATSError: if a step's stored results were made with other options (without `overwrite`) or a step fails.
    """
    runner = Runner(backbone, out_dir, overwrite=overwrite, progress=progress)
    out = runner.out
    train_store, val_store = runner.features(plan.data)
    chosen, selection = select_learning_rates(runner, train_store, val_store, plan)
    ats_lr = selection["ats"]["chosen_lr"] if "ats" in selection else plan.training.lr
    tradeoff, _ = runner.heads([head_job(TRADEOFF, name, Path("heads") / name / f"lr{ats_lr:g}", plan.training,
                                         lr=ats_lr) for name in plan.tradeoff],
                               train_store, val_store)
    baselines = runner.baselines(plan.baselines, train_store, fit_tokens=plan.fit_tokens)
    calibrators = {REFERENCE: Uncalibrated(), **chosen, **tradeoff, **baselines}
    token_level = jsonable(runner.token_level(val_store, calibrators))
    built = build_tasks(plan.tasks, plan.task_limit, seed=plan.seed,
                        task_options={"mmlu": {"subjects": plan.mmlu_subjects}} if plan.mmlu_subjects else None)
    references = tuple(r for r in ("ats", "ats-top-label") if r in calibrators)
    tasks = runner.tasks(calibrators, built, bootstrap=plan.bootstrap, seed=plan.seed, references=references)
    points = ["ats", *plan.tradeoff, "ats-top-label", "selective-temperature", "selective-linear"]
    figures = [p.name for p in tradeoff_figure(token_level, tasks, points, out / "tradeoff")]
    return runner.write("evidence.json", {
        "plan": plan_record(plan), "criterion": CRITERION, "selection": selection, "token_level": token_level,
        "tasks": tasks, "train_sequences": len(train_store),
        "train_response_tokens": train_store.meta["response_tokens"],
        "val_response_tokens": val_store.meta["response_tokens"], "figures": figures,
        "fit_seconds": {n: read_json(out / "baselines" / n / "fit_seconds.json")["seconds"]
                        for n in plan.baselines if (out / "baselines" / n / "fit_seconds.json").exists()},
    })


def selection_table(selection: dict) -> str:
    """Markdown: method | lr | held-out objective | held-out token ECE | chosen.

    Args:
        selection: the selection record from `select_learning_rates`.

    Returns:
        The markdown table, one row per method and learning rate.
    """
    rows = [[name, f"{row['lr']:g}", f"{row['objective']:.5f}", f"{row['val_token_ece']:.3f}",
             "yes" if math.isclose(row["lr"], record["chosen_lr"]) else ""]
            for name, record in selection.items() for row in record["grid"]]
    return markdown_table(["method", "lr", "held-out objective", "held-out token ECE", "chosen"], rows,
                          text_columns=1)


def size_tag(source: str, limit: int) -> str:
    """The name of one data size: "<source>-<limit>"."""
    return f"{source}-{limit}"


def run_scaling(backbone: Backbone, out_dir: str | Path, plan: ScalingPlan, *, overwrite: bool = False,
                progress: bool = True) -> dict:
    """Per data size: features, the heads at their fixed learning rates and the held-out tokens; then every size's
    heads on the tasks in one shared pass (the backbone runs once per question, not once per size), with paired
    differences of each size's ATS head minus every other method. Each size's work lives in
    out_dir/<source>-<limit>/, the shared task results in out_dir/eval/.

    Args:
        backbone: the frozen backbone.
        out_dir: the run folder; scaling.json is written there.
        plan: the sizes, methods (of `SELECTED`), their learning rates (`plan.lrs` must name every method)
            and tasks.
        overwrite: replace results made with other options instead of refusing.
        progress: show progress bars.

    Returns:
        {"sizes": "<source>-<limit>" -> {"train_response_tokens", "val_response_tokens", "token_level"},
        "tasks": task -> "<method>@<source>-<limit>" (or "uncalibrated") -> metrics}.

    Raises:
        ATSError: if a step's stored results were made with other options (without `overwrite`) or a step fails.
    """
    runner = Runner(backbone, out_dir, overwrite=overwrite, progress=progress)
    calibrators: dict = {REFERENCE: Uncalibrated()}
    sizes = {}
    for source, limit in plan.sizes:
        tag = size_tag(source, limit)
        jobs = [head_job(SELECTED, name, Path(tag) / "heads" / name, plan.training, lr=plan.lrs[name])
                for name in plan.methods]
        arm = runner.arm(plan.data.replace(source=source, limit=limit), jobs, folder=tag)
        calibrators.update({f"{name}@{tag}": arm.calibrators[name] for name in plan.methods})
        sizes[tag] = {"train_response_tokens": arm.train.meta["response_tokens"],
                      "val_response_tokens": arm.val.meta["response_tokens"], "token_level": arm.token_level}
    built = build_tasks(plan.tasks, plan.task_limit, seed=plan.seed)
    references = tuple(f"ats@{size_tag(*size)}" for size in plan.sizes if "ats" in plan.methods)
    tasks = runner.tasks(calibrators, built, bootstrap=plan.bootstrap, seed=plan.seed, references=references)
    record = runner.write("scaling.json", {"plan": plan_record(plan), "sizes": sizes, "tasks": tasks})
    return {"sizes": record["sizes"], "tasks": tasks}
