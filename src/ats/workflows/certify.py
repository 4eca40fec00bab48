"""A calibrator's certified answer-or-abstain threshold (`ats certify`): made on labelled answers of the QA pool that
the calibrator never saw (`answer_pool.held_out_tasks`: questions outside the pool `ats train --on answers` trains
on), saved beside it as `threshold.json`, reused while nothing that made it changed (`fingerprint.check_reuse`), and
read by `ats serve` and `ats generate`, which then say per answer whether it is given.

The confidence is the one serving reports, `answer_confidence`: the tasks' rule (a free-form answer's mean token
probability, through a binning map when the calibrator has one; softmax over the choices for multiple-choice tasks),
so the certified risk is the risk of the served decision on questions exchangeable with the certification ones
(evaluation/threshold.py).
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np

from ..evaluation.metrics import summarize
from ..evaluation.threshold import THRESHOLD_NAME, CertifiedThreshold, certify_threshold
from ..fingerprint import check_reuse, make_fingerprint
from ..io import read_json, write_json
from .answer_pool import FREE_FORM, AnswerPool, held_out_tasks

logger = logging.getLogger(__name__)


def certification_answers(backbone, calibrator, tasks: dict, *, progress: bool = True) -> dict:
    """task name -> (confidence (n,), correct (n,)) of `calibrator`'s answers to each task (None: uncalibrated)."""
    from ..calibrators.base import Uncalibrated

    out = {}
    for name, task in tasks.items():
        result = task.run(backbone, {"c": calibrator or Uncalibrated()}, progress=progress)["c"]
        out[name] = (result.confidence, result.correct)
    return out


def certify(backbone, calibrator, folder: str | Path, *, alpha: float, delta: float, pool: AnswerPool = AnswerPool(),
            size: int = 300, names: tuple[str, ...] = FREE_FORM, overwrite: bool = False,
            progress: bool = True) -> tuple[CertifiedThreshold, bool]:
    """Certify `calibrator`'s threshold on `size` held-out questions of each pool task in `names` and save it in
    `folder` (threshold.json); reuse the saved one when it was made the same way.

    Args:
        backbone: the frozen backbone.
        calibrator: the calibrator whose confidence is thresholded (None: the uncalibrated model).
        folder: the calibrator's folder (the threshold is saved beside it).
        alpha: the target risk.
        delta: the probability allowed that the risk exceeds alpha.
        pool: the pool's sizes the calibrator may have trained on (its questions are left out).
        size: held-out questions per task (MMLU validation: per subject).
        names: the pool tasks to certify on.
        overwrite: replace a threshold made otherwise instead of refusing.
        progress: show progress bars.

    Returns:
        (the threshold, whether it was reused).

    Raises:
        ATSError: if a saved threshold was made otherwise (without `overwrite`), or the tasks are unknown.
    """
    folder = Path(folder)
    tasks = held_out_tasks(pool, size, names=names)
    fingerprint = make_fingerprint("threshold", backbone=backbone.describe(),
                                   calibrator=None if calibrator is None else calibrator.digest(), alpha=alpha,
                                   delta=delta, tasks=[task.describe() for task in tasks.values()])
    path = folder / THRESHOLD_NAME
    if path.is_file():
        stored = read_json(path)
        if check_reuse(path, "threshold", stored.get("fingerprint") if isinstance(stored, dict) else None,
                       fingerprint, overwrite=overwrite):
            return CertifiedThreshold.from_dict(stored["threshold"], where=f"{path}: threshold"), True
    answers = certification_answers(backbone, calibrator, tasks, progress=progress)
    confidence = np.concatenate([c for c, _ in answers.values()])
    correct = np.concatenate([k for _, k in answers.values()])
    threshold = certify_threshold(confidence, correct, alpha=alpha, delta=delta)
    per_task = {}
    for name, (conf, ok) in answers.items():
        answered = threshold.answers(conf)
        per_task[name] = {"n": int(conf.size), "accuracy": float(ok.mean()),
                          "coverage": float(answered.mean()),
                          "risk": float(1 - ok[answered].mean()) if answered.any() else None,
                          "ece": summarize(conf, ok)["ece"]}
    write_json(path, {"threshold": threshold.to_dict(), "tasks": per_task, "fingerprint": fingerprint})
    logger.info("certified threshold %s on %d held-out answers (alpha %g, delta %g): saved to %s",
                threshold.threshold, threshold.n, alpha, delta, path)
    return threshold, False
