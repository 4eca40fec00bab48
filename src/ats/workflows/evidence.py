"""The evidence experiment: does a per-token temperature beat simpler controls on tasks it never saw?

Protocol, fixed before any task is looked at:

1. Features of the instruction data (train / held-out split), packed so the head sees the positions of long prompts.
2. Model selection that never sees a task: every trained method (the ATS head, the ATS head with our top-label
   objective, and the two controls) is trained once per learning rate of the grid; the one with the lowest value of
   its own training objective on the held-out instruction split is kept. The grid, the criterion and the values go
   into the results.
3. Trade-off heads at the learning rate chosen for ATS: the selective loss at other alphas and plain NLL, one point
   each in the token-ECE vs task-ECE figure.
4. Baselines fitted on the same training tokens.
5. Every method on the held-out tokens and on the tasks, with bootstrap intervals and paired differences of ATS
   (and of the top-label head) minus every other method on the same questions.
"""

from __future__ import annotations

import logging
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

import matplotlib
from matplotlib.figure import Figure

from ..calibrators.base import Uncalibrated
from ..evaluation.evaluate import evaluate
from ..evaluation.metrics import summarize
from ..evaluation.plots import STYLE, save_figure
from ..evaluation.report import TASK_LABELS, jsonable, markdown_table
from ..evaluation.tasks import build_tasks
from ..evaluation.token_eval import token_confidences
from ..io import read_json, write_json
from ..model.backbone import Backbone
from ..training.config import TrainingConfig
from ..training.data import DataConfig
from .pipeline import BASELINES, fit_calibrators, prepare_features, train_head

logger = logging.getLogger(__name__)

# name -> (registry method, overrides of the training config): the methods whose learning rate is selected
SELECTED = {
    "ats": ("ats", {}),
    "ats-top-label": ("ats", {"loss_type": "top-label"}),
    "selective-temperature": ("selective-temperature", {}),
    "selective-linear": ("selective-linear", {}),
}
# name -> overrides, trained at the learning rate chosen for "ats": the points of the trade-off figure
TRADEOFF = {
    "selective-a0.1": {"alpha": 0.1},
    "selective-a0.3": {"alpha": 0.3},
    "selective-a0.7": {"alpha": 0.7},
    "selective-a0.9": {"alpha": 0.9},
    "nll": {"loss_type": "none"},
}
CRITERION = ("the method's own training objective (its loss type, alpha and weighting) averaged over the response "
             "tokens of the held-out instruction split after the last epoch; lowest wins")


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


def select_learning_rates(backbone: Backbone, train_store, val_store, out: Path, plan: EvidencePlan, *,
                          overwrite: bool = False, progress: bool = True) -> tuple[dict, dict]:
    """Train each selected method at every learning rate of the grid; keep the lowest held-out objective.

    Args:
        backbone: the frozen backbone.
        train_store: the training features.
        val_store: the held-out features (the selection criterion is computed on them).
        out: the run folder (heads go to `out/heads/<name>/lr<lr>`).
        plan: gives the methods, the grid and the training options.
        overwrite: replace heads made with other options instead of refusing.
        progress: show progress bars.

    Returns:
        (name -> chosen head, the selection record: per method the grid rows {lr, objective, val_token_ece},
        "chosen_lr" and the training "overrides").

    Raises:
        ATSError: if a saved head was made with other options (without `overwrite`) or training fails.
    """
    chosen, record = {}, {}
    for name in plan.selected:
        method, overrides = SELECTED[name]
        rows = []
        heads = {}
        for lr in plan.lr_grid:
            folder = out / "heads" / name / f"lr{lr:g}"
            heads[lr] = train_head(backbone, train_store, val_store, folder, method=method, label=name,
                                   training=plan.training.replace(lr=lr, **overrides), overwrite=overwrite,
                                   progress=progress)
            last = read_json(folder / "training_history.json")["epochs"][-1]
            rows.append({"lr": lr, "objective": last["objective"], "val_token_ece": last["ece"]})
        best = min(rows, key=lambda r: r["objective"])
        chosen[name] = heads[best["lr"]]
        record[name] = {"grid": rows, "chosen_lr": best["lr"], "overrides": overrides}
        logger.info("%s: lr %g chosen (held-out objective %.5f)", name, best["lr"], best["objective"])
    return chosen, record


