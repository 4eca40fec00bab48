"""End-to-end steps shared by the CLI, the demo and the benchmarks: data -> features -> head -> baselines -> eval.

Each step writes into a run folder with a fingerprint of everything that determines it (`ats.fingerprint`). A rerun
with the same options reuses the finished step and says so; a rerun with other options is refused, naming what
differs, unless `overwrite=True`; an interrupted step continues (`resume`) only with the same fingerprint.
"""

from __future__ import annotations

import logging
import math
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

from ..calibrators import calibrator_class, calibrator_for, entry, load_calibrator
from ..calibrators.ats import ATSCalibrator
from ..calibrators.base import CONFIG_NAME, Calibrator
from ..calibrators.sketch import TAIL_BINS, TOP_K, LogitSketch
from ..evaluation.token_eval import token_validator
from ..fingerprint import check_reuse, digest, make_fingerprint, refusal, stored_fingerprint, write_fingerprint
from ..io import write_json
from ..model.backbone import Backbone
from ..model.heads import HeadConfig
from ..model.scale_summary import ScaleSummarySpec
from ..training.config import TrainingConfig
from ..training.data import DataConfig, load_instructions, prepare_examples
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

logger = logging.getLogger(__name__)

BASELINES = ("temperature", "vector", "scaling-binning", "histogram", "isotonic", "thermometer")
SPLITS = ("train", "val")
# options that change how work is done, never its result
_NOT_IN_FINGERPRINT = {"batch_tokens", "save_every"}


def data_fingerprint(config: DataConfig) -> dict:
    """The data options that determine the examples, and a checksum of the records they select.

    Loads the records (so a changed data file changes the fingerprint).

    Args:
        config: the data options.

    Returns:
        The options (less those that never change the result), "records" (their number) and "checksum".

    Raises:
        ATSError: if the data cannot be read.
    """
    records = load_instructions(config.source, limit=config.limit, seed=config.seed)
    options = {k: v for k, v in config.to_dict().items() if k not in _NOT_IN_FINGERPRINT}
    return {**options, "records": len(records), "checksum": digest([vars(r) for r in records])}


def features_fingerprint(backbone: Backbone, config: DataConfig, split: str, *, data: dict | None = None,
                         summary: ScaleSummarySpec | None = None) -> dict:
    """The fingerprint of one split's feature cache.

    Args:
        backbone: the backbone the features come from (its `describe()` is recorded).
        config: the data options.
        split: "train" or "val".
        data: `data_fingerprint(config)` if already computed.
        summary: the settings of the scale summary stored with the features, or None (hidden states only).

    Returns:
        A "features" fingerprint of the backbone, the data, the split and the scale summary's settings.
    """
    return make_fingerprint("features", backbone=backbone.describe(), data=data or data_fingerprint(config),
                            split=split, **summary_meta(summary))


def _without_summary(fingerprint: dict | None) -> dict | None:
    """A features fingerprint less its scale summary: what a folder extracted before summaries existed records."""
    return None if fingerprint is None else {k: v for k, v in fingerprint.items() if k != "scale_summary"}


def training_options(training: TrainingConfig, summary: ScaleSummarySpec | None) -> dict:
    """The training options a head's fingerprint records: those that can change the result, with the loss route.

    `exact_loss` is replaced by the route the trainer takes: "loss_route" names the scale summary when the loss is
    computed from it, and is absent on the exact route, so heads trained before the summary existed (always exact)
    keep their fingerprints.

    Args:
        training: the training options.
        summary: the scale summary of the training features (`FeatureStore.scale_summary`), or None.

    Returns:
        The options, JSON-ready.
    """
    options = {k: v for k, v in training.to_dict().items() if k not in _NOT_IN_FINGERPRINT | {"exact_loss"}}
    if summary is not None and not training.exact_loss:
        options["loss_route"] = {"scale_summary": summary.describe()}
    return options


