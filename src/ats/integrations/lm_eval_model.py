"""The `ats` model of lm-evaluation-harness: lm-eval's own Hugging Face model class (`HFLM`) with calibrated logits.

    lm_eval.simple_evaluate(model="ats", model_args="pretrained=smollm2-135m-instruct,calibrator=runs/smol/head",
                            tasks=["arc_easy"])               # after `import ats.integrations.lm_eval_model`
    ats lm-eval --model ats --model_args pretrained=...,calibrator=DIR --tasks ...   (the CLI: `ats.cli.lmeval`)

Only the two places where HFLM touches logits change; batching, request caching, truncation, chat templates and
the per-task bookkeeping all stay lm-eval's:

- `_model_call` (log-likelihood, multiple choice, rolling log-likelihood): the backbone's final hidden states
  h (B, T, H), then calibrated logits q (B, T, V) at every position, as `Calibrator.apply` defines them (for ATS
  `q = z * s`; the extra work is the head and one pass over the logits). Scaling h before the output layer instead
  (`W (h * s)`, exact in real numbers) was tried and dropped: in float32 it moved SmolLM2's log-likelihoods by up to
  1.4e-4 from `ats eval`'s, against 1e-5 for this path.
- `_model_generate` (generate_until): `CalibrationProcessor`, the LogitsProcessor of `ats generate`, runs first in
  `generate`'s processor list, so sampling draws from the calibrated distribution (greedy output is unchanged).

`pretrained=` takes what `load_backbone` takes (embedded names such as smollm2-135m-instruct and gemma3-270m, a
`.gguf` file, a model folder, a Hub id): embedded models and GGUF files are handed to HFLM as their dequantized
model folder. `calibrator=` is a saved calibrator folder (ATS heads, the selective-* controls, temperature or vector
scaling) or `none` (the uncalibrated model: HFLM's own code path, bit for bit). Calibrators that map a top-1
confidence (histogram, isotonic, scaling-binning) give no log-likelihoods, and Thermometer reads one temperature at
the end of a prompt that lm-eval's batched requests do not mark: both are refused.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from lm_eval.api.registry import register_model
from lm_eval.models.huggingface import HFLM
from torch import Tensor
from transformers import LogitsProcessor, LogitsProcessorList

from ..calibrators import REGISTRY, calibrator_class, load_calibrator
from ..calibrators.ats import ATSCalibrator
from ..calibrators.base import Calibrator, Uncalibrated, read_config
from ..errors import ATSError
from ..generation.processor import CalibrationProcessor
from ..model.backbone import DEFAULT_MODEL, Backbone, model_source, revision_of

logger = logging.getLogger(__name__)


def check_calibrator(spec) -> Path | Calibrator | None:
    """What `calibrator=` names, checked before any model loads: None (uncalibrated), a folder whose calibrator gives
    logits, or a Calibrator object (Python callers)."""
    if isinstance(spec, Calibrator):
        _check_supported(type(spec), repr(spec.name))
        return None if isinstance(spec, Uncalibrated) else spec
    if spec is None or str(spec).strip().lower() in ("", "none"):
        return None
    path = Path(str(spec)).expanduser()
    if not path.is_dir():
        if str(spec) in REGISTRY:
            raise ATSError(f"calibrator={spec}: a method name, not a fitted calibrator; fit it first (`ats eval "
                           f"--calibrator {spec} ...` saves it under OUT/calibrators/{spec}) and pass that folder")
        raise ATSError(f"calibrator={spec}: no such calibrator folder (or 'none' for the uncalibrated model)")
    kind = read_config(path).get("type")
    if kind not in REGISTRY:
        raise ATSError(f"{path}: field 'type' is {kind!r}; known: {', '.join(REGISTRY)}")
    _check_supported(calibrator_class(kind), f"{kind!r} ({path})")
    return path


def _check_supported(cls: type[Calibrator], what: str) -> None:
    if cls.maps_confidence:
        raise ATSError(f"calibrator {what} maps top-1 confidences, not logits: lm-eval needs log-likelihoods")
    if cls.needs_hidden and not issubclass(cls, ATSCalibrator):
        raise ATSError(f"calibrator {what} reads one temperature per prompt at the prompt's end, which lm-eval's "
                       f"batched requests do not mark; use an ATS head, temperature or vector scaling")


@torch.no_grad()
def calibrated_logits(backbone: Backbone, calibrator: Calibrator, hidden: Tensor) -> Tensor:
    """Calibrated logits (B, T, V) at every position of `hidden` (B, T, H), exactly as `ats eval` computes them
    (`Calibrator.apply` on the output layer's logits). No attention mask is needed: lm-eval pads on the right and
    the backbone and the ATS head are causal, so padding never reaches a real position."""
    return calibrator.apply(backbone.logits(hidden), hidden)


class ScoresCalibration(LogitsProcessor):
    """Calibrated generation for calibrators that read only the logits (temperature, vector scaling)."""

    def __init__(self, calibrator: Calibrator) -> None:
        self.calibrator = calibrator

    @torch.no_grad()
    def __call__(self, input_ids: Tensor, scores: Tensor) -> Tensor:
        return self.calibrator.apply(scores).to(scores.dtype)  # (B, V)


@register_model("ats")
class ATSLM(HFLM):
    """lm-eval's HFLM with calibrated log-likelihoods and calibrated sampling (see the module docstring).

    pretrained: an embedded name, a .gguf file, a model folder or a Hub id (a loaded PreTrainedModel also works).
    calibrator: a saved calibrator folder, a Calibrator object, or None / "none" for the uncalibrated model.
    Every other argument is HFLM's (device, dtype, batch_size, max_length, ...).
    """

    def __init__(self, pretrained=DEFAULT_MODEL, calibrator=None, revision: str | None = None, **kwargs) -> None:
        spec = check_calibrator(calibrator)  # before the model loads
        if isinstance(pretrained, str):
            source, name, known_revision = model_source(pretrained)
        else:
            source, name, known_revision = pretrained, str(getattr(pretrained, "name_or_path", "model")), None
        if revision is not None:
            kwargs["revision"] = revision
        kwargs.setdefault("device", "cuda" if torch.cuda.is_available() else "cpu")  # HFLM's default is cuda
        super().__init__(pretrained=source, **kwargs)
        if self.backend != "causal":
            raise ATSError(f"pretrained={pretrained}: ATS calibrates causal language models, not {self.backend}")
        self.backbone = Backbone(model=self.model, tokenizer=self.tokenizer, name=name,
                                 revision=known_revision or revision_of(self.model, revision))
        self.calibrator: Calibrator | None = None
        if spec is not None:
            self.backbone.check_output_layer(atol=1e-3 if self.backbone.dtype == torch.float32 else 5e-2)
            cal = spec if isinstance(spec, Calibrator) else load_calibrator(spec, backbone=self.backbone)
            cal.check_backbone(self.backbone)
            self.calibrator = cal.to(self.backbone.device)
            logger.info("lm-eval model 'ats': %s with calibrator %s (%s)", name, self.calibrator.label,
                        self.calibrator.digest())
        self.calibrator_source = None if spec is None else str(spec if isinstance(spec, Path) else spec.name)

    # log-likelihoods: multiple choice, loglikelihood, loglikelihood_rolling ---------------------------------------
    def _model_call(self, inps: Tensor, attn_mask: Tensor | None = None, labels: Tensor | None = None) -> Tensor:
        """Logits (B, T, V) of the right-padded batch `inps` (B, T): calibrated unless the model is uncalibrated."""
        if self.calibrator is None:
            return super()._model_call(inps, attn_mask=attn_mask, labels=labels)
        with torch.autocast(device_type=self.device.type, dtype=self.mixed_precision_dtype,
                            enabled=self.mixed_precision_dtype is not None):
            hidden, _ = self.backbone.forward(inps)  # (B, T, H)
            return calibrated_logits(self.backbone, self.calibrator, hidden)

    # generate_until ------------------------------------------------------------------------------------------------
    def _model_generate(self, context: Tensor, max_length: int, stop: list[str], **generation_kwargs) -> Tensor:
        """HFLM's generate with the calibrator first in the processor list; `context` (B, P) is left-padded."""
        if self.calibrator is None:
            return super()._model_generate(context, max_length, stop, **generation_kwargs)
        if int(generation_kwargs.get("num_beams", 1) or 1) > 1:
            raise ATSError("the ats model samples from calibrated logits; beam search (num_beams > 1) is not supported")
        handles = []
        if isinstance(self.calibrator, ATSCalibrator):
            mask = generation_kwargs.get("attention_mask")
            processor = CalibrationProcessor(self.calibrator, torch.ones_like(context) if mask is None else mask,
                                             softcap=self.backbone.softcap)
            handles = processor.attach(self.model)
        else:
            processor = ScoresCalibration(self.calibrator)
        theirs = generation_kwargs.pop("logits_processor", None) or []
        generation_kwargs["logits_processor"] = LogitsProcessorList([processor, *theirs])
        try:
            return super()._model_generate(context, max_length, stop, **generation_kwargs)
        finally:
            for handle in handles:
                handle.remove()

    def get_model_info(self) -> dict:
        """HFLM's model information plus the calibrator (its folder, type and digest) for the results file."""
        info = super().get_model_info()
        if self.calibrator is not None:
            info.update(ats_calibrator=self.calibrator_source, ats_calibrator_type=self.calibrator.name,
                        ats_calibrator_digest=self.calibrator.digest())
        return info
