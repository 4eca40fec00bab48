"""End-to-end steps shared by the CLI, the demo and the benchmarks: data -> features -> head -> baselines -> eval.

Each step writes into a run folder with a fingerprint of everything that determines it (`ats.fingerprint`). A rerun
with the same options reuses the finished step and says so; a rerun with other options is refused, naming what
differs, unless `overwrite=True`; an interrupted step continues (`resume`) only with the same fingerprint. A step
that makes one result returns `(result, reused)` (`fit_head`, `fit_calibrator`). The fingerprints are built in
`fingerprints.py`; the experiments chain these steps through `runner.Runner`.
"""

from __future__ import annotations

import dataclasses
import logging
import shutil
import time
from pathlib import Path

from ..calibrators import BASELINES, calibrator_class, calibrator_for, entry, load_calibrator
from ..calibrators.ats import ATSCalibrator
from ..calibrators.base import CONFIG_NAME, Calibrator
from ..evaluation.answers import build_answer_set
from ..evaluation.token_eval import token_validator
from ..fingerprint import check_reuse, refusal, stored_fingerprint, write_fingerprint
from ..io import read_json, write_json
from ..model.backbone import Backbone
from ..model.heads import MAX_SCALE, HeadConfig
from ..model.layers import candidate_layers, decoder_layers
from ..model.scale_summary import ScaleSummarySpec
from ..training.answers import META_NAME as ANSWERS_META
from ..training.answers import AnswerSet
from ..training.config import TrainingConfig
from ..training.data import DataConfig, prepare_examples
from ..training.distributed import SINGLE, Dist
from ..training.features import (
    DEFAULT_SUMMARY,
    META_NAME,
    FeatureStore,
    extract_features,
    shard_plan,
    summary_meta,
    write_meta,
)
from ..training.online import OnlineFeatures
from ..training.trainer import train_ats
from ..training.validation import heldout_objective
from .feature_source import FeatureSource, LogitReplay
from .fingerprints import (
    answers_fingerprint,
    calibrator_fingerprint,
    data_fingerprint,
    features_fingerprint,
    head_fingerprint,
    store_fingerprint,
    stored_answers_fingerprint,
    training_options,
)

logger = logging.getLogger(__name__)

SPLITS = ("train", "val")
# names other modules and scripts import from here
__all__ = ["BASELINES", "SPLITS", "FeatureSource", "LogitReplay", "calibrator_fingerprint", "check_before_loading",
           "data_fingerprint", "features_fingerprint", "fit_calibrator", "fit_calibrators", "fit_head",
           "head_fingerprint", "head_preset", "online_features", "prepare_answers", "prepare_features", "train_head",
           "training_options"]


