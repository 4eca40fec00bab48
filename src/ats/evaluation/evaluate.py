"""Run tasks x calibrators and write the results: per-example files, results.json, results.md, reliability diagrams.

    out_dir/tasks/<task>.json     per-example confidence / correct of every method, with the task's settings, the
                                  backbone and each calibrator's digest (what the results were computed with)
    out_dir/results.json          task -> method -> metrics (accuracy, mean confidence, ECE, adaptive ECE, Brier, NLL,
                                  AUROC, AURC, excess AURC, PRR, error AUPRC, bootstrap intervals) and, per reference
                                  method R, `paired[R]`: R minus this method with a paired bootstrap 95% interval
    out_dir/results.md            a table per task (methods x metrics), the answer-or-abstain (risk-coverage) table
                                  per task, then the paired differences per task
    out_dir/figures/<task>.png/.pdf   reliability diagrams, methods side by side
    out_dir/figures/<task>_risk_coverage.png/.pdf   risk-coverage curves, methods in one panel

Each task runs the backbone once per example and applies every calibrator to that same forward. A finished task file
is reused only for the same task settings, backbone and calibrator digests; results computed with anything else are
refused (or replaced with `overwrite=True`), never silently returned.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

from ..calibrators.base import Calibrator
from ..errors import ATSError
from ..fingerprint import refusal
from ..io import atomic_file, read_json, write_json
from .metrics import paired_differences, summarize
from .plots import reliability_figure, risk_coverage_figure
from .report import TASK_LABELS, cell, format_table, jsonable, markdown_table, selective_tables, task_heading
from .tasks import Task, TaskResult, build_task

logger = logging.getLogger(__name__)


def _settings(task: Task, backbone) -> dict:
    """What the stored results of `task` depend on besides the calibrators."""
    return jsonable({"task": task.describe(), "backbone": {"name": str(getattr(backbone, "name", "?")),
                                                           "revision": str(getattr(backbone, "revision", "?"))}})


def _load_finished(path: Path, settings: dict, digests: dict[str, str], *, overwrite: bool
                   ) -> dict[str, TaskResult] | None:
    """The stored per-example results in `path` if they hold every method with the same settings and digests.

    None: run the task (file missing, a method missing, or `overwrite` of a mismatch). Raises on a mismatch.
    """
    if not path.is_file():
        return None
    data = read_json(path)
    stored = {"task": data.get("task"), "backbone": data.get("backbone")}
    if stored != settings:
        if overwrite:
            return None
        raise refusal(path, "task results", stored, settings)
    methods = data.get("methods", {})
    for method, dig in digests.items():
        old = methods.get(method, {}).get("digest")
        if method in methods and old != dig:
            if overwrite:
                return None
            raise refusal(path, f"task results of method {method!r}", {"calibrator_digest": old},
                          {"calibrator_digest": dig})
    if not all(m in methods for m in digests):
        return None
    logger.info("reusing task results from %s (same options)", path)
    return {m: TaskResult.from_dict(methods[m], where=str(path)) for m in digests}


def _save(path: Path, settings: dict, digests: dict[str, str], results: dict[str, TaskResult],
          seconds: float) -> None:
    write_json(path, {**settings, "seconds": round(seconds, 3), "n": len(next(iter(results.values()))),
                      "methods": {m: {"digest": digests[m], **jsonable(r.to_dict())} for m, r in results.items()}})


def run_tasks(backbone, calibrators: dict[str, Calibrator], tasks: list[str | Task], out_dir: str | Path, *,
              seed: int = 0, limit: int | None = None, overwrite: bool = False, progress: bool = True
              ) -> dict[str, dict[str, TaskResult]]:
    """Per-example results, task name -> method -> TaskResult, reusing finished task files under out_dir/tasks.

    Args:
        backbone: the frozen backbone every calibrator is applied to.
        calibrators: method name -> fitted calibrator.
        tasks: task specs (see `build_task`) or Task objects.
        out_dir: the results folder; per-example files go to `out_dir/tasks/<task>.json`.
        seed: the seed of the tasks' subsets.
        limit: questions per task (per subject for MMLU); None: all.
        overwrite: replace stored results made with other settings instead of refusing.
        progress: show progress bars.

    Returns:
        task name -> method -> per-example `TaskResult`, methods in the order of `calibrators`.

    Raises:
        ATSError: if no calibrator is given, a task name repeats, a calibrator does not match the backbone, stored
            results were made with other settings (without `overwrite`), or a task returns no results for a method.
    """
    if not calibrators:
        raise ATSError("evaluate: no calibrators given")
    out_dir = Path(out_dir)
    built = [build_task(t, limit=limit, seed=seed) if isinstance(t, str) else t for t in tasks]
    names = [t.name for t in built]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise ATSError(f"evaluate: task name(s) {', '.join(dupes)} given more than once")
    for calibrator in calibrators.values():
        calibrator.check_backbone(backbone)
    digests = {m: c.digest() for m, c in calibrators.items()}
    out: dict[str, dict[str, TaskResult]] = {}
    for task in built:
        path = out_dir / "tasks" / f"{task.name}.json"
        settings = _settings(task, backbone)
        results = _load_finished(path, settings, digests, overwrite=overwrite)
        if results is None:
            start = time.time()
            results = task.run(backbone, calibrators, progress=progress)
            missing = [m for m in calibrators if m not in results]
            if missing:
                raise ATSError(f"task {task.name} returned no results for {', '.join(missing)}")
            results = {m: results[m] for m in calibrators}
            _save(path, settings, digests, results, time.time() - start)
        out[task.name] = results
    return out


def summarize_task(by_method: dict[str, TaskResult], *, references: tuple[str, ...] = ("ats",), n_bins: int = 15,
                   bootstrap: int = 0, seed: int = 0) -> dict:
    """method -> metrics of one task; with bootstrap > 0 also intervals and, for each reference method present,
    `paired[reference]` = reference minus this method (the metrics of `PAIRED_KEYS`) on the same examples.

    Args:
        by_method: method -> per-example results, all on the same examples.
        references: the methods every other method is compared with (those absent are skipped).
        n_bins: equal-width bins of the ECE.
        bootstrap: bootstrap resamples; 0: no intervals and no paired differences.
        seed: the seed of the resampling.

    Returns:
        method -> the `summarize` dict, plus "paired" -> reference -> `paired_differences` dict when bootstrapped.

    Raises:
        ATSError: if a method has no examples or its results are invalid.
    """
    out = {}
    for method, r in by_method.items():
        if len(r) == 0:
            raise ATSError(f"no examples were evaluated for {method}")
        out[method] = summarize(r.confidence, r.correct, n_bins=n_bins, bootstrap=bootstrap, seed=seed)
    if bootstrap:
        for ref in (r for r in references if r in by_method):
            a = by_method[ref]
            for method, r in by_method.items():
                if method != ref:
                    out[method].setdefault("paired", {})[ref] = paired_differences(
                        (a.confidence, a.correct), (r.confidence, r.correct), n_bins=n_bins, bootstrap=bootstrap,
                        seed=seed)
    return out


def evaluate(backbone, calibrators: dict[str, Calibrator], tasks: list[str | Task], out_dir: str | Path, *,
             n_bins: int = 15, bootstrap: int = 0, seed: int = 0, limit: int | None = None,
             references: tuple[str, ...] = ("ats",), overwrite: bool = False, progress: bool = True) -> dict:
    """Evaluate every calibrator on every task; returns task -> method -> metrics (also written to out_dir).

    Writes the layout of the module docstring: per-example task files, results.json, results.md and the
    reliability diagrams.

    Args:
        backbone: the frozen backbone every calibrator is applied to.
        calibrators: method name -> fitted calibrator.
        tasks: task specs (see `build_task`) or Task objects.
        out_dir: the results folder.
        n_bins: equal-width bins of the ECE and the reliability diagrams.
        bootstrap: bootstrap resamples for intervals and paired differences; 0: none.
        seed: the seed of the tasks' subsets and the resampling.
        limit: questions per task (per subject for MMLU); None: all.
        references: the methods every other method is compared with.
        overwrite: replace stored results made with other settings instead of refusing.
        progress: show progress bars.

    Returns:
        task -> method -> metrics, JSON-safe (non-finite values as None).

    Raises:
        ATSError: as `run_tasks`, or if a task's results cannot be summarised (named in the message).
    """
    out_dir = Path(out_dir)
    per_example = run_tasks(backbone, calibrators, tasks, out_dir, seed=seed, limit=limit, overwrite=overwrite,
                            progress=progress)
    results = {}
    for task_name, by_method in per_example.items():
        try:
            results[task_name] = summarize_task(by_method, references=references, n_bins=n_bins,
                                                bootstrap=bootstrap, seed=seed)
        except ATSError as err:
            raise ATSError(f"task {task_name}: {err}") from None
        scored = {m: (r.confidence, r.correct) for m, r in by_method.items()}
        title = TASK_LABELS.get(task_name, task_name)
        reliability_figure(scored, out_dir / "figures" / task_name, title=title, n_bins=n_bins)
        risk_coverage_figure(scored, out_dir / "figures" / f"{task_name}_risk_coverage", title=title)
    results = jsonable(results)
    write_json(out_dir / "results.json", results)
    with atomic_file(out_dir / "results.md") as f:
        f.write(results_markdown(results) + "\n")
    return results


def results_markdown(results: dict) -> str:
    """What results.md holds and `ats eval` prints: the calibration table per task, the answer-or-abstain table per
    task, then the paired differences (when bootstrapped).

    Args:
        results: task -> method -> metrics, as `evaluate` returns them.

    Returns:
        The markdown sections, separated by blank lines.
    """
    return "\n\n".join(part for part in (format_table(results), selective_tables(results), format_paired(results))
                        if part)


PAIRED_COLUMNS = (("ECE", "ece"), ("Brier", "brier"), ("AUROC", "auroc"), ("AURC", "aurc"), ("PRR", "prr"))


def format_paired(results: dict, keys: tuple[tuple[str, str], ...] = PAIRED_COLUMNS) -> str:
    """Markdown: one block per task, a row per compared method (each once) and, for each reference R, a column per
    metric with R - method and its 95% paired interval; a difference whose interval excludes 0 is marked with *.
    A reference's row shows "-" in its own columns. Empty when there are no paired differences.

    Args:
        results: task -> method -> metrics, as `evaluate` returns them.
        keys: (column label, metric key) pairs to show.

    Returns:
        A title line, then a "### <task>" table per task with paired differences; "" when there is none.
    """
    blocks = []
    for task, by_method in results.items():
        references = list(dict.fromkeys(ref for m in by_method.values() for ref in m.get("paired", {})))
        if not references:
            continue
        header = ["method"] + [f"{label} ({ref} - method)" for ref in references for label, _ in keys]
        rows = []
        for method, metrics in by_method.items():
            pairs = metrics.get("paired", {})
            if not pairs:  # the only reference itself: nothing to compare
                continue
            cells = [method]
            for ref in references:
                for _, key in keys:
                    d = pairs.get(ref, {}).get(key)
                    cells.append("-" if d is None else cell({"v": d["diff"], "v_ci": d["ci"]}, "v")
                                 + (" *" if d.get("excludes_zero") else ""))
            rows.append(cells)
        blocks.append(task_heading(task, by_method) + "\n\n" + markdown_table(header, rows))
    if not blocks:
        return ""
    return ("Paired differences, reference minus each method (95% paired bootstrap; * = interval excludes 0):\n\n"
            + "\n\n".join(blocks))
