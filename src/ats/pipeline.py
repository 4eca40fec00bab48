"""End-to-end steps shared by the CLI, the demo and the benchmarks: data -> features -> head -> baselines -> eval.

Each step writes into a run folder and is skipped when its output is already there, so a run that stopped can be
repeated with the same command and only the unfinished work is done.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from .ats import ATSCalibrator
from .backbone import Backbone
from .calibrators import CALIBRATORS, build_calibrator, load_calibrator
from .calibrators.base import CONFIG_NAME, Calibrator
from .data import load_instructions, tokenize_instructions, train_val_split
from .distributed import SINGLE, Dist
from .features import (META_NAME, FeatureStore, OnlineFeatures, extract_features, shard_plan,
                       write_meta)
from .io import write_json
from .training import TrainingConfig, train_ats

logger = logging.getLogger(__name__)

BASELINES = ("temperature", "vector", "scaling-binning", "histogram", "isotonic", "thermometer")


@dataclass
class DataOptions:
    source: str = "alpaca_gpt4"
    limit: int | None = None
    max_length: int = 512
    val_fraction: float = 0.1
    seed: int = 0
    batch_tokens: int = 8192
    feature_dtype: str = "float16"
    shard_sequences: int = 256


def prepare_examples(backbone: Backbone, options: DataOptions | None = None, *, verbose: bool = True):
    """Tokenized (train, val) examples and the data description stored in the feature meta."""
    options = options or DataOptions()
    records = load_instructions(options.source, limit=options.limit, seed=options.seed)
    examples, stats = tokenize_instructions(backbone.tokenizer, records, max_length=options.max_length)
    logger.info("instruction data %s: %s", options.source, stats.summary())
    if verbose:
        print(f"[data] {options.source}: {stats.summary()}")
    train, val = train_val_split(examples, val_fraction=options.val_fraction, seed=options.seed)
    meta = {"data_source": options.source, "max_length": options.max_length, "truncated": stats.truncated,
            "dropped": stats.dropped}
    return train, val, meta


def prepare_features(backbone: Backbone, features_dir: str | Path, options: DataOptions | None = None,
                     *, progress: bool = True, dist: Dist | None = None) -> tuple[FeatureStore, FeatureStore]:
    """Tokenize the instruction data, split it, and extract (or reuse) train/val feature caches.

    dist: with several processes, rank r extracts shards r, r+W, ... of each split; the main process writes
    meta.json once every rank has finished (a barrier), then every rank opens the stores.
    """
    options = options or DataOptions()
    dist = dist or SINGLE
    features_dir = Path(features_dir)
    stores = []
    if all((features_dir / split / META_NAME).exists() for split in ("train", "val")):
        stores = [FeatureStore(features_dir / split) for split in ("train", "val")]
        for store in stores:
            store.check_backbone(backbone)
        return stores[0], stores[1]
    train, val, meta = prepare_examples(backbone, options, verbose=dist.is_main)
    if not dist.distributed:
        for split, part in (("train", train), ("val", val)):
            stores.append(extract_features(backbone, part, features_dir / split, batch_tokens=options.batch_tokens,
                                           shard_sequences=options.shard_sequences, dtype=options.feature_dtype,
                                           progress=progress, extra_meta={**meta, "split": split}))
        return stores[0], stores[1]
    n_shards = {}
    for split, part in (("train", train), ("val", val)):
        n_shards[split] = len(shard_plan(part, options.shard_sequences))
        extract_features(backbone, part, features_dir / split, batch_tokens=options.batch_tokens,
                         shard_sequences=options.shard_sequences, dtype=options.feature_dtype,
                         shards=dist.my_shards(n_shards[split]), progress=progress and dist.is_main)
    dist.barrier()  # every rank's shards are written
    if dist.is_main:
        for split in ("train", "val"):
            write_meta(features_dir / split, backbone, n_shards=n_shards[split], dtype=options.feature_dtype,
                       extra={**meta, "split": split})
    dist.barrier()  # meta.json is there
    return FeatureStore(features_dir / "train"), FeatureStore(features_dir / "val")


def online_features(backbone: Backbone, options: DataOptions | None = None, *, verbose: bool = True
                    ) -> tuple[OnlineFeatures, OnlineFeatures]:
    """Train/val feature sources that run the backbone inside the training loop (no cache; large models)."""
    options = options or DataOptions()
    train, val, meta = prepare_examples(backbone, options, verbose=verbose)
    return tuple(OnlineFeatures(backbone, part, shard_sequences=options.shard_sequences,
                                batch_tokens=options.batch_tokens, extra_meta={**meta, "split": split})
                 for split, part in (("train", train), ("val", val)))  # type: ignore[return-value]


def train_head(backbone: Backbone, train_store: FeatureStore, val_store: FeatureStore | None, out_dir: str | Path,
               *, head_type: str = "transformer", loss_type: str = "selective", alpha: float = 0.5,
               weighting: str = "token", max_scale: float = 10.0, training: TrainingConfig | None = None,
               resume: bool = False, progress: bool = True, dist: Dist | None = None) -> ATSCalibrator:
    """Train an ATS head and save it to `out_dir` (reused if already saved there); only the main process writes."""
    dist = dist or SINGLE
    out_dir = Path(out_dir)
    if (out_dir / CONFIG_NAME).exists() and not resume:
        return ATSCalibrator.from_pretrained(out_dir, backbone=backbone)
    calibrator = ATSCalibrator.for_backbone(backbone, head_type=head_type, loss_type=loss_type, alpha=alpha,
                                            weighting=weighting, max_scale=max_scale)
    result = train_ats(calibrator, train_store, backbone, config=training, val_store=val_store,
                       out_dir=out_dir.with_name(out_dir.name + ".work"), resume=resume, progress=progress,
                       dist=dist)
    if dist.is_main:
        calibrator.save_pretrained(out_dir)
        write_json(out_dir / "training_history.json", {"steps": result.history, "epochs": result.epochs})
    dist.barrier()
    return calibrator


def fit_baselines(backbone: Backbone, train_store: FeatureStore, out_dir: str | Path,
                  names: tuple[str, ...] = BASELINES) -> dict[str, Calibrator]:
    """Fit each baseline on the same response tokens ATS trains on; saved under `out_dir/<name>` and reused."""
    out_dir = Path(out_dir)
    chunks = train_store.logit_chunks(backbone.logits)
    fitted = {}
    for name in names:
        target = out_dir / name
        if (target / CONFIG_NAME).exists():
            fitted[name] = load_calibrator(target)
            continue
        print(f"[baselines] fitting {name} on {train_store.meta['response_tokens']} response tokens")
        if hasattr(CALIBRATORS.get(name), "fit_sequences"):  # Thermometer: one temperature per prompt
            calibrator = build_calibrator(name, hidden_size=train_store.hidden_size).fit_sequences(
                train_store, backbone.logits)
        elif name == "scaling-binning" and "temperature" in fitted:  # same data: reuse T, save a full fit
            calibrator = build_calibrator(name).fit(chunks, temperature=fitted["temperature"].temperature)
        else:
            calibrator = build_calibrator(name).fit(chunks)
        calibrator.save_pretrained(target)
        fitted[name] = calibrator
    return fitted
