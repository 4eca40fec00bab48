"""Ablations of ATS on one set of extracted features: smoothing type, smoothing weight alpha, head architecture.

    smoothing   none / full / selective                  (transformer head, alpha 0.5)
    alpha       0.1 / 0.3 / 0.5 / 0.7 / 0.9              (selective loss, transformer head)
    head        constant / linear / mlp / transformer    (selective loss, alpha 0.5)

`ABLATIONS` says what each row changes of the shared configuration (`SHARED`). A configuration that appears in
several ablations (selective / 0.5 / transformer appears in all three) is trained once. Every head is trained by the
runner's heads step into `out_dir/heads/<name>` and reused when it is already there with the same options. All
heads (and the uncalibrated model) are evaluated together (one backbone pass per task example for all of them) and
token by token on the held-out instruction split.

Output in `out_dir`:

    heads/<name>/                 the trained heads (calibrator_config.json + model.safetensors + fingerprint)
    eval/                         evaluate()'s per-task files, results.json / results.md, reliability diagrams
    <ablation>.md                 one markdown table per ablation: ECE and Brier per task + token-level validation
    ablations.json                settings, configurations, every number
    ece_vs_alpha.png / .pdf       ECE against alpha, one line per task (dashed: uncalibrated)
"""

from __future__ import annotations

from pathlib import Path

from ..calibrators.base import Uncalibrated
from ..errors import ATSError
from ..evaluation.plots import alpha_figure
from ..evaluation.report import TASK_LABELS, cell, jsonable, markdown_table
from ..evaluation.tasks import build_tasks
from ..io import atomic_file
from ..training.config import TrainingConfig
from .configs import ABLATIONS, ALPHAS, SHARED
from .runner import REFERENCE, HeadJob, Runner

__all__ = ["ABLATIONS", "ALPHAS", "REFERENCE", "SHARED", "VAL_TASK", "ablation_plan", "format_ablation_table",
           "head_job", "run_ablations", "task_order", "unique_runs"]

VAL_TASK = "val_tokens"  # the token-level column of the tables
ABLATION_METRICS = (("ECE", "ece"), ("Brier", "brier"))
def head_job(training: TrainingConfig, *, head_type: str, loss_type: str, alpha: float) -> HeadJob:
    """The head of one configuration: named "<head>-<loss>-a<alpha>" ("<head>-<loss>" for the losses without alpha),
    trained in heads/<name> with `training`'s loss type and alpha replaced; it records the method "ats"."""
    name = f"{head_type}-{loss_type}"
    if loss_type not in ("none", "top-label"):  # alpha is unused there
        name = f"{name}-a{alpha:g}"
    return HeadJob(name, f"heads/{name}", training.replace(loss_type=loss_type, alpha=alpha), head_type=head_type)


def ablation_plan(ablations=tuple(ABLATIONS), training: TrainingConfig | None = None
                  ) -> dict[str, list[tuple[str, HeadJob]]]:
    """Ablation -> its rows as (row label, head job), in table order.

    Args:
        ablations: names from `ABLATIONS`, as a sequence or a comma-separated string.
        training: the training options of every head (loss type and alpha replaced per row); default
            `TrainingConfig()`.

    Returns:
        ablation -> [(row label, head job)], ablations in the given order (repeats dropped).

    Raises:
        ATSError: if a name is unknown or none is given.
    """
    if isinstance(ablations, str):
        ablations = [a for a in ablations.split(",") if a]
    ablations = list(ablations)
    unknown = [a for a in ablations if a not in ABLATIONS]
    if unknown or not ablations:
        raise ATSError(f"ablations: unknown or empty {unknown or ablations!r}; known: {', '.join(ABLATIONS)}")
    training = training or TrainingConfig()
    return {a: [(label, head_job(training, **{**SHARED, **change})) for label, change in ABLATIONS[a].items()]
            for a in dict.fromkeys(ablations)}


def unique_runs(plan: dict[str, list[tuple[str, HeadJob]]]) -> list[HeadJob]:
    """Every head the plan needs, each once, in first-appearance order.

    Args:
        plan: as `ablation_plan` returns it.

    Returns:
        The distinct head jobs.
    """
    return list({job.name: job for table in plan.values() for _, job in table}.values())


