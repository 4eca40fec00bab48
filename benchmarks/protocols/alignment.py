"""Calibration of an aligned chat model beside a pre-trained base model, before and after ATS, on the same tasks.

Per backbone: features on the same instruction data, one ATS head (the given training config), and uncalibrated vs.
ATS on the tasks and on the held-out instruction tokens (one runner arm each). Each model's work lives in
out_dir/<model>/ (features, head, eval) and is reused on a rerun with the same options.
"""

from __future__ import annotations

import gc
import logging
from pathlib import Path

from ats.evaluation.report import TASK_LABELS, cell, jsonable, markdown_table
from ats.evaluation.tasks import build_tasks
from ats.io import atomic_file, write_json
from ats.model.backbone import load_backbone
from ats.training.config import TrainingConfig
from ats.training.data import DataConfig
from ats.workflows.ablate import VAL_TASK, task_order
from ats.workflows.runner import HeadJob, Runner

logger = logging.getLogger(__name__)

ALIGNMENT_METRICS = (("Acc", "accuracy"), ("ECE", "ece"), ("Brier", "brier"))


def format_alignment_table(results: dict) -> str:
    """Rows = model x method, columns = task x {Acc, ECE, Brier}.

    Args:
        results: model -> task -> method -> metrics.

    Returns:
        The markdown table (tasks first, the token-level column last).
    """
    tasks = list(dict.fromkeys(t for per_model in results.values() for t in task_order(per_model)))
    header = ["model", "method"] + [f"{TASK_LABELS.get(t, t)} {label}" for t in tasks
                                    for label, _ in ALIGNMENT_METRICS]
    body = []
    for model, per_model in results.items():
        for method in dict.fromkeys(m for t in per_model.values() for m in t):
            body.append([model, method] + [cell(per_model.get(t, {}).get(method), key, ci=False)
                                           for t in tasks for _, key in ALIGNMENT_METRICS])
    return markdown_table(header, body, text_columns=2)


def run_alignment(models: list, out_dir: str | Path, *, tasks: list, task_limit=None,
                  data: DataConfig | None = None, training: TrainingConfig | None = None, device: str | None = None,
                  n_bins: int = 15, seed: int = 0, task_options: dict | None = None, overwrite: bool = False,
                  progress: bool = True) -> dict:
    """Per backbone (an embedded name, a path or Hub id, or a loaded Backbone): uncalibrated vs. ATS on `tasks` and
    on held-out tokens. Writes out_dir/alignment.md and alignment.json.

    Args:
        models: backbone names / paths / Hub ids, or loaded Backbones.
        out_dir: the folder holding one subfolder per model.
        tasks: task specs or Task objects.
        task_limit: an int for every task, or spec -> int (see `build_tasks`).
        data: the data options; default `DataConfig()`.
        training: the training options of every head; default `TrainingConfig()`.
        device: where a backbone given by name is loaded.
        n_bins: equal-width bins of the ECE.
        seed: the seed of the task subsets.
        task_options: registered task name -> constructor options (e.g. {"mmlu": {"n_shots": 0}}).
        overwrite: replace results made with other options instead of refusing.
        progress: show progress bars.

    Returns:
        What alignment.json holds ({"settings", "results": model -> task -> method -> metrics}) plus "table",
        the markdown table.

    Raises:
        ATSError: if a step's stored results were made with other options (without `overwrite`) or a step fails.
    """
    training = training or TrainingConfig()
    out_dir = Path(out_dir)
    results: dict = {}
    names = []
    for model in models:
        backbone = load_backbone(model, device=device) if isinstance(model, str) else model
        name = str(model) if isinstance(model, str) else backbone.name
        names.append(name)
        logger.info("alignment: %s", name)
        runner = Runner(backbone, out_dir / Path(name).name.replace(":", "_"), overwrite=overwrite,
                        progress=progress)
        arm = runner.arm(data, [HeadJob("ats", "head", training)], n_bins=n_bins)
        built = build_tasks(tasks, task_limit, seed=seed, task_options=task_options)
        per_model = runner.tasks(arm.calibrators, built, n_bins=n_bins, seed=seed)
        per_model[VAL_TASK] = arm.token_level
        results[name] = jsonable(per_model)
        del backbone, runner, arm
        gc.collect()
    table = format_alignment_table(results)
    with atomic_file(out_dir / "alignment.md") as f:
        f.write(f"## Calibration before / after ATS: aligned chat model vs. base model\n\n{table}\n")
    summary = jsonable({"settings": {"models": names, "training": training.to_dict(), "task_limit": task_limit,
                                     "seed": seed, "data": data.to_dict() if data else None},
                        "results": results})
    write_json(out_dir / "alignment.json", summary)
    return {**summary, "table": table}