def tradeoff_figure(token_level: dict, tasks: dict, points: list[str], stem: Path) -> list[Path]:
    """Token-level ECE (held-out instruction tokens) against task ECE, one panel per task, one point per
    objective / alpha; the uncalibrated model as a reference.

    Args:
        token_level: method -> token-level metrics.
        tasks: task -> method -> metrics.
        points: the methods to plot (those missing from either side are skipped).
        stem: the figure's path without suffix.

    Returns:
        [the .png path, the .pdf path].
    """
    task_names = list(tasks)
    with matplotlib.rc_context(STYLE):
        fig = Figure(figsize=(3.0 * len(task_names) + 0.4, 3.0), layout="constrained")
        axes = fig.subplots(1, len(task_names), squeeze=False)[0]
        for ax, task in zip(axes, task_names):
            for name in ["uncalibrated", *points]:
                if name not in token_level or name not in tasks[task]:
                    continue
                x, y = token_level[name]["ece"], tasks[task][name]["ece"]
                marker = "s" if name == "uncalibrated" else "*" if name == "ats-top-label" else "o"
                ax.scatter([x], [y], marker=marker, s=30)
                ax.annotate(name, (x, y), fontsize=6, xytext=(3, 3), textcoords="offset points")
            ax.set_title(TASK_LABELS.get(task, task))
            ax.set_xlabel("held-out token ECE")
            ax.set_ylabel("task ECE")
            ax.set_xlim(left=0)
            ax.set_ylim(bottom=0)
            ax.grid(alpha=0.3)
    return save_figure(fig, stem)


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
    out = Path(out_dir)
    train_store, val_store = prepare_features(backbone, out / "features", plan.data, overwrite=overwrite,
                                              progress=progress)
    chosen, selection = select_learning_rates(backbone, train_store, val_store, out, plan, overwrite=overwrite,
                                              progress=progress)
    tradeoff = {}
    ats_lr = selection["ats"]["chosen_lr"] if "ats" in selection else plan.training.lr
    for name in plan.tradeoff:
        tradeoff[name] = train_head(backbone, train_store, val_store, out / "heads" / name / f"lr{ats_lr:g}",
                                    label=name, training=plan.training.replace(lr=ats_lr, **TRADEOFF[name]),
                                    overwrite=overwrite, progress=progress)
    baselines = fit_calibrators(backbone, train_store, out / "baselines", plan.baselines, fit_tokens=plan.fit_tokens,
                                overwrite=overwrite, progress=progress)
    calibrators = {"uncalibrated": Uncalibrated(), **chosen, **tradeoff, **baselines}
    for calibrator in calibrators.values():
        calibrator.to(backbone.device)
    token = token_confidences(val_store, backbone, calibrators, progress=progress)
    token_level = jsonable({name: summarize(*value) for name, value in token.items()})
    built = build_tasks(plan.tasks, plan.task_limit, seed=plan.seed,
                        task_options={"mmlu": {"subjects": plan.mmlu_subjects}} if plan.mmlu_subjects else None)
    references = tuple(r for r in ("ats", "ats-top-label") if r in calibrators)
    tasks = evaluate(backbone, calibrators, built, out / "eval", bootstrap=plan.bootstrap, seed=plan.seed,
                     references=references, overwrite=overwrite, progress=progress)
    figures = [p.name for p in tradeoff_figure(token_level, tasks, ["ats", *plan.tradeoff, "ats-top-label",
                                                                    "selective-temperature", "selective-linear"],
                                               out / "tradeoff")]
    result = jsonable({
        "plan": {**asdict(plan), "data": plan.data.to_dict(), "training": plan.training.to_dict()},
        "criterion": CRITERION, "selection": selection, "token_level": token_level, "tasks": tasks,
        "train_sequences": len(train_store), "train_response_tokens": train_store.meta["response_tokens"],
        "val_response_tokens": val_store.meta["response_tokens"], "figures": figures,
        "fit_seconds": {n: read_json(out / "baselines" / n / "fit_seconds.json")["seconds"]
                        for n in plan.baselines if (out / "baselines" / n / "fit_seconds.json").exists()},
    })
    write_json(out / "evidence.json", result)
    return result


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
        plan: the sizes, methods, their learning rates (`plan.lrs` must name every method) and tasks.
        overwrite: replace results made with other options instead of refusing.
        progress: show progress bars.

    Returns:
        {"sizes": "<source>-<limit>" -> {"train_response_tokens", "val_response_tokens", "token_level"},
        "tasks": task -> "<method>@<source>-<limit>" (or "uncalibrated") -> metrics}.

    Raises:
        ATSError: if a step's stored results were made with other options (without `overwrite`) or a step fails.
    """
    out = Path(out_dir)
    calibrators: dict = {"uncalibrated": Uncalibrated()}
    sizes = {}
    for source, limit in plan.sizes:
        tag = size_tag(source, limit)
        work = out / tag
        train_store, val_store = prepare_features(backbone, work / "features",
                                                  plan.data.replace(source=source, limit=limit),
                                                  overwrite=overwrite, progress=progress)
        heads = {"uncalibrated": calibrators["uncalibrated"]}
        for name in plan.methods:
            method, overrides = SELECTED[name]
            heads[name] = train_head(
                backbone, train_store, val_store, work / "heads" / name, method=method, label=name,
                training=plan.training.replace(lr=plan.lrs[name], **overrides), overwrite=overwrite,
                progress=progress).to(backbone.device)
            calibrators[f"{name}@{tag}"] = heads[name]
        token = token_confidences(val_store, backbone, heads, progress=progress)
        sizes[tag] = jsonable({
            "train_response_tokens": train_store.meta["response_tokens"],
            "val_response_tokens": val_store.meta["response_tokens"],
            "token_level": {name: summarize(*value) for name, value in token.items()}})
    built = build_tasks(plan.tasks, plan.task_limit, seed=plan.seed)
    references = tuple(f"ats@{size_tag(*size)}" for size in plan.sizes if "ats" in plan.methods)
    tasks = evaluate(backbone, calibrators, built, out / "eval", bootstrap=plan.bootstrap, seed=plan.seed,
                     references=references, overwrite=overwrite, progress=progress)
    results = {"sizes": sizes, "tasks": tasks}
    write_json(out / "scaling.json", {"plan": jsonable({**asdict(plan), "data": plan.data.to_dict(),
                                                        "training": plan.training.to_dict()}), **results})
    return results
