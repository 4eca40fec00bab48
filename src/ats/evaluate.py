"""Run tasks x calibrators and write the results: per-example files, results.json, results.md, reliability diagrams.

    out_dir/tasks/<task>.json     per-example confidence / correct of every method (+ the task's settings)
    out_dir/results.json          task -> method -> metrics.summarize(...) (accuracy, ECE, adaptive ECE, Brier, ...)
    out_dir/results.md            markdown table: rows = methods, columns = task x {Acc, ECE, Brier}
    out_dir/figures/<task>.png/.pdf   reliability diagrams, methods side by side

Each task runs the backbone once per example and applies every calibrator to that same forward. A finished task
file is reused when it holds every requested method for the same task settings and backbone, so an interrupted
evaluation can be repeated without redoing the finished tasks. (Reuse is keyed by method NAME: after refitting a
calibrator under the same name, delete the task files or use a fresh out_dir.)
"""

from __future__ import annotations

import logging
import math
import time
from pathlib import Path

from .calibrators.base import Calibrator
from .errors import ATSError
from .io import atomic_file, read_json, write_json
from .tasks import Task, TaskResult, build_task

logger = logging.getLogger(__name__)

TABLE_METRICS = (("Acc", "accuracy"), ("ECE", "ece"), ("Brier", "brier"))


def _backbone_id(backbone) -> dict:
    return {"name": str(getattr(backbone, "name", "?")), "revision": str(getattr(backbone, "revision", "?"))}


def _jsonable(value):
    """JSON-safe copy: NaN / inf -> None (strict JSON), tuples -> lists."""
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def _load_finished(path: Path, task: Task, backbone, methods: list[str]) -> dict[str, TaskResult] | None:
    """The per-example results stored in `path`, if they cover `methods` for this task and backbone."""
    if not path.is_file():
        return None
    try:
        data = read_json(path)
        if data.get("task") != _jsonable(task.describe()) or data.get("backbone") != _backbone_id(backbone):
            logger.info("%s: settings or backbone differ; re-running the task", path)
            return None
        stored = data.get("methods", {})
        if not all(m in stored for m in methods):
            return None
        return {m: TaskResult.from_dict(stored[m], where=str(path)) for m in methods}
    except (ATSError, AttributeError, TypeError) as err:
        logger.warning("%s: unreadable (%s); re-running the task", path, err)
        return None


def _save(path: Path, task: Task, backbone, results: dict[str, TaskResult], seconds: float) -> None:
    write_json(path, {"task": _jsonable(task.describe()), "backbone": _backbone_id(backbone),
                      "seconds": round(seconds, 3), "n": len(next(iter(results.values()))) if results else 0,
                      "methods": {m: _jsonable(r.to_dict()) for m, r in results.items()}})


def run_tasks(backbone, calibrators: dict[str, Calibrator], tasks: list[str | Task], out_dir: str | Path, *,
              seed: int = 0, limit: int | None = None, progress: bool = True) -> dict[str, dict[str, TaskResult]]:
    """Per-example results, task name -> method -> TaskResult, reusing finished task files under out_dir/tasks."""
    if not calibrators:
        raise ATSError("evaluate: no calibrators given")
    out_dir = Path(out_dir)
    built = [build_task(t, limit=limit, seed=seed) if isinstance(t, str) else t for t in tasks]
    names = [t.name for t in built]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise ATSError(f"evaluate: task name(s) {', '.join(dupes)} given more than once")
    for calibrator in calibrators.values():  # ATS refuses a head trained for another backbone
        check = getattr(calibrator, "check_backbone", None)
        if callable(check):
            check(backbone)
    methods = list(calibrators)
    out: dict[str, dict[str, TaskResult]] = {}
    for task in built:
        path = out_dir / "tasks" / f"{task.name}.json"
        results = _load_finished(path, task, backbone, methods)
        if results is not None:
            logger.info("%s: reusing finished results in %s", task.name, path)
        else:
            start = time.time()
            results = task.run(backbone, calibrators, progress=progress)
            missing = [m for m in methods if m not in results]
            if missing:
                raise ATSError(f"task {task.name} returned no results for {', '.join(missing)}")
            results = {m: results[m] for m in methods}
            _save(path, task, backbone, results, time.time() - start)
        out[task.name] = results
    return out


def evaluate(backbone, calibrators: dict[str, Calibrator], tasks: list[str | Task], out_dir: str | Path, *,
             n_bins: int = 15, bootstrap: int = 0, seed: int = 0, limit: int | None = None,
             progress: bool = True) -> dict:
    """Evaluate every calibrator on every task; returns task -> method -> metrics (also written to out_dir)."""
    from .metrics import summarize
    from .plots import reliability_figure

    out_dir = Path(out_dir)
    per_example = run_tasks(backbone, calibrators, tasks, out_dir, seed=seed, limit=limit, progress=progress)
    results: dict = {}
    for task_name, by_method in per_example.items():
        results[task_name] = {}
        for method, r in by_method.items():
            if len(r) == 0:
                raise ATSError(f"task {task_name}: no examples were evaluated")
            results[task_name][method] = summarize(r.confidence, r.correct, n_bins=n_bins, bootstrap=bootstrap,
                                                   seed=seed)
        reliability_figure({m: (r.confidence, r.correct) for m, r in by_method.items()},
                           out_dir / "figures" / task_name, title=task_name, n_bins=n_bins)
    results = _jsonable(results)
    write_json(out_dir / "results.json", results)
    with atomic_file(out_dir / "results.md") as f:
        f.write(format_table(results) + "\n")
    return results


def _cell(summary: dict, key: str) -> str:
    value = summary.get(key)
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "-"
    text = f"{value:.3f}"
    ci = summary.get(f"{key}_ci")
    if isinstance(ci, (list, tuple)) and len(ci) == 2 and all(isinstance(v, (int, float)) for v in ci):
        text += f" [{ci[0]:.3f}, {ci[1]:.3f}]"
    return text


def format_table(results: dict) -> str:
    """Markdown table: rows = methods, columns = task x {Acc, ECE, Brier}, 3 decimals (with 95% CIs when present)."""
    tasks = list(results)
    methods: list[str] = []
    for t in tasks:
        for m in results[t]:
            if m not in methods:
                methods.append(m)
    header = ["method"] + [f"{t} {label}" for t in tasks for label, _ in TABLE_METRICS]
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(["---"] + ["---:"] * (len(header) - 1)) + "|"]
    for m in methods:
        cells = [m]
        for t in tasks:
            summary = results[t].get(m, {})
            cells += [_cell(summary, key) for _, key in TABLE_METRICS]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
