"""What learns from answers: method specs ("transformer", ..., "thermometer", "+tokens"), fresh calibrators, the one
training call of `ats train --on answers` (and of the answers protocol of benchmarks/protocols/), and the reuse
rule of a saved head."""
from __future__ import annotations

import logging
from pathlib import Path

from ..calibrators.base import CONFIG_NAME
from ..errors import ATSError
from ..fingerprint import check_reuse, write_fingerprint
from ..io import read_json, write_json
from ..model.heads.config import MAX_SCALE
from ..training.answer_objective import answer_record, train_on_answers
from ..training.answers import AnswerSet
from ..training.config import TrainingConfig
from .answer_pool import AnswerPool, pool_names, pool_tasks
from .fingerprints import answer_head_fingerprint, stored_answer_head_fingerprint
from .pipeline import prepare_answers

logger = logging.getLogger(__name__)

HEAD_KINDS = ("transformer", "linear", "mlp", "constant", "thermometer", "probe")
UNTOKENED = ("thermometer", "probe")  # kinds without the '+tokens' term (no per-token head to train on tokens)


def parse_spec(spec: str, *, field: str) -> tuple[str, bool]:
    """(kind, with the token term) of a method spec: "transformer", ..., "thermometer", optionally "+tokens".

    Raises:
        ATSError: naming `field`, if the spec names an unknown kind or suffix (Thermometer has no token term).
    """
    kind, plus, extra = spec.partition("+")
    if kind not in HEAD_KINDS or (plus and extra != "tokens") or (extra and kind in UNTOKENED):
        raise ATSError(f"{field}: unknown spec {spec!r} (one of {', '.join(HEAD_KINDS)}, an ATS head optionally "
                       "with '+tokens')")
    return kind, bool(extra)


def fresh_head(backbone, kind: str, seed: int, method: str, *, max_scale: float = MAX_SCALE, **thermometer_options):
    """An untrained calibrator for `backbone` (identity at start): an ATS-family head of type `kind` (scales clamped
    at `max_scale`), or a Thermometer sized for the backbone (its schedule options recorded in its config)."""
    from ..calibrators.ats import ATSCalibrator
    from ..calibrators.thermometer import Thermometer

    if kind == "thermometer":
        return Thermometer(hidden_size=backbone.hidden_size, seed=seed, **thermometer_options)
    return ATSCalibrator.for_backbone(backbone, head_type=kind, seed=seed, method=method, max_scale=max_scale)


def train_spec(backbone, sets: list[AnswerSet], pool: AnswerPool, *, kind: str, tokens: bool,
               training: TrainingConfig, method: str, max_scale: float = MAX_SCALE, token_store=None,
               progress: bool = False):
    """A fresh calibrator of `kind` trained on the answers of `sets` through the one loop (`train_on_answers`) with
    `training` (its answer loss; with `tokens`, plus `pool.token_weight` x the top-label term on `token_store`'s
    instruction tokens, with the pool's window and subset): the one training call of `ats train --on answers` and of
    the answers protocol. A probe is fitted, not trained by the loop (`ats.training.probe_fit`), and records
    `training`'s answer record for reuse; it leaves each set's task out in turn to choose its options."""
    if kind == "probe":
        from ..training.probe_fit import fit_probe

        named = {a.name: a for a in (sets.values() if isinstance(sets, dict) else sets)}  # folds by task name
        info = {"hidden_size": backbone.hidden_size, "base_model": backbone.name, "revision": backbone.revision}
        probe = fit_probe(named, backbone.logits, info, progress=progress)
        probe.config_.training = {**answer_head_record(training, pool, False, tasks=[a.name for a in named.values()]),
                                  "questions": [a.meta.get("task", {"name": a.name}) for a in named.values()]}
        return probe
    calibrator = fresh_head(backbone, kind, training.seed, method, max_scale=max_scale,
                            lr=training.learning_rate(0), epochs=training.epochs, batch_size=training.batch_size)
    result = train_on_answers(calibrator, sets, backbone.logits, config=training,
                              token_store=token_store if tokens else None,
                              token_weight=pool.token_weight if tokens else 0.0, token_max=pool.token_max,
                              token_window=pool.token_window, progress=progress)
    calibrator.training_history_ = {"steps": result.history, "epochs": result.epochs}
    return calibrator


def answer_head_record(training: TrainingConfig, pool: AnswerPool, tokens: bool, *,
                       tasks: list[str] | None = None) -> dict:
    """The training record a calibrator trained on answers carries (compared on reuse): the training options (its
    answer loss), the tasks (default: the pool's) and the token term."""
    return answer_record(training, tasks=pool_names(pool.mmlu_per_subject) if tasks is None else tasks,
                         token_weight=pool.token_weight if tokens else 0.0, token_max=pool.token_max,
                         token_window=pool.token_window)