def prepare_features(backbone: Backbone, features_dir: str | Path, config: DataConfig | None = None, *,
                     overwrite: bool = False, progress: bool = True, dist: Dist | None = None,
                     summary: ScaleSummarySpec | None = DEFAULT_SUMMARY) -> tuple[FeatureStore, FeatureStore]:
    """Tokenize the instruction data, split it, and extract (or reuse) the train / val feature caches.

    Finished features are reused only for the same backbone, data and options (the scale summary's settings
    included); a partial extraction resumes only with them. A finished folder extracted before scale summaries
    existed (its fingerprint has none, all else equal) is reused as it is: heads train on it by the exact
    full-vocabulary route, and `overwrite=True` re-extracts it with the summary.

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
        if (summary is not None and finished[split] and not overwrite and old is not None
                and "scale_summary" not in old and old == _without_summary(prints[split])):
            logger.info("%s: features extracted without a scale summary; heads train on them by the exact "
                        "full-vocabulary loss (--overwrite re-extracts them with the summary)", folder)
            continue
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


def _store_fingerprint(store) -> dict:
    """The fingerprint of a feature source: the one recorded by `prepare_features` / `online_features`, else (features
    extracted by hand) the digest of its meta.json, which lists every shard's sha256."""
    fp = getattr(store, "fingerprint", None)
    directory = getattr(store, "directory", None)
    if fp is None and directory is not None:
        fp = stored_fingerprint(directory)
    return fp if fp is not None else {"meta_digest": digest(store.meta)}


@dataclass
class FeatureSource:
    """What calibrators are fitted on (`ats.calibrators.FitSource`): the training split of one feature cache, and
    how an ATS-family head is trained on it (the run's training config, validated on the held-out split)."""

    backbone: Backbone
    store: FeatureStore
    val_store: FeatureStore | None = None
    training: TrainingConfig | None = None
    work_dir: Path | None = None  # checkpoints of head training
    resume: bool = False
    progress: bool = True
    dist: Dist = field(default_factory=lambda: SINGLE)
    fit_tokens: int | None = None  # token-level methods fit on a fixed seeded subset of this many tokens
    fitted: dict = field(default_factory=dict)  # name -> calibrator fitted on this source (reusable by others)
    history: object = None  # the TrainResult of the last head trained
    use_sketch: bool = True  # fit the global-temperature, binning and Thermometer methods on one shared sketch
    use_summary: bool = True  # fit temperature scaling and Thermometer from the features' scale summary, if any
    cache_bytes: int = 6 * 2**30  # keep the fitting tokens' float32 logits in memory if they fit in this
    _sketch: LogitSketch | None = field(default=None, repr=False)
    _summary: object = field(default=None, repr=False)
    _cache: list | None = field(default=None, repr=False)

    @property
    def hidden_size(self) -> int:
        """H, the backbone's hidden size."""
        return self.backbone.hidden_size

    @property
    def logits_fn(self):
        """The backbone's output layer, h (n, H) -> z (n, V)."""
        return self.backbone.logits

    @property
    def logit_chunks(self):
        """The training split's `LogitChunks` (over `fit_tokens` seeded response tokens when set).

        When the fitting tokens' float32 logits fit in `cache_bytes`, the first complete pass keeps them and every
        later pass (vector scaling's epochs, another method) replays them from memory without the output layer's
        matmul; the values are the same. Consumers must not modify the chunks in place.
        """
        chunks = self.store.logit_chunks(self.backbone.logits, max_tokens=self.fit_tokens)
        tokens = min(self.fit_tokens or math.inf, self.store.meta["response_tokens"])
        if tokens * self.backbone.vocab_size * 4 > self.cache_bytes:
            return chunks

        def cached():
            if self._cache is not None:
                yield from self._cache
                return
            kept = []
            for logits, labels in chunks():
                kept.append((logits, labels))
                yield logits, labels
            self._cache = kept  # only a complete pass is kept

        return cached

    @property
    def sketch(self) -> LogitSketch | None:
        """The `LogitSketch` of the fitting tokens, built on first use in one pass over `logit_chunks` and shared by
        every method that fits on it; None when `use_sketch` is off."""
        if self.use_sketch and self._sketch is None:
            logger.info("sketching the logits of %s response tokens (one full-vocabulary pass)",
                        self.fit_tokens or self.store.meta["response_tokens"])
            self._sketch = LogitSketch.from_chunks(self.logit_chunks)
        return self._sketch

    @property
    def summary(self):
        """(N, D) the scale summary rows of the fitting tokens, aligned with `logit_chunks`, read once from the
        features; None when `use_summary` is off or the features carry no summary."""
        if self.use_summary and self._summary is None:
            self._summary = getattr(self.store, "response_summary", lambda **_: None)(max_tokens=self.fit_tokens)
        return self._summary if self.use_summary else None

    @property
    def sequence_ids(self):
        """(N,) the sequence of every fitting token, aligned with `logit_chunks` and `sketch`."""
        return self.store.response_sequence_ids(max_tokens=self.fit_tokens)

    def train_head(self, calibrator: ATSCalibrator) -> None:
        """Train `calibrator.head` in place with the run's training config; the result goes to `history`.

        With a held-out split, each epoch is validated by token-level metrics and the held-out training objective.

        Args:
            calibrator: the ATS-family calibrator to train.

        Raises:
            ATSError: as `train_ats`.
        """
        training = self.training or TrainingConfig()
        validate = None
        if self.val_store is not None:
            token_metrics = token_validator(self.val_store, self.backbone, self.dist)

            def validate(cal: ATSCalibrator) -> dict:  # token-level metrics and the held-out training objective
                return {**token_metrics(cal),
                        "objective": heldout_objective(cal, self.val_store, self.backbone, training, self.dist)}

        result = train_ats(calibrator, self.store, self.backbone, config=training,
                           validate=validate, out_dir=self.work_dir, resume=self.resume, progress=self.progress,
                           dist=self.dist)
        self.history = result


