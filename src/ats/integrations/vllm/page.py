"""What the playground page (`ats.serving.playground`, the same files) shows on `ats serve --engine vllm`: GET
/v1/playground as the middleware answers it, from the export.

vLLM's server returns the calibrated log-probabilities only (the export's `compute_logits`), so the page's raw
switch and tau are unavailable there; rescoring under another calibrator and a saved evaluation are options of
ats's own engine (`--compare`, `--eval`); and the export's copy of the calibrator has no training record. Each is
named in `unavailable` with the one-line reason the page shows.
"""

from __future__ import annotations

from pathlib import Path

from ...serving.playground import calibrator_entry
from . import CALIBRATOR_FOLDER
from .export import read_export

UNAVAILABLE = {
    "raw": "vLLM returns calibrated log-probabilities only: the model's raw probabilities are not computed there "
           "(ats serve's own engine returns both)",
    "tau": "vLLM returns calibrated log-probabilities only: a head's per-token tau stays inside the model",
    "rescore": "comparing calibrators on the same tokens needs ats serve's own engine (--compare); one export "
               "serves one calibrator",
    "evaluation": "a saved evaluation is shown by ats serve's own engine (--eval EVAL)",
}

NO_TRAINING_RECORD = ("the export holds the calibrator as save_pretrained writes it: its training record "
                      "(fingerprint.json) stays in the folder it was exported from")


def describe(label: str, calibrated: bool) -> str:
    """The page's one line on what the served calibrator changes, on vLLM."""
    if not calibrated:
        return "uncalibrated: vLLM's own log-probabilities, through the calibrated architecture unchanged"
    return (f"{label}: applied inside vLLM's model (the export's compute_logits), so vLLM's logprobs and sampling "
            f"are the calibrated ones")


def playground_info(folder: Path, model_name: str, decider) -> dict:
    """GET /v1/playground on vLLM's server: the served model, its one calibrator (the export's, with the threshold
    `decider` applies and the answer format its certificate covers) and what the page cannot show there
    (`UNAVAILABLE`).

    Args:
        folder: the export (`$ATS_VLLM_EXPORT`).
        model_name: the model id clients send (vLLM's --served-model-name).
        decider: the middleware's `AnswerDecider`.
    """
    from ...calibrators import load_calibrator

    record = read_export(folder)
    calibrator = None if record.get("calibrator") is None else load_calibrator(folder / CALIBRATOR_FOLDER)
    label = "uncalibrated" if calibrator is None else calibrator.label
    entry = calibrator_entry(id=label, label=label, describe=describe(label, calibrator is not None),
                             confidence_kind="probability", threshold=decider.threshold, evaluation_method=None,
                             folder=None if calibrator is None else folder / CALIBRATOR_FOLDER,
                             model=entry_model(record, model_name))
    if calibrator is not None:  # the export holds a copy: certify the calibrator itself, the export is remade
        entry["make_threshold"] = (f"ats certify --model {entry_model(record, model_name)} --calibrator CALIBRATOR "
                                   f"(the folder this export was made from); then restart ats serve --engine vllm")
    unavailable = dict(UNAVAILABLE)
    if calibrator is not None and entry["training"] is None:
        unavailable["training"] = NO_TRAINING_RECORD
    certificate = getattr(decider, "certificate", None)
    return {"model": model_name, "engine": "vllm", "unavailable": unavailable,
            "certified_format": None if certificate is None else certificate.served.get("format"),
            "served": entry["id"], "calibrators": [entry], "evaluation": None}


def entry_model(record: dict, model_name: str) -> str:
    """The base model as the export records it (what `ats certify --model` takes), else the served name."""
    return record.get("base_model") or model_name