def prepare_features(backbone: Backbone, features_dir: str | Path, config: DataConfig | None = None, *,
                     overwrite: bool = False, progress: bool = True, dist: Dist | None = None,
                     summary: ScaleSummarySpec | None = DEFAULT_SUMMARY) -> tuple[FeatureStore, FeatureStore]:
    """Tokenize the instruction data, split it, and extract (or reuse) the train / val feature caches.

    Finished features are reused only for the same backbone, data and options (the scale summary's settings
    included); a partial extraction resumes only with them.

    Args:
        backbone: the frozen backbone.
        features_dir: the folder holding `train/` and `val/`.
        config: the data options; default `DataConfig()`.
        overwrite: replace features made with other options instead of refusing.
        progress: show progress bars (main process only).
        dist: with several processes, rank r extracts shards r, r+W, ... of each split; the main process writes
            meta.json once every rank has finished (a barrier), then every rank opens the stores.
        summary: the settings of the per-token scale summary stored beside the hidden states (training without the
            vocabulary); None: hidden states only.

    Returns:
        (train store, val store).

    Raises:
        ATSError: if a split holds features made with other options (without `overwrite`), the stored features
            belong to another backbone, or the data cannot be read or split.
    """
    config = config or DataConfig()
    dist = dist or SINGLE
    features_dir = Path(features_dir)
    data = data_fingerprint(config)
    prints = {split: features_fingerprint(backbone, config, split, data=data, summary=summary) for split in SPLITS}
    finished = {split: (features_dir / split / META_NAME).exists() for split in SPLITS}
    for split in SPLITS:
        folder = features_dir / split
        old = stored_fingerprint(folder) if folder.is_dir() else None
        if folder.is_dir() and any(folder.iterdir()) and old != prints[split]:
            if not overwrite:
                raise refusal(folder, "features", old, prints[split])
            if dist.is_main:
                shutil.rmtree(folder)
            finished[split] = False
    dist.barrier()
    if all(finished.values()):
        stores = [FeatureStore(features_dir / split) for split in SPLITS]
        for store in stores:
            store.check_backbone(backbone)
        logger.info("reusing features from %s (same options)", features_dir)
        return stores[0], stores[1]
    train, val, meta = prepare_examples(backbone.tokenizer, config)
    logger.info("extracting features of %s (%d train / %d val sequences) into %s", config.source, len(train),
                len(val), features_dir)
    stores = []
    for split, part in zip(SPLITS, (train, val)):
        folder = features_dir / split
        if dist.is_main:
            folder.mkdir(parents=True, exist_ok=True)
            write_fingerprint(folder, prints[split])
        dist.barrier()
        n_shards = len(shard_plan(part, config.shard_sequences))
        extract_features(backbone, part, folder, batch_tokens=config.batch_tokens,
                         shard_sequences=config.shard_sequences, dtype=config.feature_dtype,
                         shards=dist.my_shards(n_shards) if dist.distributed else None,
                         progress=progress and dist.is_main, extra_meta={**meta, "split": split}, summary=summary)
        dist.barrier()  # every rank's shards are written
        if dist.distributed and dist.is_main:
            write_meta(folder, backbone, n_shards=n_shards, dtype=config.feature_dtype,
                       extra={**meta, "split": split, **summary_meta(summary)})
        dist.barrier()  # meta.json is there
        stores.append(FeatureStore(folder))
    return stores[0], stores[1]


def prepare_answers(backbone: Backbone, task, folder: str | Path, *, overwrite: bool = False,
                    progress: bool = True, dtype: str = "float16",
                    probe_layers: tuple[int, ...] | None = None) -> AnswerSet:
    """The backbone's answers to `task` (`build_answer_set`, with the default scale summary), cached in `folder` and
    reused when they were made by this task and backbone with the same storage (`answers_fingerprint`, the one reuse
    rule of `fingerprint.check_reuse`); a set with other summary settings is reused as it is (each summary row carries
    its own range and nodes), said in one line.

    Args:
        backbone: the frozen backbone.
        task: the task (its questions and scoring).
        folder: the answers' folder.
        overwrite: rebuild answers made otherwise instead of refusing.
        progress: show a progress bar.
        dtype: the stored hidden states' dtype.
        probe_layers: the decoder layers kept at each answer for correctness probes; None: the backbone's
            `candidate_layers` (eight, evenly spaced), (): none.

    Returns:
        The answer set.

    Raises:
        ATSError: if the folder holds another task's or backbone's answers, or other storage settings (without
            `overwrite`).
    """
    folder = Path(folder)
    if probe_layers is None:
        probe_layers = candidate_layers(len(decoder_layers(backbone.model)))
    meta_path = folder / ANSWERS_META
    if meta_path.is_file():
        meta = read_json(meta_path)
        if check_reuse(folder, "answers", stored_answers_fingerprint(meta),
                       answers_fingerprint(backbone, task, dtype, probe_layers),
                       overwrite=overwrite):
            if meta.get("summary") != dataclasses.asdict(ScaleSummarySpec()):
                logger.info("%s: answers with scale summary %s (default now %s), reused as they are", folder,
                            meta.get("summary"), dataclasses.asdict(ScaleSummarySpec()))
            return AnswerSet.load(folder)
    start = time.perf_counter()
    answers = build_answer_set(backbone, task, dtype=dtype, probe_layers=tuple(probe_layers), progress=progress)
    answers.meta["seconds"] = round(time.perf_counter() - start, 1)
    answers.save(folder)
    logger.info("%s: %d answers in %.0f s", task.name, len(answers), answers.meta["seconds"])
    return answers


