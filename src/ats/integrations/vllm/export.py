"""`export_for_vllm`: a model folder that vLLM loads as the calibrated model.

    OUT/config.json         the base model's config, `architectures` = ["ATSCalibratedForCausalLM"], and
                            "ats_calibration": {base_architecture, calibrator, method, base_model, revision, ...}
    OUT/calibrator/         the calibrator as `save_pretrained` writes it (absent for `none`), with the certified
                            threshold.json of its folder when it has one (`ats certify`; `abstain.AnswerDecider`)
    OUT/*.safetensors ...   every other file of the base model folder, linked (or copied with `copy=True`)
    OUT/fingerprint.json    what made it: a rerun reuses the folder only for the same model and calibrator

The calibrator is checked against the base model before anything is written (hidden size, vocabulary, name,
revision: the checks `load_calibrator(..., backbone=...)` makes, read from the model's config.json so that a 70B
model is not loaded to export it), and refused when it cannot run inside vLLM (`Calibrator.position_refusal`; the
calibrated model knows where each prompt ends, so Thermometer runs: the record's `per_prompt` says so to the
front end, which refuses prompt logprobs for it, `runner_patch`).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from ... import __version__
from ...calibrators import Calibrator, load_calibrator
from ...errors import ATSError
from ...evaluation.threshold import THRESHOLD_NAME, read_certificate, read_threshold
from ...fingerprint import check_reuse, make_fingerprint, stored_fingerprint, write_fingerprint
from ...hub import MODEL_PATTERNS, resolve_folder
from ...io import atomic_dir, read_json, write_json
from ...model.backbone import model_source, revision_of
from . import ARCHITECTURE, CALIBRATOR_FOLDER, CONFIG_KEY
from .compat import check_version, setup_refusal
from .cpu import base_head_size

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ModelFacts:
    """What a calibrator checks of its backbone (`Calibrator.check_backbone`), read from a config.json."""

    name: str
    revision: str
    hidden_size: int
    vocab_size: int


def base_model(model: str, revision: str | None = None) -> tuple[Path, ModelFacts, dict]:
    """The local folder of `model` (as `load_backbone` takes it: embedded name, .gguf, folder, Hub id), its facts
    and its config.json.

    Raises:
        ATSError: if the folder has no config.json, is itself an export, or names no architecture.
    """
    source, name, known_revision = model_source(model)
    folder = resolve_folder(source, revision=revision, patterns=MODEL_PATTERNS)
    path = folder / "config.json"
    if not path.is_file():
        raise ATSError(f"{folder}: not a model folder (no config.json)")
    config = read_json(path)
    if CONFIG_KEY in config:
        raise ATSError(f"{path}: already a calibrated export (field {CONFIG_KEY!r}); export from its base model "
                       f"{config[CONFIG_KEY].get('base_model')!r}")
    if not config.get("architectures"):
        raise ATSError(f"{path}: field 'architectures' is missing or empty; vLLM needs it to pick the model class")
    from transformers import AutoConfig

    loaded = AutoConfig.from_pretrained(str(folder))
    text = loaded.get_text_config()
    facts = ModelFacts(name=name, revision=known_revision or revision_of(loaded, revision),
                       hidden_size=int(text.hidden_size), vocab_size=int(text.vocab_size))
    return folder, facts, config


def check_engine_calibrator(calibrator: Calibrator | type[Calibrator], what: str) -> None:
    """Refuse, in one line, a calibrator that cannot run inside vLLM (it maps a confidence, or its head says nothing
    of what it reads), pointing at `ats serve`, which runs every calibrator. Thermometer runs: the calibrated model
    is told where each prompt ends (`runner_patch`)."""
    reason = calibrator.position_refusal()
    if reason is not None:
        raise ATSError(f"calibrator {what} {reason}, and vLLM computes calibrated logprobs from each position's "
                       f"logits and hidden states alone; serve it with `ats serve` (ats's own engine), or train one "
                       f"that vLLM runs: `ats train` (Thermometer, its default), temperature or an ATS head")
    if isinstance(calibrator, Calibrator):
        head_route(calibrator, what)


def head_route(calibrator: Calibrator | None, what: str = "") -> str:
    """How the calibrated vLLM model runs `calibrator`, from what its head is (the head class's `reads_context`):
    "paged" (the head attends over earlier positions: a decoder layer in vLLM's paged KV cache), "token" (tau from
    each position's own hidden state), "prompt" (one temperature per request from its prompt's last hidden state:
    Thermometer, kept in the paged cache), or "logits" (no head: a map of the logits, or none).

    Raises:
        ATSError: a per-token head whose class does not say what it reads.
    """
    if calibrator is not None and calibrator.prompt_hidden:
        return "prompt"
    if calibrator is None or not calibrator.token_head:
        return "logits"
    head = type(calibrator.head)
    reads_context = getattr(head, "reads_context", None)
    if reads_context is None:
        raise ATSError(f"calibrator {what or calibrator.label!r}: its head class {head.__name__} does not declare "
                       f"`reads_context` (whether tau attends over earlier positions), so vLLM cannot place it; "
                       f"serve it with `ats serve` (ats's own engine)")
    return "paged" if reads_context else "token"


def calibration_attention(calibrator: Calibrator | None) -> tuple[int, int] | None:
    """(heads, head size) of the attention layer `calibrator` adds to vLLM's paged KV cache: the transformer head's
    decoder layer, or Thermometer's temperature layer (one head of `prompt_temperature.HEAD_SIZE`); None when it
    adds none."""
    route = head_route(calibrator)
    if route == "paged":
        head = calibrator.config_.head
        return head.num_heads, head.hidden_size // head.num_heads
    if route == "prompt":
        from .prompt_temperature import HEAD_SIZE

        return 1, HEAD_SIZE
    return None


def attention_head_sizes(config, calibrator: Calibrator | None) -> dict[str, int]:
    """What each attention of the calibrated model is -> its head size: the base model's (`config`, its
    transformers config; none for latent attention, MLA, which runs on a backend of its own) and the calibration
    layer's (`calibration_attention`). `compat.head_size_refusal` reads it."""
    text = config.get_text_config()
    sizes = {}
    if getattr(text, "kv_lora_rank", None) is None:
        made = ("head_dim in config.json" if getattr(text, "head_dim", None)
                else f"hidden size {text.hidden_size} / {text.num_attention_heads} heads")
        sizes[f"the base model's attention ({made})"] = base_head_size(text)
    added = calibration_attention(calibrator)
    if added is not None:
        heads, size = added
        sizes[f"the calibration layer's attention ({heads} head(s) over width {heads * size})"] = size
    return sizes


