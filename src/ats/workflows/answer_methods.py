"""What learns from answers: method specs ("transformer", ..., "thermometer", "+tokens"), fresh calibrators, one
training call for the protocol and for `ats train --data answers`, and the reuse rule of a saved head."""
from __future__ import annotations

import logging
from pathlib import Path

from ..errors import ATSError
from ..evaluation.answers import AnswerSet
from ..io import read_json
from ..training.config import TrainingConfig
from .answer_pool import AnswerPlan, cached_answers, pool_names, pool_tasks
from .answer_training import answer_lr, answer_record, train_on_answers

logger = logging.getLogger(__name__)

HEAD_KINDS = ("transformer", "linear", "mlp", "constant", "thermometer")


def parse_spec(spec: str, *, field: str) -> tuple[str, bool]:
    """(kind, with the token term) of a method spec: "transformer", ..., "thermometer", optionally "+tokens".

    Raises:
        ATSError: naming `field`, if the spec names an unknown kind or suffix (Thermometer has no token term).
    """
    kind, plus, extra = spec.partition("+")
    if kind not in HEAD_KINDS or (plus and extra != "tokens") or (extra and kind == "thermometer"):
        raise ATSError(f"{field}: unknown spec {spec!r} (one of {', '.join(HEAD_KINDS)}, an ATS head optionally "
                       "with '+tokens')")
    return kind, bool(extra)


def method_spec(plan: AnswerPlan, method: str) -> tuple[str, float]:
    """(kind, token weight) of a plan method: `parse_spec`'s kind, and `plan.token_weight` for "+tokens" (the answer
    loss plus that weight x the top-label loss on instruction tokens), else 0.

    Raises:
        ATSError: if the spec names an unknown kind or suffix.
    """
    kind, tokens = parse_spec(plan.methods[method], field=f"answer plan method {method!r}")
    return kind, plan.token_weight if tokens else 0.0


def fresh_head(backbone, kind: str, seed: int, method: str, *, max_scale: float = 10.0, **thermometer_options):
    """An untrained calibrator for `backbone` (identity at start): an ATS-family head of type `kind` (scales clamped
    at `max_scale`), or a Thermometer sized for the backbone (its schedule options recorded in its config)."""
    from ..calibrators.ats import ATSCalibrator
    from ..calibrators.thermometer import Thermometer

    if kind == "thermometer":
        return Thermometer(hidden_size=backbone.hidden_size, seed=seed, **thermometer_options)
    return ATSCalibrator.for_backbone(backbone, head_type=kind, seed=seed, method=method, max_scale=max_scale)


def train_spec(backbone, sets: list[AnswerSet], plan: AnswerPlan, *, kind: str, token_weight: float,
               training: TrainingConfig, loss_type: str, method: str, max_scale: float = 10.0, token_store=None,
               progress: bool = False):
    """A fresh calibrator of `kind` trained on `sets` with `training` and `loss_type` (plus `token_weight` x the
    top-label term on `token_store`'s instruction tokens, with the plan's window and subset): the one training call of
    the protocol and of `ats train --data answers`."""
    calibrator = fresh_head(backbone, kind, training.seed, method, max_scale=max_scale, lr=answer_lr(training),
                            epochs=training.epochs, batch_size=training.batch_size)
    train_on_answers(calibrator, sets, backbone.logits, config=training, loss_type=loss_type,
                     token_store=token_store if token_weight > 0 else None, token_weight=token_weight,
                     token_max=plan.token_max, token_window=plan.token_window, progress=progress)
    return calibrator


def plan_training(plan: AnswerPlan, *, lr: float, seed: int) -> TrainingConfig:
    """The protocol's schedule: the plan's epochs and batch (one micro-batch a step), at `lr` and `seed`."""
    return TrainingConfig(lr=lr, epochs=plan.epochs, batch_size=plan.batch_size, micro_batch_size=plan.batch_size,
                          seed=seed)


def train_method(backbone, sets: list[AnswerSet], plan: AnswerPlan, method: str, *, lr: float, seed: int,
                 token_store=None, progress: bool = False):
    """A calibrator of `method`'s spec trained on `sets` with the plan's objective and schedule.

    Raises:
        ATSError: if the method needs instruction tokens and `token_store` is None.
    """
    kind, token_weight = method_spec(plan, method)
    if token_weight > 0 and token_store is None:
        raise ATSError(f"method {method!r} adds a token-level term: pass the instruction features "
                       "(--token-features)")
    return train_spec(backbone, sets, plan, kind=kind, token_weight=token_weight,
                      training=plan_training(plan, lr=lr, seed=seed), loss_type=plan.loss_type, method=method,
                      token_store=token_store, progress=progress)


def trained_head(backbone, sets: list[AnswerSet], plan: AnswerPlan, method: str, *, lr: float, seed: int,
                 folder: Path, token_store=None, progress: bool = False):
    """`train_method`'s calibrator, saved in `folder`; reused from there when its training record matches.

    Raises:
        ATSError: if the folder holds a calibrator trained with other settings.
    """
    from ..calibrators import load_calibrator

    kind, token_weight = method_spec(plan, method)
    record = answer_head_record(plan_training(plan, lr=lr, seed=seed), plan.loss_type, plan, token_weight,
                                tasks=[s.name for s in sets])
    if reusable_answer_head(folder, record, head_type=kind, max_scale=10.0, overwrite=False):
        return load_calibrator(folder, backbone)
    calibrator = train_method(backbone, sets, plan, method, lr=lr, seed=seed, token_store=token_store,
                              progress=progress)
    calibrator.save_pretrained(folder)
    return calibrator