def online_features(backbone: Backbone, config: DataConfig | None = None) -> tuple[OnlineFeatures, OnlineFeatures]:
    """Train/val feature sources that run the backbone inside the training loop (no cache; large models).

    Args:
        backbone: the frozen backbone.
        config: the data options; default `DataConfig()`.

    Returns:
        (train source, val source), each with its `fingerprint` set as for cached features.

    Raises:
        ATSError: if the data cannot be read or split.
    """
    config = config or DataConfig()
    train, val, meta = prepare_examples(backbone.tokenizer, config)
    data = data_fingerprint(config)
    sources = []
    for split, part in zip(SPLITS, (train, val)):
        source = OnlineFeatures(backbone, part, shard_sequences=config.shard_sequences,
                                batch_tokens=config.batch_tokens, extra_meta={**meta, "split": split})
        source.fingerprint = features_fingerprint(backbone, config, split, data=data)
        sources.append(source)
    return sources[0], sources[1]


def head_preset(method: str, head_type: str | None = None, label: str | None = None) -> dict:
    """The `ATSCalibrator.for_backbone` options of a head method: its registry preset, an explicit `head_type`
    overriding the preset's, and the name in tables (`label`, else the preset's, else `method`). `train_head` and
    `check_before_loading` both read it, so a rerun is checked against what training would build.

    Raises:
        ATSError: if `method` is not a registered calibrator.
    """
    preset = dict(entry(method).preset)
    if head_type is not None:
        preset["head_type"] = head_type
    preset["method"] = label or preset.get("method", method)
    return preset


def fit_head(backbone: Backbone, train_store, val_store, out_dir: str | Path, *, method: str = "ats",
             head_type: str | None = None, max_scale: float = MAX_SCALE, training: TrainingConfig | None = None,
             label: str | None = None, overwrite: bool = False, resume: bool = False, progress: bool = True,
             dist: Dist | None = None) -> tuple[ATSCalibrator, bool]:
    """Train an ATS-family head (`method`: ats, selective-temperature, selective-linear) and save it to `out_dir`.

    A head saved there with the same fingerprint is reused; another is refused unless `overwrite`. `resume`
    continues the checkpoints in `out_dir.work` only if they were made with the same fingerprint. Only the main
    process writes.

    Args:
        backbone: the frozen backbone.
        train_store: the training features.
        val_store: the held-out features for per-epoch validation, or None.
        out_dir: the head's folder (checkpoints go to `<out_dir>.work`).
        method: a registry name of the ATS family (`token_head`).
        head_type: overrides the method's head type.
        max_scale: the clamp on exp(tau).
        training: the training options; default `TrainingConfig()`.
        label: the method's name in tables (default: `method`), e.g. "ats-top-label" for ATS trained with another
            loss.
        overwrite: replace a head made with other options instead of refusing.
        resume: continue the checkpoints of an interrupted run with the same fingerprint.
        progress: show progress bars.
        dist: the process's place in a multi-process job; default one process.

    Returns:
        (the trained or reused calibrator, whether it was reused).

    Raises:
        ATSError: if `method` is unknown, the saved head or interrupted training was made with other options
            (without `overwrite`), or training fails.
    """
    dist = dist or SINGLE
    out_dir = Path(out_dir)
    training = training or TrainingConfig()
    preset = head_preset(method, head_type, label)
    calibrator = ATSCalibrator.for_backbone(backbone, max_scale=max_scale, seed=training.seed, **preset)
    fp = head_fingerprint(store_fingerprint(train_store), getattr(train_store, "scale_summary", None),
                          calibrator.config_.head, max_scale, calibrator.config_.method, training)
    if (out_dir / CONFIG_NAME).exists() and check_reuse(out_dir, "head", stored_fingerprint(out_dir), fp,
                                                        overwrite=overwrite):
        return ATSCalibrator.from_pretrained(out_dir, backbone=backbone), True
    work = out_dir.with_name(out_dir.name + ".work")
    if work.exists() and (not resume or stored_fingerprint(work) != fp):
        if resume and not overwrite:
            raise refusal(work, "interrupted training", stored_fingerprint(work), fp)
        if dist.is_main:
            shutil.rmtree(work)  # checkpoints of a run that is not being resumed
    dist.barrier()
    if dist.is_main:
        work.mkdir(parents=True, exist_ok=True)
        write_fingerprint(work, fp)
    result = train_ats(calibrator, train_store, backbone, config=training,
                       validate=head_validator(val_store, backbone, training, dist), out_dir=work, resume=resume,
                       progress=progress, dist=dist)
    if dist.is_main:
        calibrator.save_pretrained(out_dir)
        write_fingerprint(out_dir, fp)
        write_json(out_dir / "training_history.json", {"steps": result.history, "epochs": result.epochs})
    dist.barrier()
    return calibrator, False


