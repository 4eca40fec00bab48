"""Ablations of ATS on one set of extracted features: smoothing type, smoothing weight alpha, head architecture.

    smoothing   none / full / selective                  (transformer head, alpha 0.5)
    alpha       0.1 / 0.3 / 0.5 / 0.7 / 0.9              (selective loss, transformer head)
    head        constant / linear / mlp / transformer    (selective loss, alpha 0.5)

A configuration that appears in several ablations (selective / 0.5 / transformer appears in all three) is trained
once. Every head is trained with `pipeline.train_head` into `out_dir/heads/<name>` and reused when it is already
there with the same options. All heads (and the uncalibrated model) are evaluated together (one backbone pass per
task example for all of them) and token by token on the held-out instruction split.

Output in `out_dir`:

    heads/<name>/                 the trained heads (calibrator_config.json + model.safetensors + fingerprint)
    eval/                         evaluate()'s per-task files, results.json / results.md, reliability diagrams
    <ablation>.md                 one markdown table per ablation: ECE and Brier per task + token-level validation
    ablations.json                settings, configurations, every number
    ece_vs_alpha.png / .pdf       ECE against alpha, one line per task (dashed: uncalibrated)
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from pathlib import Path

import matplotlib
from matplotlib.figure import Figure

from ..calibrators.base import Uncalibrated
from ..errors import ATSError
from ..evaluation.evaluate import evaluate
from ..evaluation.metrics import summarize
from ..evaluation.plots import STYLE, save_figure
from ..evaluation.report import TASK_LABELS, cell, jsonable, markdown_table
from ..evaluation.tasks import build_tasks
from ..evaluation.token_eval import token_confidences
from ..io import atomic_file, write_json
from ..model.heads import HEAD_TYPES
from ..training.config import TrainingConfig
from .pipeline import fit_head

ABLATIONS = ("smoothing", "alpha", "head")
ALPHAS = (0.1, 0.3, 0.5, 0.7, 0.9)
REFERENCE = "uncalibrated"
VAL_TASK = "val_tokens"  # the token-level column of the tables
ABLATION_METRICS = (("ECE", "ece"), ("Brier", "brier"))


@dataclass(frozen=True)
class HeadRun:
    """One ATS training configuration; `name` is its folder under heads/ and its method name in evaluate()."""

    head_type: str = "transformer"
    loss_type: str = "selective"
    alpha: float = 0.5

    @property
    def name(self) -> str:
        """The folder and method name: "<head>-<loss>-a<alpha>" ("<head>-<loss>" for losses without alpha)."""
        base = f"{self.head_type}-{self.loss_type}"
        return base if self.loss_type in ("none", "top-label") else f"{base}-a{self.alpha:g}"  # alpha unused there


def ablation_plan(ablations=ABLATIONS) -> dict[str, list[tuple[str, HeadRun]]]:
    """Ablation -> its rows as (row label, configuration), in table order.

    Args:
        ablations: names from `ABLATIONS`, as a sequence or a comma-separated string.

    Returns:
        ablation -> [(row label, configuration)], ablations in the given order (repeats dropped).

    Raises:
        ATSError: if a name is unknown or none is given.
    """
    if isinstance(ablations, str):
        ablations = [a for a in ablations.split(",") if a]
    ablations = list(ablations)
    unknown = [a for a in ablations if a not in ABLATIONS]
    if unknown or not ablations:
        raise ATSError(f"ablations: unknown or empty {unknown or ablations!r}; known: {', '.join(ABLATIONS)}")
    rows = {
        "smoothing": [(loss, HeadRun(loss_type=loss)) for loss in ("none", "full", "selective")],
        "alpha": [(f"{a:g}", HeadRun(alpha=a)) for a in ALPHAS],
        "head": [(head, HeadRun(head_type=head)) for head in HEAD_TYPES],
    }
    return {a: rows[a] for a in dict.fromkeys(ablations)}


def unique_runs(plan: dict[str, list[tuple[str, HeadRun]]]) -> list[HeadRun]:
    """Every configuration the plan needs, each once, in first-appearance order.

    Args:
        plan: as `ablation_plan` returns it.

    Returns:
        The distinct configurations.
    """
    return list(dict.fromkeys(run for rows in plan.values() for _, run in rows))


def task_order(results: dict) -> list[str]:
    """Tasks first, the token-level column last.

    Args:
        results: task -> method -> metrics (may hold `VAL_TASK`).

    Returns:
        The task names.
    """
    return [t for t in results if t != VAL_TASK] + ([VAL_TASK] if VAL_TASK in results else [])


def format_ablation_table(rows: list[tuple[str, str]], results: dict, *, first: str = "setting") -> str:
    """Markdown: one row per (label, method) plus the uncalibrated reference; ECE / Brier per task.

    Args:
        rows: (row label, method name) pairs.
        results: task -> method -> metrics.
        first: the first column's header.

    Returns:
        The markdown table.
    """
    tasks = task_order(results)
    header = [first, "run"] + [f"{TASK_LABELS.get(t, t)} {label}" for t in tasks for label, _ in ABLATION_METRICS]
    body = []
    for label, method in [(REFERENCE, REFERENCE), *rows]:
        body.append([label, method if method != REFERENCE else "-"] +
                    [cell(results[t].get(method), key, ci=False) for t in tasks for _, key in ABLATION_METRICS])
    return markdown_table(header, body, text_columns=2)


def alpha_figure(rows: list[tuple[str, str]], results: dict, stem: str | Path) -> list[Path]:
    """ECE against alpha, one line per task (dashed, same colour: the uncalibrated model); PNG + PDF.

    Args:
        rows: (alpha as text, method name) pairs.
        results: task -> method -> metrics.
        stem: the figure's path without suffix.

    Returns:
        [the .png path, the .pdf path].
    """
    alphas = [float(label) for label, _ in rows]
    with matplotlib.rc_context(STYLE):
        fig = Figure(figsize=(4.2, 3.0), layout="constrained")
        ax = fig.add_subplot()
        colours = matplotlib.rcParams["axes.prop_cycle"].by_key()["color"]
        for i, task in enumerate(task_order(results)):
            colour = colours[i % len(colours)]
            ys = [results[task].get(method, {}).get("ece") for _, method in rows]
            ax.plot(alphas, [math.nan if y is None else y for y in ys], marker="o", color=colour,
                    label=TASK_LABELS.get(task, task))
            ref = results[task].get(REFERENCE, {}).get("ece")
            if ref is not None and math.isfinite(ref):
                ax.axhline(ref, color=colour, linestyle="--", linewidth=0.8, alpha=0.7)
        ax.set_xlabel(r"smoothing weight $\alpha$ (selective loss)")
        ax.set_ylabel("ECE")
        ax.set_xticks(alphas)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend(title="dashed: uncalibrated", title_fontsize=7, frameon=False)
    return save_figure(fig, stem)


def train_runs(backbone, train_store, val_store, out_dir: Path, runs: list[HeadRun], training: TrainingConfig, *,
               overwrite: bool = False, progress: bool = True) -> tuple[dict, dict]:
    """Train (or reuse) every configuration; returns (method -> calibrator, method -> run record).

    Args:
        backbone: the frozen backbone.
        train_store: the training features.
        val_store: the held-out features.
        out_dir: the run folder (heads go to `out_dir/heads/<name>`).
        runs: the configurations.
        training: the base training options (loss type and alpha replaced per configuration).
        overwrite: replace heads made with other options instead of refusing.
        progress: show progress bars.

    Returns:
        (method -> calibrator, the uncalibrated reference included; method -> {configuration, "dir", "trained_now",
        "training"}).

    Raises:
        ATSError: if a saved head was made with other options (without `overwrite`) or training fails.
    """
    calibrators: dict = {REFERENCE: Uncalibrated()}
    info: dict = {}
    for run in runs:
        config = training.replace(loss_type=run.loss_type, alpha=run.alpha)
        calibrator, reused = fit_head(backbone, train_store, val_store, out_dir / "heads" / run.name,
                                      head_type=run.head_type, training=config, overwrite=overwrite,
                                      progress=progress)
        calibrators[run.name] = calibrator.to(backbone.device)
        info[run.name] = {**asdict(run), "dir": f"heads/{run.name}", "trained_now": not reused,
                          "training": calibrator.config_.training}
    return calibrators, info


def run_ablations(backbone, train_store, val_store, out_dir: str | Path, *, tasks: list, task_limit=None,
                  ablations=ABLATIONS, training: TrainingConfig | None = None, n_bins: int = 15, bootstrap: int = 0,
                  seed: int = 0, task_options: dict | None = None, overwrite: bool = False,
                  progress: bool = True) -> dict:
    """Train every configuration the ablations need (each once, reused from out_dir/heads on a rerun), evaluate
    them on `tasks` and token by token on `val_store`, and write the tables, ablations.json and the alpha figure.

    Args:
        backbone: the frozen backbone.
        train_store: the training features.
        val_store: the held-out features, or None (no token-level column).
        out_dir: the run folder (layout in the module docstring).
        tasks: task specs ('mmlu', 'triviaqa', 'truthfulqa_mc1', 'mc:PATH', ...) or Task objects.
        task_limit: an int for every task, or spec -> int ('mc' for every mc:PATH).
        ablations: which ablations, as for `ablation_plan`.
        training: the TrainingConfig of every head (its loss type and alpha replaced per configuration).
        n_bins: equal-width bins of the ECE.
        bootstrap: bootstrap resamples for the task metrics; 0: none.
        seed: the seed of the task subsets.
        task_options: registered task name -> constructor options (e.g. {"mmlu": {"n_shots": 0}}).
        overwrite: replace results made with other options instead of refusing.
        progress: show progress bars.

    Returns:
        What ablations.json holds, plus the tables' markdown ("tables").

    Raises:
        ATSError: if an ablation is unknown, stored results were made with other options (without `overwrite`),
            or a step fails.
    """
    out_dir = Path(out_dir)
    plan = ablation_plan(ablations)
    training = training or TrainingConfig()
    calibrators, run_info = train_runs(backbone, train_store, val_store, out_dir, unique_runs(plan), training,
                                       overwrite=overwrite, progress=progress)
    built = build_tasks(tasks, task_limit, seed=seed, task_options=task_options)
    results: dict = {}
    if built:
        results = evaluate(backbone, calibrators, built, out_dir / "eval", n_bins=n_bins, bootstrap=bootstrap,
                           seed=seed, references=(), overwrite=overwrite, progress=progress)
    if val_store is not None and val_store.meta.get("response_tokens", 1) > 0:
        token = token_confidences(val_store, backbone, calibrators, progress=progress)
        results[VAL_TASK] = {name: summarize(conf, correct, n_bins=n_bins) for name, (conf, correct) in token.items()}
    results = jsonable(results)

    tables, files = {}, []
    for ablation, rows in plan.items():
        table = format_ablation_table([(label, run.name) for label, run in rows], results,
                                      first="alpha" if ablation == "alpha" else ablation)
        tables[ablation] = table
        with atomic_file(out_dir / f"{ablation}.md") as f:
            f.write(f"## Ablation: {ablation}\n\n{table}\n")
        files.append(f"{ablation}.md")
    if "alpha" in plan:
        files += [p.name for p in alpha_figure([(label, run.name) for label, run in plan["alpha"]], results,
                                               out_dir / "ece_vs_alpha")]
    summary = jsonable({
        "settings": {"training": training.to_dict(), "n_bins": n_bins, "seed": seed,
                     "tasks": [t.describe() for t in built], "task_limit": task_limit,
                     "backbone": backbone.describe(), "train_sequences": len(train_store),
                     "val_sequences": len(val_store) if val_store else 0,
                     "train_response_tokens": train_store.meta.get("response_tokens")},
        "runs": run_info,
        "ablations": {a: [{"row": label, "run": run.name} for label, run in rows] for a, rows in plan.items()},
        "results": results,
        "files": files,  # relative to out_dir
    })
    write_json(out_dir / "ablations.json", summary)
    return {**summary, "tables": tables}