def head_fingerprint(store, head: HeadConfig, max_scale: float, method: str, training: TrainingConfig) -> dict:
    """The fingerprint of a trained head.

    Args:
        store: the training features (their fingerprint, or the digest of their meta.json, is recorded).
        head: the head's config.
        max_scale: the clamp on exp(tau).
        method: the method's name in tables.
        training: the training options (less those that never change the result).

    Returns:
        A "head" fingerprint.
    """
    return make_fingerprint("head", features=_store_fingerprint(store), head=head.to_dict(), max_scale=max_scale,
                            method=method,
                            training=training_options(training, getattr(store, "scale_summary", None)))


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


def train_head(backbone: Backbone, train_store, val_store, out_dir: str | Path, *, method: str = "ats",
               head_type: str | None = None, max_scale: float = 10.0, training: TrainingConfig | None = None,
               label: str | None = None, overwrite: bool = False, resume: bool = False, progress: bool = True,
               dist: Dist | None = None) -> ATSCalibrator:
    """Train an ATS-family head (`method`: ats, selective-temperature, selective-linear) and save it to `out_dir`.

    A head saved there with the same fingerprint is reused; another is refused unless `overwrite`. `resume`
    continues the checkpoints in `out_dir.work` only if they were made with the same fingerprint. Only the main
    process writes.

    Args:
        backbone: the frozen backbone.
        train_store: the training features.
        val_store: the held-out features for per-epoch validation, or None.
        out_dir: the head's folder (checkpoints go to `<out_dir>.work`).
        method: a registry name whose `trains_head` is set.
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
        The trained (or reused) calibrator; its `reused` attribute says which.

    Raises:
        ATSError: if `method` is unknown, the saved head or interrupted training was made with other options
            (without `overwrite`), or training fails.
    """
    dist = dist or SINGLE
    out_dir = Path(out_dir)
    training = training or TrainingConfig()
    preset = head_preset(method, head_type, label)
    calibrator = ATSCalibrator.for_backbone(backbone, max_scale=max_scale, seed=training.seed, **preset)
    fp = head_fingerprint(train_store, calibrator.config_.head, max_scale, calibrator.config_.method, training)
    if (out_dir / CONFIG_NAME).exists() and check_reuse(out_dir, "head", stored_fingerprint(out_dir), fp,
                                                        overwrite=overwrite):
        calibrator = ATSCalibrator.from_pretrained(out_dir, backbone=backbone)
        calibrator.reused = True
        return calibrator
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
    source = FeatureSource(backbone, train_store, val_store, training, work, resume, progress, dist)
    calibrator.fit_source(source)
    if dist.is_main:
        calibrator.save_pretrained(out_dir)
        write_fingerprint(out_dir, fp)
        write_json(out_dir / "training_history.json", {"steps": source.history.history,
                                                       "epochs": source.history.epochs})
    dist.barrier()
    calibrator.reused = False
    return calibrator


