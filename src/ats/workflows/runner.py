"""The one experiment runner: the reusable steps every experiment is made of, in one order.

    features -> heads -> baselines -> token-level evaluation -> tasks -> JSON

`Runner` holds what every step shares (the backbone, the run folder, overwrite, progress); each step reuses what
an earlier run with the same options left in the run folder (fingerprints) and refuses results made with other
options. `Runner.arm` runs the first four steps on one feature cache. A head to train is a `HeadJob`. `ats demo`
(`experiment`) and `ats ablate` (`ablate`) are short functions over these steps; so are the research protocols of
`benchmarks/protocols/`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from ..calibrators.base import Calibrator, Uncalibrated
from ..evaluation.evaluate import evaluate
from ..evaluation.metrics import summarize
from ..evaluation.report import jsonable
from ..evaluation.token_eval import token_confidences
from ..io import write_json
from ..model.backbone import Backbone
from ..training.config import TrainingConfig
from ..training.data import DataConfig
from .pipeline import fit_calibrators, fit_head, prepare_features

logger = logging.getLogger(__name__)

REFERENCE = "uncalibrated"


@dataclass(frozen=True)
class HeadJob:
    """One head to train (or reuse).

    name: its key in results (and the calibrator's name in tables); folder: relative to the run folder; training: its
    training options; method: the registry method trained (ats, selective-temperature, selective-linear); head_type:
    None for the method's preset; label: the method name the head records (None: the method's own).
    """

    name: str
    folder: str
    training: TrainingConfig
    method: str = "ats"
    head_type: str | None = None
    label: str | None = None


@dataclass
class Arm:
    """What `Runner.arm` made of one feature cache: the stores, the calibrators (uncalibrated first), which heads were
    reused, and the token-level metrics on the held-out split (empty when not asked for)."""

    train: object
    val: object
    calibrators: dict[str, Calibrator]
    reused: dict[str, bool] = field(default_factory=dict)
    token_level: dict = field(default_factory=dict)


class Laps:
    """Seconds per step, rounded to 0.1, into `record` (nothing is kept when it is None)."""

    def __init__(self, record: dict | None) -> None:
        self.record = record
        self.start = time.time()

    def done(self, step: str) -> None:
        """Record the seconds since the last step ended as `step`'s."""
        if self.record is not None:
            self.record[step] = round(time.time() - self.start, 1)
        self.start = time.time()


class Runner:
    """The steps of an experiment on one backbone and one run folder.

    Args:
        backbone: the frozen backbone.
        out: the run folder; every step's folder is relative to it.
        overwrite: replace results made with other options instead of refusing.
        progress: show progress bars.
    """

    def __init__(self, backbone: Backbone, out: str | Path, *, overwrite: bool = False, progress: bool = True):
        self.backbone = backbone
        self.out = Path(out)
        self.overwrite = overwrite
        self.progress = progress

    def features(self, data: DataConfig | None, folder: str | Path = "features") -> tuple:
        """Step 1: the train / val feature caches of `data` in `out/folder` (`prepare_features`)."""
        return prepare_features(self.backbone, self.out / folder, data, overwrite=self.overwrite,
                                progress=self.progress)

    def heads(self, jobs: Iterable[HeadJob], train, val) -> tuple[dict[str, Calibrator], dict[str, bool]]:
        """Step 2: every head job trained (or reused), moved to the backbone's device.

        Returns:
            (job name -> calibrator, job name -> whether it was reused), in job order.
        """
        calibrators, reused = {}, {}
        for job in jobs:
            calibrator, reused[job.name] = fit_head(
                self.backbone, train, val, self.out / job.folder, method=job.method, head_type=job.head_type,
                label=job.label, training=job.training, overwrite=self.overwrite, progress=self.progress)
            calibrators[job.name] = calibrator.to(self.backbone.device)
        return calibrators, reused

    def baselines(self, names: tuple[str, ...], train, val=None, *, folder: str | Path = "baselines",
                  training: TrainingConfig | None = None, fit_tokens: int | None = None) -> dict[str, Calibrator]:
        """Step 3: the named calibrators fitted (or reused) in `out/folder` (`fit_calibrators`; the controls are
        trained with `training`), moved to the backbone's device."""
        fitted = fit_calibrators(self.backbone, train, self.out / folder, names, val_store=val, training=training,
                                 fit_tokens=fit_tokens, overwrite=self.overwrite, progress=self.progress)
        return {name: calibrator.to(self.backbone.device) for name, calibrator in fitted.items()}

    def token_level(self, val, calibrators: dict[str, Calibrator], *, n_bins: int = 15) -> dict:
        """Step 4: method -> `summarize` of every calibrator on the held-out split's response tokens."""
        token = token_confidences(val, self.backbone, calibrators, progress=self.progress)
        return {name: summarize(conf, correct, n_bins=n_bins) for name, (conf, correct) in token.items()}

    def tasks(self, calibrators: dict[str, Calibrator], tasks: list, *, folder: str | Path = "eval",
              **options) -> dict:
        """Step 5: task -> method -> metrics of every calibrator on the built `tasks` (`evaluate` in `out/folder`;
        `options`: its n_bins, bootstrap, seed, references); {} without tasks."""
        if not tasks:
            return {}
        return evaluate(self.backbone, calibrators, tasks, self.out / folder, overwrite=self.overwrite,
                        progress=self.progress, **options)

    def write(self, name: str, record: dict) -> dict:
        """Step 6: `record`, made JSON-safe, written to `out/name`; returns what was written."""
        record = jsonable(record)
        write_json(self.out / name, record)
        return record

    def arm(self, data: DataConfig | None, jobs: Iterable[HeadJob] = (), *, folder: str | Path = "",
            baselines: tuple[str, ...] = (), baseline_options: dict | None = None, token_level: bool = True,
            n_bins: int = 15, laps: dict | None = None) -> Arm:
        """Steps 1-4 on one feature cache under `out/folder`: features, heads, baselines, token-level metrics.

        Args:
            data: the data options of the features.
            jobs: the heads (folders relative to the run folder).
            folder: the arm's folder (its features go to `folder/features`).
            baselines: calibrators fitted on the same tokens, in `folder/baselines`.
            baseline_options: `baselines` options (training of the controls, fit_tokens).
            token_level: evaluate every calibrator on the held-out tokens.
            n_bins: equal-width bins of the token-level ECE.
            laps: if given, the seconds of each step are added to it ("features", "train", "baselines",
                "token_eval").

        Returns:
            The `Arm`; its calibrators are the uncalibrated model, the baselines, then the heads.
        """
        lap = Laps(laps)
        train, val = self.features(data, Path(folder) / "features")
        lap.done("features")
        heads, reused = self.heads(jobs, train, val)
        lap.done("train")
        fitted = self.baselines(baselines, train, val, folder=Path(folder) / "baselines",
                                **(baseline_options or {})) if baselines else {}
        if baselines:
            lap.done("baselines")
        arm = Arm(train, val, {REFERENCE: Uncalibrated(), **fitted, **heads}, reused)
        if token_level:
            arm.token_level = self.token_level(val, arm.calibrators, n_bins=n_bins)
            lap.done("token_eval")
        return arm
