"""The `ats` model of lm-evaluation-harness: lm-eval's own Hugging Face model class (`HFLM`) with calibrated logits.

    lm_eval.simple_evaluate(model="ats", model_args="pretrained=smollm2-135m-instruct,calibrator=runs/smol/head",
                            tasks=["arc_easy"])               # after `import ats.integrations.lm_eval_model`
    ats lm-eval --model ats --model_args pretrained=...,calibrator=DIR --tasks ...   (the CLI: `ats.cli.lmeval`)

Only what touches logits changes; batching, request caching, truncation, chat templates and the per-task
bookkeeping all stay lm-eval's:

- `_model_call` (log-likelihood, multiple choice, rolling log-likelihood): the backbone's final hidden states
  h (B, T, H), then calibrated logits q (B, T, V) at every position, as `Calibrator.apply` defines them (for ATS
  `q = z * s`; the extra work is the head and one pass over the logits). Scaling h before the output layer instead
  (`W (h * s)`, exact in real numbers) was tried and dropped: in float32 it moved SmolLM2's log-likelihoods by up to
  1.4e-4 from `ats eval`'s, against 1e-5 for this path.
- `_loglikelihood_tokens` plans the prompt prefixes that the requests share (few-shot examples, a question's
  context) and `_model_call` runs rows that start with one on its cached encoding (`prefix_sharing`): 5-shot tasks
  cost little more than their questions, as in `ats eval`. `prefix_cache=0` turns it off; uncalibrated and with
  nothing shared this is HFLM's own call, bit for bit; through a cached prefix the log-likelihoods agree with
  HFLM's to float32 rounding (1e-5 on SmolLM2; an ATS head multiplies such differences by its scale).
- `_model_generate` (generate_until): `CalibrationProcessor`, the LogitsProcessor of `ats generate`, runs first in
  `generate`'s processor list, so sampling draws from the calibrated distribution (greedy output is unchanged).

`pretrained=` takes what `load_backbone` takes (embedded names such as smollm2-135m-instruct and gemma3-270m, a
`.gguf` file, a model folder, a Hub id): embedded models and GGUF files are handed to HFLM as their dequantized
model folder. `calibrator=` is a saved calibrator folder (ATS heads, the selective-* controls, temperature or vector
scaling) or `none` (the uncalibrated model, for the reference row). Calibrators that map a top-1
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
from .prefix_sharing import SharedPrefixes

logger = logging.getLogger(__name__)


def check_calibrator(spec) -> Path | Calibrator | None:
    """What `calibrator=` names, checked before any model loads.

    Args:
        spec: a calibrator folder, a Calibrator object (Python callers), or None / "" / "none".

    Returns:
        None (uncalibrated, `Uncalibrated` included), the folder's path, or the Calibrator object.

    Raises:
        ATSError: if the folder is missing (or a method name was given), its type is unknown, or the calibrator maps
            confidences or needs a per-prompt temperature that lm-eval cannot mark.
    """
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
def calibrated_logits(backbone: Backbone, calibrator: Calibrator | None, hidden: Tensor, start: int = 0) -> Tensor:
    """Logits at positions start.. of `hidden`, calibrated exactly as `ats eval` does (`Calibrator.apply` on the
    output layer's logits; ATS heads read the whole sequence).

    No attention mask is needed: lm-eval pads on the right and the backbone and the ATS head are causal, so
    padding never reaches a real position.

    Args:
        backbone: the backbone whose output layer gives the logits.
        calibrator: the calibrator, or None for the backbone's own logits.
        hidden: (B, T, H) final hidden states of the whole sequences.
        start: the first position whose logits are wanted.

    Returns:
        (B, T - start, V) logits (float32 when calibrated).
    """
    z = backbone.logits(hidden[:, start:])  # (B, K, V)
    if calibrator is None:
        return z
    B, T = hidden.shape[:2]
    index = None if start == 0 else torch.arange(start, T, device=hidden.device).expand(B, -1)  # (B, K)
    return calibrator.apply(z, hidden, index=index)


class ScoresCalibration(LogitsProcessor):
    """Calibrated generation for calibrators that read only the logits (temperature, vector scaling).

    Args:
        calibrator: applied to each step's scores (B, V).
    """

    def __init__(self, calibrator: Calibrator) -> None:
        self.calibrator = calibrator

    @torch.no_grad()
    def __call__(self, input_ids: Tensor, scores: Tensor) -> Tensor:
        return self.calibrator.apply(scores).to(scores.dtype)  # (B, V)


@register_model("ats")
class ATSLM(HFLM):
    """lm-eval's HFLM with calibrated log-likelihoods and calibrated sampling (see the module docstring).

    Args:
        pretrained: an embedded name, a .gguf file, a model folder or a Hub id (a loaded PreTrainedModel also
            works).
        calibrator: a saved calibrator folder, a Calibrator object, or None / "none" for the uncalibrated model.
        revision: the Hub revision.
        prefix_cache: how many shared prompt prefixes to keep encoded (0: off, every request runs whole).
        **kwargs: HFLM's (device, dtype, batch_size, max_length, ...); device defaults to cuda when available,
            else cpu.

    Raises:
        ATSError: if the calibrator is refused (see `check_calibrator`) or does not fit the model, or the model is
            not a causal LM.
    """

    def __init__(self, pretrained=DEFAULT_MODEL, calibrator=None, revision: str | None = None,
                 prefix_cache: int = 16, **kwargs) -> None:
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
        if isinstance(prefix_cache, bool) or not isinstance(prefix_cache, int) or prefix_cache < 0:
            raise ATSError(f"prefix_cache: expected how many shared prefixes to keep (0: off), got {prefix_cache!r}")
        self.prefixes = SharedPrefixes(self.backbone, max_prefixes=prefix_cache) if prefix_cache else None

    # log-likelihoods: multiple choice, loglikelihood, loglikelihood_rolling ---------------------------------------
    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, override_bs: int | None = None):
        """HFLM's, with the prompt prefixes these requests share planned first (see `prefix_sharing`)."""
        if self.prefixes is None:
            return super()._loglikelihood_tokens(requests, disable_tqdm=disable_tqdm, override_bs=override_bs)
        # the rows `_model_call` will see: HFLM's (context + continuation)[-(max_length + 1):][:-1]
        found = self.prefixes.plan([(context + continuation)[-(self.max_length + 1):][:-1]
                                    for _, context, continuation in requests])
        if found:
            logger.info("%d shared prompt prefix(es) among %d requests: each encoded once", found, len(requests))
        try:
            return super()._loglikelihood_tokens(requests, disable_tqdm=disable_tqdm, override_bs=override_bs)
        finally:
            self.prefixes.clear()

    def _model_call(self, inps: Tensor, attn_mask: Tensor | None = None, labels: Tensor | None = None) -> Tensor:
        """Logits (B, T, V) of the right-padded batch `inps` (B, T), calibrated unless the model is uncalibrated.

        Rows that start with a planned shared prefix run on its cached encoding; their positions inside the prefix
        (which lm-eval never reads: it scores continuations) hold zeros. Without any, this is HFLM's own call when
        uncalibrated, bit for bit.
        """
        groups = self.prefixes.groups(inps.tolist()) if self.prefixes is not None and self.prefixes.by_head else []
        if all(prefix is None for prefix, _ in groups):
            return self._whole(inps)
        out = None
        with torch.no_grad(), self._autocast():
            for prefix, rows in groups:
                if prefix is None:
                    start, logits = 0, self._whole(inps[rows])
                else:
                    cache = self.prefixes.cache(prefix)
                    ids = inps[rows].tolist()
                    hidden, _ = cache.forward(ids)  # (b, T, H), the prefix from its cache
                    start = max(0, min(cache.shared_length(r) for r in ids) - 1)  # first position scored
                    logits = calibrated_logits(self.backbone, self.calibrator, hidden, start)
                if out is None:
                    out = logits.new_zeros((*inps.shape, logits.shape[-1]))
                out[rows, start:] = logits
        return out

    def _whole(self, inps: Tensor) -> Tensor:
        """Logits (B, T, V) of a whole batch, no prefix reused."""
        if self.calibrator is None:
            return super()._model_call(inps)
        with self._autocast():
            hidden, _ = self.backbone.forward(inps)  # (B, T, H)
            return calibrated_logits(self.backbone, self.calibrator, hidden)

    def _autocast(self):
        return torch.autocast(device_type=self.device.type, dtype=self.mixed_precision_dtype,
                              enabled=self.mixed_precision_dtype is not None)

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