def task_order(results: dict) -> list[str]:
    """Tasks first, the token-level column last.

    Args:
        results: task -> method -> metrics (may hold `VAL_TASK`).

    Returns:
        The task names.
    """
    return [t for t in results if t != VAL_TASK] + ([VAL_TASK] if VAL_TASK in results else [])


def format_ablation_table(table_rows: list[tuple[str, str]], results: dict, *, first: str = "setting") -> str:
    """Markdown: one row per (label, method) plus the uncalibrated reference; ECE / Brier per task.

    Args:
        table_rows: (row label, method name) pairs.
        results: task -> method -> metrics.
        first: the first column's header.

    Returns:
        The markdown table.
    """
    tasks = task_order(results)
    header = [first, "run"] + [f"{TASK_LABELS.get(t, t)} {label}" for t in tasks for label, _ in ABLATION_METRICS]
    body = []
    for label, method in [(REFERENCE, REFERENCE), *table_rows]:
        body.append([label, method if method != REFERENCE else "-"] +
                    [cell(results[t].get(method), key, ci=False) for t in tasks for _, key in ABLATION_METRICS])
    return markdown_table(header, body, text_columns=2)


def run_record(job: HeadJob, training: dict, reused: bool) -> dict:
    """ablations.json's record of one configuration: head type, loss type, alpha, folder, whether trained now, and
    the head's training record."""
    return {"head_type": job.head_type, "loss_type": job.training.loss_type, "alpha": job.training.alpha,
            "dir": job.folder, "trained_now": not reused, "training": training}


def run_ablations(backbone, train_store, val_store, out_dir: str | Path, *, tasks: list, task_limit=None,
                  ablations=tuple(ABLATIONS), training: TrainingConfig | None = None, n_bins: int = 15,
                  bootstrap: int = 0, seed: int = 0, task_options: dict | None = None, overwrite: bool = False,
                  progress: bool = True) -> dict:
    """Train every configuration the ablations need (each once, reused from heads/ on a rerun), evaluate them on
    the tasks and token by token on `val_store`, and write the tables, ablations.json and the alpha figure.

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
    runner = Runner(backbone, out_dir, overwrite=overwrite, progress=progress)
    out_dir = runner.out
    training = training or TrainingConfig()
    tables_plan = ablation_plan(ablations, training)
    jobs = unique_runs(tables_plan)
    heads, reused = runner.heads(jobs, train_store, val_store)
    calibrators = {REFERENCE: Uncalibrated(), **heads}
    built = build_tasks(tasks, task_limit, seed=seed, task_options=task_options)
    results = runner.tasks(calibrators, built, n_bins=n_bins, bootstrap=bootstrap, seed=seed, references=())
    if val_store is not None and val_store.meta.get("response_tokens", 1) > 0:
        results[VAL_TASK] = runner.token_level(val_store, calibrators, n_bins=n_bins)
    results = jsonable(results)

    tables, files = {}, []
    for ablation, table_rows in tables_plan.items():
        table = format_ablation_table([(label, job.name) for label, job in table_rows], results,
                                      first="alpha" if ablation == "alpha" else ablation)
        tables[ablation] = table
        with atomic_file(out_dir / f"{ablation}.md") as f:
            f.write(f"## Ablation: {ablation}\n\n{table}\n")
        files.append(f"{ablation}.md")
    if "alpha" in tables_plan:
        files += [p.name for p in alpha_figure([(label, job.name) for label, job in tables_plan["alpha"]], results,
                                               out_dir / "ece_vs_alpha", tasks=task_order(results),
                                               reference=REFERENCE)]
    summary = runner.write("ablations.json", {
        "settings": {"training": training.to_dict(), "n_bins": n_bins, "seed": seed,
                     "tasks": [t.describe() for t in built], "task_limit": task_limit,
                     "backbone": runner.backbone.describe(), "train_sequences": len(train_store),
                     "val_sequences": len(val_store) if val_store else 0,
                     "train_response_tokens": train_store.meta.get("response_tokens")},
        "runs": {job.name: run_record(job, heads[job.name].config_.training, reused[job.name]) for job in jobs},
        "ablations": {a: [{"row": label, "run": job.name} for label, job in table_rows]
                      for a, table_rows in tables_plan.items()},
        "results": results,
        "files": files,  # relative to out_dir
    })
    return {**summary, "tables": tables}