def check_before_loading(features_dir: str | Path, head_dir: str | Path | None, data: DataConfig, *,
                         head_type: str | None = None, max_scale: float = 10.0, method: str = "ats",
                         training: TrainingConfig | None = None, overwrite: bool = False) -> None:
    """Refuse, before the backbone loads, a rerun whose data or head options differ from those of the features and
    head already in the run folder (the backbone's identity is compared once it is loaded).

    Args:
        features_dir: the run's features folder.
        head_dir: the run's head folder, or None.
        data: the data options of the rerun.
        head_type: the head type of the rerun (beats the method's preset, as in `train_head`).
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
    for split in SPLITS:
        old = stored_fingerprint(Path(features_dir) / split) if (Path(features_dir) / split).is_dir() else None
        if old is not None and old.get("data") != data_now:
            raise refusal(Path(features_dir) / split, "features", {"data": old.get("data")}, {"data": data_now})
    old = stored_fingerprint(head_dir) if head_dir is not None and Path(head_dir).is_dir() else None
    if old is None or training is None:
        return
    features = stored_fingerprint(Path(features_dir) / "train") if (Path(features_dir) / "train").is_dir() else None
    summary = features.get("scale_summary") if features is not None else DEFAULT_SUMMARY.describe()
    options = training_options(training, ScaleSummarySpec(**summary) if summary is not None else None)
    preset = head_preset(method, head_type)
    now = {"head_type": preset.get("head_type", HeadConfig().head_type), "max_scale": max_scale,
           "method": preset["method"], "training": options}
    before = {"head_type": old.get("head", {}).get("head_type"), "max_scale": old.get("max_scale"),
              "method": old.get("method"), "training": old.get("training")}
    if before != now:
        raise refusal(head_dir, "head", before, now)


def calibrator_fingerprint(name: str, store, fit_tokens: int | None, *, shared_pass: bool = True) -> dict:
    """The fingerprint of a fitted (non-head) calibrator.

    Args:
        name: its registry name.
        store: the training features.
        fit_tokens: the size of the token subset it is fitted on, or None for all.
        shared_pass: whether it was fitted from the shared `LogitSketch` and, for the methods that fit on it, the
            features' scale summary (each recorded for the methods that use it).

    Returns:
        A "calibrator" fingerprint.
    """
    cls = calibrator_class(name)
    sketched = shared_pass and cls.fits_on_sketch
    route = {"sketch": {"top_k": TOP_K, "tail_bins": TAIL_BINS}} if sketched else {}
    summary = getattr(store, "scale_summary", None)
    if shared_pass and cls.fits_on_summary and summary is not None:
        route["scale_summary"] = summary.describe()
    return make_fingerprint("calibrator", name=name, features=_store_fingerprint(store), fit_tokens=fit_tokens,
                            **route)


def fit_calibrators(backbone: Backbone, train_store, out_dir: str | Path, names: tuple[str, ...] = BASELINES, *,
                    val_store=None, training: TrainingConfig | None = None, fit_tokens: int | None = None,
                    shared_pass: bool = True, overwrite: bool = False, progress: bool = True
                    ) -> dict[str, Calibrator]:
    """Fit each named calibrator on the same response tokens ATS trains on; saved under `out_dir/<name>` with its
    fingerprint and reused on a rerun with the same options. ATS-family names (the controls) are trained with
    `training`, exactly like the ATS head. fit_tokens: token-level methods fit on a fixed seeded subset of this many
    training tokens (their one or two parameters need far fewer tokens than a head; the cost of each pass over the
    full vocabulary shrinks in proportion).

    Args:
        backbone: the frozen backbone.
        train_store: the training features.
        out_dir: the folder holding one subfolder per calibrator.
        names: registry names, in fitting order (scaling-binning reuses an earlier temperature fit).
        val_store: the held-out features, for the ATS-family names.
        training: the training options of the ATS-family names.
        fit_tokens: fit token-level methods on a fixed seeded subset of this many training tokens; None: all.
        shared_pass: fit temperature scaling and Thermometer from the features' scale summary when they carry one
            (no pass over the vocabulary), the binning methods and isotonic regression (and those two, on features
            without a summary) from one shared pass over the logits (a `LogitSketch`), and keep the fitting logits
            in memory for vector scaling's epochs when they fit in 6 GiB; False: every method passes over the
            logits itself (the reference route, slower).
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
    source = FeatureSource(backbone, train_store, progress=progress, fit_tokens=fit_tokens, use_sketch=shared_pass,
                           use_summary=shared_pass, cache_bytes=FeatureSource.cache_bytes if shared_pass else 0)
    for name in names:
        target = out_dir / name
        if calibrator_class(name).trains_head:  # ATS and its controls: trained like the ATS head
            fitted[name] = train_head(backbone, train_store, val_store, target, method=name, training=training,
                                      overwrite=overwrite, progress=progress)
            continue
        fp = calibrator_fingerprint(name, train_store, fit_tokens, shared_pass=shared_pass)
        if (target / CONFIG_NAME).exists() and check_reuse(target, f"calibrator {name!r}", stored_fingerprint(target),
                                                           fp, overwrite=overwrite):
            fitted[name] = source.fitted[name] = load_calibrator(target, backbone=backbone)
            continue
        logger.info("fitting %s on %s of %s response tokens", name, fit_tokens or "all",
                    train_store.meta["response_tokens"])
        start = time.time()
        calibrator = calibrator_for(name, source).fit_source(source)
        calibrator.save_pretrained(target)
        write_fingerprint(target, fp)
        write_json(target / "fit_seconds.json", {"seconds": round(time.time() - start, 2)})
        fitted[name] = source.fitted[name] = calibrator
    return fitted
