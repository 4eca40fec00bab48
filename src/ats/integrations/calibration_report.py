"""Calibration of any lm-eval multiple-choice run, from its `--log_samples` files, whatever model produced them.

For each question the confidence is the softmax over the choices of what lm-eval took the argmax of: the
log-likelihoods (`acc`) or the log-likelihoods per character (`acc_norm`); the prediction is that argmax (so the
accuracy is lm-eval's own) and it is correct when it is a gold choice. On these, `ats.evaluation` computes the same
metrics (calibration and answer-or-abstain), bootstrap intervals, paired differences and figures as `ats eval`:

    out_dir/calibration.json          files read, settings, and results: task variant -> model -> metrics
                                      (with `paired[first model]` when several files score the same task)
    out_dir/calibration.md            the tables
    out_dir/figures/<task>[_acc_norm].png/.pdf   reliability diagrams, models side by side
    out_dir/figures/<task>[_acc_norm]_risk_coverage.png/.pdf   risk-coverage curves, models in one panel

Files of the same task are compared on the questions they share (same `doc_id`; a different `doc_hash` for the same
id is refused), so two methods are judged on identical questions.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from ..errors import ATSError
from ..evaluation.evaluate import format_paired, summarize_task
from ..evaluation.plots import reliability_figure, risk_coverage_figure
from ..evaluation.report import SELECTIVE_METRICS, SELECTIVE_TITLE, cell, jsonable, markdown_table
from ..evaluation.tasks.base import TaskResult
from ..io import atomic_file, write_json
from .lm_eval_samples import VARIANTS, SamplesFile

logger = logging.getLogger(__name__)

COLUMNS = (("Acc", "accuracy"), ("ECE", "ece"), ("adaptive ECE", "adaptive_ece"), ("Brier", "brier"),
           ("AUROC", "auroc"), ("mean conf", "mean_confidence"))


def confidences(file: SamplesFile, variant: str = "acc", doc_ids: Sequence[int] | None = None) -> TaskResult:
    """Top-1 softmax confidence over the choices' `variant` scores and its correctness, per question.

    Args:
        file: a parsed samples file.
        variant: "acc" (summed log-likelihoods) or "acc_norm" (divided by the choices' lengths).
        doc_ids: the questions to take, in this order; None: all, in the file's order.

    Returns:
        The per-question result; extra: "doc_id", "prediction".
    """
    by_id = {s.doc_id: s for s in file.samples}
    chosen = [by_id[i] for i in doc_ids] if doc_ids is not None else file.samples
    conf, pred, correct = [], [], []
    for sample in chosen:
        scores = sample.scores(variant)  # (C,)
        probs = np.exp(scores - scores.max())
        probs /= probs.sum()
        k = int(np.argmax(scores))  # lm-eval's prediction (first of equal scores, as np.argmax there)
        conf.append(float(probs[k]))
        pred.append(k)
        correct.append(k in sample.gold)
    return TaskResult(np.asarray(conf), np.asarray(correct), {"doc_id": np.asarray([s.doc_id for s in chosen]),
                                                              "prediction": np.asarray(pred)})


def shared_questions(files: Sequence[SamplesFile]) -> list[int]:
    """The doc_ids every file scored, in the first file's order (a warning names how many were dropped).

    Args:
        files: samples files of one task.

    Returns:
        The shared doc_ids.

    Raises:
        ATSError: if a doc_id is a different question in two files (doc_hash differs) or none is shared.
    """
    first = files[0]
    common = set.intersection(*({s.doc_id for s in f.samples} for f in files))
    for other in files[1:]:
        hashes = {s.doc_id: s.doc_hash for s in other.samples}
        for s in first.samples:
            h = hashes.get(s.doc_id)
            if s.doc_id in common and s.doc_hash and h and s.doc_hash != h:
                raise ATSError(f"{other.path}: doc_id {s.doc_id} is not the question of {first.path} (doc_hash "
                               f"differs); paired comparisons need the same questions")
    if not common:
        raise ATSError(f"{', '.join(str(f.path) for f in files)}: no question in common (task {first.task})")
    dropped = max(len(f.samples) for f in files) - len(common)
    if dropped:
        logger.warning("task %s: %d question(s) are not in every file; compared on the %d shared ones", first.task,
                       dropped, len(common))
    return [s.doc_id for s in first.samples if s.doc_id in common]


def _unique_labels(files: Sequence[SamplesFile]) -> list[str]:
    """Each file's label, made unique with its file name (then a number) when two files share one."""
    labels: list[str] = []
    for f in files:
        label, n = f.label, 2
        if label in labels:
            label = f"{f.label} ({f.path.stem})"
        while label in labels:
            label, n = f"{f.label} #{n}", n + 1
        labels.append(label)
    return labels


def variant_key(task: str, variant: str) -> str:
    """The results key of `task`'s confidence `variant`: `task` (acc) or `task (acc_norm)`."""
    return task if variant == "acc" else f"{task} ({variant})"


def calibration_report(files: Sequence[SamplesFile], out_dir: str | Path, *, n_bins: int = 15, bootstrap: int = 1000,
                       seed: int = 0) -> dict:
    """Metrics, paired differences (files of one task, against the first) and reliability diagrams of every
    samples file, written to out_dir (see the module docstring).

    Args:
        files: parsed samples files, of one or more tasks.
        out_dir: where calibration.json, calibration.md and figures/ go.
        n_bins: equal-width ECE bins.
        bootstrap: bootstrap resamples for the 95% intervals (0: none).
        seed: the bootstrap's seed.

    Returns:
        What calibration.json holds: {"settings", "files", "results"}.

    Raises:
        ATSError: if there are no files, the files of a task do not share their questions, or a metric fails.
    """
    if not files:
        raise ATSError("calibration report: no samples files")
    out_dir = Path(out_dir)
    labels = _unique_labels(files)
    by_task: dict[str, list[tuple[str, SamplesFile]]] = {}
    for label, f in zip(labels, files):
        by_task.setdefault(f.task, []).append((label, f))
    results: dict[str, dict] = {}
    for task, entries in by_task.items():
        ids = shared_questions([f for _, f in entries]) if len(entries) > 1 else None
        variants = [v for v in VARIANTS if v == "acc" or all(f.has_norm for _, f in entries)]
        for variant in variants:
            key = variant_key(task, variant)
            by_label = {label: confidences(f, variant, ids) for label, f in entries}
            try:
                results[key] = summarize_task(by_label, references=(entries[0][0],), n_bins=n_bins,
                                              bootstrap=bootstrap, seed=seed)
            except ATSError as err:
                raise ATSError(f"task {key}: {err}") from None
            stem = re.sub(r"[^A-Za-z0-9_.-]+", "_", f"{task}_{variant}" if variant != "acc" else task)
            scored = {label: (r.confidence, r.correct) for label, r in by_label.items()}
            reliability_figure(scored, out_dir / "figures" / stem, title=key, n_bins=n_bins)
            risk_coverage_figure(scored, out_dir / "figures" / f"{stem}_risk_coverage", title=key)
    report = jsonable({
        "settings": {"n_bins": n_bins, "bootstrap": bootstrap, "seed": seed},
        "files": [{"path": str(f.path), "task": f.task, "label": label, "n": len(f.samples),
                   "target_delimiter": f.delimiter, "lm_eval": _recorded(f), "mismatches": f.mismatches}
                  for label, f in zip(labels, files)],
        "results": results,
    })
    write_json(out_dir / "calibration.json", report)
    with atomic_file(out_dir / "calibration.md") as fh:
        fh.write(format_report(report) + "\n")
    return report


def _recorded(file: SamplesFile) -> dict[str, float]:
    """lm-eval's own mean acc / acc_norm over the file (the report's accuracy reproduces them)."""
    out = {}
    for variant in VARIANTS:
        values = [s.recorded[variant] for s in file.samples if variant in s.recorded]
        if values:
            out[variant] = float(np.mean(values))
    return out


def _table(results: dict, columns: tuple[tuple[str, str], ...]) -> str:
    """One row per task variant and model: task, model, n, then `columns` (metrics with 95% intervals)."""
    rows = [[key, label, str(m.get("n", "-"))] + [cell(m, k) for _, k in columns]
            for key, by_label in results.items() for label, m in by_label.items()]
    return markdown_table(["task", "model", "n"] + [name for name, _ in columns], rows, text_columns=2)


def format_report(report: dict) -> str:
    """Markdown: the calibration table and the answer-or-abstain table, one row per task variant and model (metrics
    with 95% intervals), then the paired differences.

    Args:
        report: what `calibration_report` returns.

    Returns:
        The Markdown text.
    """
    results = report["results"]
    paired = format_paired(results)
    return "\n\n".join(part for part in (_table(results, COLUMNS), SELECTIVE_TITLE,
                                          _table(results, SELECTIVE_METRICS), paired) if part)