def answer_head_record(training: TrainingConfig, loss_type: str, plan: AnswerPlan, token_weight: float = 0.0, *,
                       tasks: list[str] | None = None) -> dict:
    """The training record a calibrator trained on answers carries (`train_on_answers` writes it; compared on
    reuse): the training options, the loss, the tasks (default: the plan's whole pool) and the token term."""
    return answer_record(training, loss_type, tasks=pool_names(plan) if tasks is None else tasks,
                         token_weight=token_weight, token_max=plan.token_max, token_window=plan.token_window)


RECORD_DEFAULTS = {"token_weight": 0.0}  # record fields of heads saved before the field existed


def reusable_answer_head(head_dir: Path, record: dict, *, head_type: str, max_scale: float,
                         overwrite: bool) -> bool:
    """Whether `head_dir` holds a head trained with `record`, `head_type` and `max_scale` (read from its JSON
    config, before any model loads); False when there is none or `overwrite` replaces it.

    Raises:
        ATSError: if it holds a head trained otherwise and `overwrite` is False, naming what differs.
    """
    path = head_dir / "calibrator_config.json"
    if not path.is_file():
        return False
    config = read_json(path)
    thermometer = config.get("type") == "thermometer"  # its training record is its history's first entry
    training = ((config.get("history") or [{}])[0] if thermometer else config.get("training")) or {}
    have = {k: training.get(k, RECORD_DEFAULTS.get(k)) for k in record}
    differ = [k for k in record if have[k] != record[k]]
    if ("thermometer" if thermometer else (config.get("head") or {}).get("head_type")) != head_type:
        differ.append("head")
    if not thermometer and config.get("max_scale") != max_scale:
        differ.append("max_scale")
    if not differ:
        return True
    if overwrite:
        return False
    raise ATSError(f"{head_dir}: a head trained with other settings ({', '.join(differ)}); use --overwrite or "
                   "another --out")


def check_answer_head(out: str | Path, *, spec: str, training: TrainingConfig, loss_type: str, max_scale: float,
                      plan: AnswerPlan, token_features: str | Path | None, overwrite: bool) -> bool:
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
    record = answer_head_record(training, loss_type, plan, plan.token_weight if tokens else 0.0)
    return reusable_answer_head(Path(out) / "head", record, head_type=kind, max_scale=max_scale, overwrite=overwrite)


def train_answer_head(backbone, out: str | Path, *, spec: str, training: TrainingConfig, loss_type: str,
                      max_scale: float = 10.0, plan: AnswerPlan | None = None, token_features: str | Path | None = None,
                      overwrite: bool = False, progress: bool = True):
    """`ats train --data answers`: the pool's answers (cached in OUT/answers), a calibrator trained on all of them with
    `training` and `loss_type`, saved in OUT/head (reused when it was trained with the same settings).

    Args:
        backbone: the frozen backbone.
        out: the run folder.
        spec: what is trained (`parse_spec`): an ATS head type ("transformer", "linear", "mlp", "constant": the
            global control), "thermometer", or an ATS head with "+tokens" (plus `plan.token_weight` x the top-label
            loss on the instruction tokens of `token_features`).
        training: lr (None: DEFAULT_ANSWER_LR), epochs, batch_size (questions per step), seed, ...
        loss_type: "answer-log" or "answer-brier".
        max_scale: the clamp on exp(tau) (ATS heads).
        plan: the pool's sizes and the token term's settings; default `AnswerPlan()`.
        token_features: an instruction feature folder of the same backbone (its train/ split), for "+tokens".
        overwrite: replace a head trained with other settings instead of refusing.
        progress: show progress bars.

    Returns:
        (the calibrator, name -> the pool's answer sets, whether the head was reused).

    Raises:
        ATSError: as `check_answer_head`.
    """
    from ..calibrators import load_calibrator
    from ..training.features import FeatureStore

    plan = plan or AnswerPlan()
    reuse = check_answer_head(out, spec=spec, training=training, loss_type=loss_type, max_scale=max_scale, plan=plan,
                              token_features=token_features, overwrite=overwrite)
    kind, tokens = parse_spec(spec, field="--method")
    out = Path(out)
    head_dir = out / "head"
    token_weight = plan.token_weight if tokens else 0.0
    pool = {name: cached_answers(backbone, task, out / "answers" / name, progress=progress)
            for name, task in pool_tasks(plan).items()}
    if reuse:
        logger.info("reusing the head in %s (same settings)", head_dir)
        return load_calibrator(head_dir, backbone), pool, True
    token_store = None
    if tokens:
        token_store = FeatureStore(Path(token_features) / "train")
        token_store.check_backbone(backbone)
    calibrator = train_spec(backbone, list(pool.values()), plan, kind=kind, token_weight=token_weight,
                            training=training, loss_type=loss_type, method=f"{kind}-answers", max_scale=max_scale,
                            token_store=token_store, progress=progress)
    calibrator.save_pretrained(head_dir)
    return calibrator, pool, False
