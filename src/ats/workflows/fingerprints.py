"""The fingerprints of the workflow steps' results (features, answers, heads, fitted calibrators), built from the
configs.

One function per kind of result; the steps (`pipeline`) and the check made before a model loads
(`check_before_loading`) call the same ones, so a rerun is accepted or refused by one rule. What a config contributes
is `ats.fingerprint.result_options`: every field but those marked `option(..., result=False)`.
"""

from __future__ import annotations

from ..calibrators import calibrator_class
from ..fingerprint import digest, make_fingerprint, result_options, stored_fingerprint
from ..model.backbone import Backbone
from ..model.heads import HeadConfig
from ..model.scale_summary import ScaleSummarySpec
from ..model.token_ce import summary_route
from ..training.config import TrainingConfig
from ..training.data import DataConfig, load_instructions
from ..training.features import summary_meta


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
    return {**result_options(config), "records": len(records), "checksum": digest([vars(r) for r in records])}


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


def training_options(training: TrainingConfig, summary: ScaleSummarySpec | None) -> dict:
    """The training options a head's fingerprint records: those that can change the result, with the loss route.

    `exact_loss` is replaced by the route the trainer takes: "loss_route" names the scale summary when the loss is
    computed from it, and is absent on the exact route.

    Args:
        training: the training options.
        summary: the scale summary of the training features (`FeatureStore.scale_summary`), or None.

    Returns:
        The options, JSON-ready.
    """
    options = result_options(training, leave_out=("exact_loss",))
    if summary_route(summary, exact=training.exact_loss):
        options["loss_route"] = {"scale_summary": summary.describe()}
    return options


def store_fingerprint(store) -> dict:
    """The fingerprint of a feature source: the one recorded by `prepare_features` / `online_features`, else (features
    extracted by hand) the digest of its meta.json, which lists every shard's sha256."""
    fp = getattr(store, "fingerprint", None)
    directory = getattr(store, "directory", None)
    if fp is None and directory is not None:
        fp = stored_fingerprint(directory)
    return fp if fp is not None else {"meta_digest": digest(store.meta)}


def head_fingerprint(features: dict, summary: ScaleSummarySpec | None, head: HeadConfig, max_scale: float,
                     method: str, training: TrainingConfig) -> dict:
    """The fingerprint of a trained head.

    Args:
        features: the fingerprint of its training features (`store_fingerprint`).
        summary: the scale summary of those features, or None (decides the loss route recorded).
        head: the head's config.
        max_scale: the clamp on exp(tau).
        method: the method's name in tables.
        training: the training options (less those that never change the result).

    Returns:
        A "head" fingerprint.
    """
    return make_fingerprint("head", features=features, head=result_options(head), max_scale=max_scale,
                            method=method, training=training_options(training, summary))


def calibrator_fingerprint(name: str, store, fit_tokens: int | None, *, shared_pass: bool = True) -> dict:
    """The fingerprint of a fitted (non-head) calibrator.

    Args:
        name: its registry name.
        store: the training features.
        fit_tokens: the size of the token subset it is fitted on, or None for all.
        shared_pass: whether it was fitted from the features' scale summary (recorded for the methods that fit on it:
            `fits_on_summary`).

    Returns:
        A "calibrator" fingerprint.
    """
    summary = getattr(store, "scale_summary", None)
    route = {}
    if calibrator_class(name).fits_on_summary and summary_route(summary, exact=not shared_pass):
        route["scale_summary"] = summary.describe()
    return make_fingerprint("calibrator", name=name, features=store_fingerprint(store), fit_tokens=fit_tokens,
                            **route)


def answers_fingerprint(backbone: Backbone, task, dtype: str, probe_layers=()) -> dict:
    """The fingerprint of one task's cached answers: the task and the backbone (their descriptions), the stored
    hidden states' dtype and the layers kept for correctness probes. An answer set records these in its
    answers.json, which is read as its stored fingerprint (`stored_answers_fingerprint`); its scale summary's
    settings are not part of it (each summary row carries its own range and nodes, so a set is read as it was
    made)."""
    return make_fingerprint("answers", task=task.describe(), backbone=backbone.describe(), dtype=dtype,
                            probe_layers=[int(layer) for layer in probe_layers])


def stored_answers_fingerprint(meta: dict) -> dict:
    """`answers_fingerprint` of the set whose answers.json holds `meta`."""
    return make_fingerprint("answers", task=meta.get("task"), backbone=meta.get("backbone"), dtype=meta.get("dtype"),
                            probe_layers=meta.get("probe_layers", []))


def answer_head_fingerprint(head_type: str, max_scale: float | None, record: dict) -> dict:
    """The fingerprint of a calibrator trained on answers: what is trained (an ATS head type, or "thermometer"), the
    clamp on its scale (ATS heads; None for Thermometer) and its training record (`answer_record`, without the
    optimizer steps)."""
    return make_fingerprint("answer head", head=head_type, max_scale=max_scale, training=record)


def stored_answer_head_fingerprint(config: dict, keys) -> dict:
    """`answer_head_fingerprint` of a saved calibrator, from its calibrator_config.json (read before any model loads):
    an ATS head's training record is its config's `training`, Thermometer's its history's first entry; only the
    record's `keys` (those a rerun asks for) are compared."""
    kind = config.get("type")
    thermometer = kind == "thermometer"
    training = ((config.get("history") or [{}])[0] if thermometer else config.get("training")) or {}
    head = kind if kind in ("thermometer", "probe") else (config.get("head") or {}).get("head_type")
    return answer_head_fingerprint(head, None if head in ("thermometer", "probe") else config.get("max_scale"),
                                   {k: training.get(k) for k in keys})