def reusable_answer_head(head_dir: Path, record: dict, *, head_type: str, max_scale: float,
                         overwrite: bool) -> bool:
    """Whether `head_dir` holds a calibrator trained with `record`, `head_type` and `max_scale` (its fingerprint,
    read from its JSON config before any model loads, compared by `fingerprint.check_reuse`); False when there is
    none or `overwrite` replaces it.

    Raises:
        ATSError: if it holds a calibrator trained otherwise and `overwrite` is False, naming what differs.
    """
    path = head_dir / CONFIG_NAME
    if not path.is_file():
        return False
    want = answer_head_fingerprint(head_type, None if head_type in UNTOKENED else max_scale, record)
    return check_reuse(head_dir, "head", stored_answer_head_fingerprint(read_json(path), record), want,
                       overwrite=overwrite)


def check_answer_head(out: str | Path, *, spec: str, training: TrainingConfig, max_scale: float, pool: AnswerPool,
                      token_features: str | Path | None, overwrite: bool) -> bool:
    """Check a `train_answer_head` request before any model loads: whether OUT/head holds a head trained with these
    settings (reused), False when there is none or `overwrite` replaces it.

    Raises:
        ATSError: if the spec is unknown, "+tokens" comes without a features folder holding train/, or OUT/head holds
            a head trained otherwise (without `overwrite`).
    """
    kind, tokens = parse_spec(spec, field="--method")
    if tokens and token_features is None:
        raise ATSError(f"--method {spec}: the token term reads instruction features; pass --token-features DIR "
                       "(an `ats train` features folder of this model)")
    if tokens and not (Path(token_features) / "train").is_dir():
        raise ATSError(f"--method {spec}: --token-features must name an `ats train` features folder (with train/), "
                       f"got {str(token_features)!r}")
    record = answer_head_record(training, pool, tokens)
    return reusable_answer_head(Path(out) / "head", record, head_type=kind, max_scale=max_scale, overwrite=overwrite)


def train_answer_head(backbone, out: str | Path, *, spec: str, training: TrainingConfig, max_scale: float = MAX_SCALE,
                      pool: AnswerPool | None = None, token_features: str | Path | None = None,
                      overwrite: bool = False, progress: bool = True, reuse: bool | None = None):
    """`ats train --on answers`: the pool's answers (cached in OUT/answers), a calibrator trained on all of them with
    `training` (its answer loss), saved in OUT/head (reused when it was trained with the same settings).

    Args:
        backbone: the frozen backbone.
        out: the run folder.
        spec: what is trained (`parse_spec`): an ATS head type ("transformer", "linear", "mlp", "constant": the
            global control), "thermometer", or an ATS head with "+tokens" (plus `pool.token_weight` x the top-label
            loss on the instruction tokens of `token_features`).
        training: the answer loss ("answer-log" or "answer-brier"), lr (None: ANSWER_LR), epochs, batch_size
            (questions per step), seed, ...
        max_scale: the clamp on exp(tau) (ATS heads).
        pool: the pool's sizes and the token term's settings; default `AnswerPool()`.
        token_features: an instruction feature folder of the same backbone (its train/ split), for "+tokens".
        overwrite: replace a head trained with other settings instead of refusing.
        progress: show progress bars.
        reuse: what `check_answer_head` with the same arguments returned (the CLI asks it before the model loads);
            None: asked here.

    Returns:
        (the calibrator, name -> the pool's answer sets, whether the head was reused).

    Raises:
        ATSError: as `check_answer_head`.
    """
    from ..calibrators import load_calibrator
    from ..training.features import FeatureStore

    pool = pool or AnswerPool()
    if reuse is None:
        reuse = check_answer_head(out, spec=spec, training=training, max_scale=max_scale, pool=pool,
                                  token_features=token_features, overwrite=overwrite)
    kind, tokens = parse_spec(spec, field="--method")
    out = Path(out)
    head_dir = out / "head"
    sets = {name: prepare_answers(backbone, task, out / "answers" / name, overwrite=overwrite, progress=progress)
            for name, task in pool_tasks(pool.pool_size, pool.mmlu_per_subject).items()}
    if reuse:
        logger.info("reusing the head in %s (same settings)", head_dir)
        return load_calibrator(head_dir, backbone), sets, True
    token_store = None
    if tokens:
        token_store = FeatureStore(Path(token_features) / "train")
        token_store.check_backbone(backbone)
    calibrator = train_spec(backbone, sets if kind == "probe" else list(sets.values()), pool, kind=kind,
                            tokens=tokens, training=training,
                            method=f"{kind}-answers", max_scale=max_scale, token_store=token_store, progress=progress)
    calibrator.save_pretrained(head_dir)
    # the files an instruction-trained head's folder has (`pipeline.fit_head`): its fingerprint and its history
    record = answer_head_record(training, pool, tokens)
    write_fingerprint(head_dir, answer_head_fingerprint(kind, None if kind in UNTOKENED else max_scale, record))
    history = getattr(calibrator, "training_history_", None) or {"selection": getattr(calibrator, "selection", None)}
    write_json(head_dir / "training_history.json", history)
    return calibrator, sets, False