def head_validator(val_store, backbone: Backbone, training: TrainingConfig, dist: Dist):
    """What `fit_head` validates each epoch on the held-out split: the token-level metrics and the held-out training
    objective (the model-selection criterion); None without a held-out split."""
    if val_store is None:
        return None
    token_metrics = token_validator(val_store, backbone, dist)

    def validate(calibrator: ATSCalibrator) -> dict:
        return {**token_metrics(calibrator),
                "objective": heldout_objective(calibrator, val_store, backbone, training, dist)}

    return validate


def train_head(backbone: Backbone, train_store, val_store, out_dir: str | Path, **options) -> ATSCalibrator:
    """The calibrator of `fit_head` alone (for scripts that do not ask whether it was reused).

    Raises:
        ATSError: as `fit_head`.
    """
    return fit_head(backbone, train_store, val_store, out_dir, **options)[0]


def check_before_loading(features_dir: str | Path, head_dir: str | Path | None, data: DataConfig, *,
                         head_type: str | None = None, max_scale: float = MAX_SCALE, method: str = "ats",
                         training: TrainingConfig | None = None, overwrite: bool = False) -> None:
    """Refuse, before the backbone loads, a rerun whose data or head options differ from those of the features and
    head already in the run folder. The head's fingerprint is `fit_head`'s, built from the stored features'
    fingerprint and the stored head's sizes (which come from the backbone, compared once it is loaded).

    Args:
        features_dir: the run's features folder.
        head_dir: the run's head folder, or None.
        data: the data options of the rerun.
        head_type: the head type of the rerun (beats the method's preset, as in `fit_head`).
        max_scale: the clamp on exp(tau) of the rerun.
        method: the registry name of the rerun.
        training: the training options of the rerun; None: the head is not checked.
        overwrite: check nothing (the old results will be replaced).

    Raises:
        ATSError: naming the options that differ, or if the data cannot be read.
    """
    if overwrite:
        return
    data_now = data_fingerprint(data)
    stored = {split: _stored(Path(features_dir) / split) for split in SPLITS}
    for split, old in stored.items():
        if old is not None and old.get("data") != data_now:
            raise refusal(Path(features_dir) / split, "features", {"data": old.get("data")}, {"data": data_now})
    old = _stored(Path(head_dir)) if head_dir is not None else None
    if old is None or training is None:
        return
    features = stored["train"]
    summary = features.get("scale_summary") if features is not None else DEFAULT_SUMMARY.describe()
    preset = head_preset(method, head_type)
    head = ATSCalibrator.head_config(old.get("head", {}).get("hidden_size", HeadConfig().hidden_size), **preset)[0]
    now = head_fingerprint(features if features is not None else old.get("features"),
                           ScaleSummarySpec(**summary) if summary is not None else None, head, max_scale,
                           preset["method"], training)
    if old != now:
        raise refusal(head_dir, "head", old, now)


def _stored(folder: Path) -> dict | None:
    """The fingerprint stored in `folder`, or None when the folder or its fingerprint is missing."""
    return stored_fingerprint(folder) if folder.is_dir() else None