def _check_base_architecture(architecture: str, where: Path) -> None:
    """Refuse a vLLM outside the supported versions, and an architecture this vLLM has no class for (only when
    vLLM is installed; the export itself needs no vLLM)."""
    try:
        from vllm import ModelRegistry
    except ImportError:
        return
    check_version()
    if architecture not in ModelRegistry.get_supported_archs():
        raise ATSError(f"{where}: architecture {architecture!r} is not one vLLM supports")


def _place(source: Path, target: Path, copy: bool) -> None:
    """Link `target` to `source` (absolute, through any link chain), or copy it."""
    real = source.resolve()
    if copy:
        (shutil.copytree if real.is_dir() else shutil.copy2)(real, target)
    else:
        os.symlink(real, target)


def export_for_vllm(model: str, calibrator: str | Path | Calibrator | None, out: str | Path, *,
                    revision: str | None = None, copy: bool = False, overwrite: bool = False,
                    threshold_from: str | Path | None = None) -> Path:
    """Write (or reuse) the folder vLLM loads as `model` calibrated by `calibrator`.

    Args:
        model: the base model as `load_backbone` takes it (embedded name, .gguf file, folder, Hub id).
        calibrator: a saved calibrator (folder or Hub id, the paper's released heads too), a loaded one, or
            None / "none" for the base model under the calibrated architecture (the reference).
        out: the folder to write.
        revision: the Hub revision of `model`.
        copy: copy the base model's files instead of linking them (a folder that outlives the source).
        overwrite: replace an export made from another model or calibrator instead of refusing.
        threshold_from: the calibrator folder whose certified threshold.json the export carries, when `calibrator`
            is given loaded (a folder given as `calibrator` is that folder).

    Returns:
        `out`.

    Raises:
        ATSError: a calibrator vLLM cannot run or made for another model, a model folder vLLM cannot load, an
            existing `out` made otherwise (without `overwrite`).
    """
    out = Path(out)
    if out.is_file():  # not an export of any version: refused even with --overwrite, which replaces folders
        raise ATSError(f"{out}: a file, not a vLLM export folder; choose another OUT")
    if calibrator is None or str(calibrator) == "none":
        calibrator = threshold_from = None
    elif not isinstance(calibrator, Calibrator):
        threshold_from = calibrator
        calibrator = load_calibrator(calibrator)
    threshold = None if threshold_from is None else _threshold_file(threshold_from)
    if calibrator is not None:
        check_engine_calibrator(calibrator, f"{calibrator.label!r}")
    if threshold is not None and calibrator is not None and calibrator.answer_probe:
        logger.warning("%s: not exported: it certifies the correctness probe's answer confidence, which reads hidden "
                       "states of layers %s that vLLM's responses do not carry; the export serves the probe's token "
                       "probabilities (temperature %.4g) and answer-or-abstain decisions are `ats serve`'s",
                       threshold, calibrator.layers, calibrator.temperature)
        threshold = None
    folder, facts, config = base_model(model, revision)
    if calibrator is not None:
        calibrator.check_backbone(facts)
    quantized = config.get("quantization_config")
    if quantized:
        method = quantized.get("quant_method", "?") if isinstance(quantized, dict) else str(quantized)
        raise ATSError(f"{folder / 'config.json'}: {setup_refusal(quantization=method)}")
    if threshold is not None:  # certified for this calibrator and backbone, or refused
        read_certificate(threshold.parent).check(calibrator=None if calibrator is None else calibrator.digest(),
                                                 backbone={"base_model": facts.name, "revision": facts.revision,
                                                           "hidden_size": facts.hidden_size,
                                                           "vocab_size": facts.vocab_size})
    architecture = config["architectures"][0]
    _check_base_architecture(architecture, folder / "config.json")
    record = {"base_architecture": architecture, "base_model": facts.name, "revision": facts.revision,
              "calibrator": None if calibrator is None else CALIBRATOR_FOLDER,
              "method": "none" if calibrator is None else calibrator.label, "library_version": __version__,
              "per_prompt": bool(calibrator is not None and calibrator.prompt_hidden)}
    fingerprint = make_fingerprint("vllm-export", base_model=facts.name, revision=facts.revision,
                                   source=str(folder.resolve()), copy=copy,
                                   calibrator=None if calibrator is None else calibrator.digest(),
                                   threshold=None if threshold is None else read_json(threshold))
    if out.exists() and check_reuse(out, "vLLM export", stored_fingerprint(out), fingerprint, overwrite=overwrite):
        return out
    with atomic_dir(out) as tmp:
        for item in sorted(folder.iterdir()):
            if item.name != "config.json" and not item.name.startswith("."):
                _place(item, tmp / item.name, copy)
        write_json(tmp / "config.json", {**config, "architectures": [ARCHITECTURE], CONFIG_KEY: record})
        if calibrator is not None:
            calibrator.save_pretrained(tmp / CALIBRATOR_FOLDER)
        if threshold is not None:
            shutil.copyfile(threshold, tmp / CALIBRATOR_FOLDER / THRESHOLD_NAME)
        write_fingerprint(tmp, fingerprint)
    logger.info("exported %s calibrated by %s for vLLM to %s", facts.name, record["method"], out)
    return out


def _threshold_file(calibrator: str | Path) -> Path | None:
    """The certified threshold (`ats certify`) saved beside a local calibrator folder, which the export carries for
    the client's answer-or-abstain decision (`abstain.AnswerDecider`); None for a Hub id or a folder without one."""
    path = Path(calibrator) / THRESHOLD_NAME
    if not path.is_file():
        return None
    read_threshold(path.parent)  # a record that does not parse is refused here, naming the file
    return path


def read_export(folder: str | Path) -> dict:
    """The "ats_calibration" record of an exported folder's config.json.

    Raises:
        ATSError: if the folder is not an export of this kind.
    """
    path = Path(folder) / "config.json"
    try:
        record = json.loads(path.read_text())[CONFIG_KEY]
    except (OSError, ValueError, KeyError, TypeError):
        raise ATSError(f"{path}: not an ats export for vLLM (no {CONFIG_KEY!r} record); make one with "
                       f"`ats export --engine vllm`") from None
    return record