def fit_calibrator(name: str, source: FeatureSource, out_dir: str | Path, *, shared_pass: bool = True,
                   overwrite: bool = False) -> tuple[Calibrator, bool]:
    """Fit one (non-head) calibrator on `source` and save it in `out_dir` with its fingerprint, or reuse the one
    saved there with the same fingerprint; the fitted calibrator joins `source.fitted` (later methods may read it).

    Args:
        name: its registry name.
        source: the fitting data (its `fit_tokens` and shared aids).
        out_dir: the calibrator's folder.
        shared_pass: fitted on the source's scale summary (recorded in the fingerprint).
        overwrite: replace a calibrator made with other options instead of refusing.

    Returns:
        (the fitted or reused calibrator, whether it was reused).

    Raises:
        ATSError: if `name` is unknown, the saved calibrator was made with other options (without `overwrite`), or
            the fit fails.
    """
    target = Path(out_dir)
    fp = calibrator_fingerprint(name, source.store, source.fit_tokens, shared_pass=shared_pass)
    if (target / CONFIG_NAME).exists() and check_reuse(target, f"calibrator {name!r}", stored_fingerprint(target),
                                                       fp, overwrite=overwrite):
        source.fitted[name] = load_calibrator(target, backbone=source.backbone)
        return source.fitted[name], True
    logger.info("fitting %s on %s of %s response tokens", name, source.fit_tokens or "all",
                source.store.meta["response_tokens"])
    start = time.time()
    calibrator = calibrator_for(name, source).fit(source)
    calibrator.save_pretrained(target)
    write_fingerprint(target, fp)
    write_json(target / "fit_seconds.json", {"seconds": round(time.time() - start, 2)})
    source.fitted[name] = calibrator
    return calibrator, False


def fit_calibrators(backbone: Backbone, train_store, out_dir: str | Path, names: tuple[str, ...] = BASELINES, *,
                    val_store=None, training: TrainingConfig | None = None, fit_tokens: int | None = None,
                    shared_pass: bool = True, overwrite: bool = False, progress: bool = True
                    ) -> dict[str, Calibrator]:
    """Fit each named calibrator on the same response tokens ATS trains on; saved under `out_dir/<name>` with its
    fingerprint and reused on a rerun with the same options. ATS-family names (the controls) are trained with
    `training`, exactly like the ATS head (`fit_head`), the others by `fit_calibrator` on one shared source.
    fit_tokens: token-level methods fit on a fixed seeded subset of this many training tokens (their one or two
    parameters need far fewer tokens than a head; the cost of each pass over the full vocabulary shrinks in
    proportion).

    Args:
        backbone: the frozen backbone.
        train_store: the training features.
        out_dir: the folder holding one subfolder per calibrator.
        names: registry names, in fitting order (scaling-binning reuses an earlier temperature fit).
        val_store: the held-out features, for the ATS-family names.
        training: the training options of the ATS-family names.
        fit_tokens: fit token-level methods on a fixed seeded subset of this many training tokens; None: all.
        shared_pass: fit temperature scaling, the binning methods, isotonic regression and Thermometer from the
            features' scale summary when they carry one (no pass over the vocabulary), and keep the fitting logits in
            memory for vector scaling's epochs (and the passes of features without a summary) when they fit in 6 GiB
            (`LogitReplay`); False: every method passes over the logits itself (the reference route, slower).
        overwrite: replace calibrators made with other options instead of refusing.
        progress: show progress bars.

    Returns:
        name -> fitted (or reused) calibrator, in the order of `names`.

    Raises:
        ATSError: if a name is unknown, a saved calibrator was made with other options (without `overwrite`), or a
            fit fails.
    """
    out_dir = Path(out_dir)
    fitted = {}
    source = FeatureSource(backbone, train_store, fit_tokens=fit_tokens, exact=not shared_pass,
                           replay=LogitReplay() if shared_pass else None)
    for name in names:
        if calibrator_class(name).token_head:  # ATS and its controls: trained like the ATS head
            fitted[name] = fit_head(backbone, train_store, val_store, out_dir / name, method=name, training=training,
                                    overwrite=overwrite, progress=progress)[0]
        else:
            fitted[name] = fit_calibrator(name, source, out_dir / name, shared_pass=shared_pass,
                                          overwrite=overwrite)[0]
    return fitted
