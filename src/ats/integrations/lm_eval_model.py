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
- `_model_generate` (generate_until): the decoding core of `ats generate` and `ats serve` (`ats.generation.Decoder`)
  generates from the calibrated distribution (greedy output is the model's own), with lm-eval's temperature /
  top-k / top-p on top and the stop strings ending each row.

`pretrained=` takes what `load_backbone` takes (embedded names such as smollm2-135m-instruct and gemma3-270m, a
`.gguf` file, a model folder, a Hub id): embedded models and GGUF files are handed to HFLM as their dequantized
model folder. `calibrator=` is a saved calibrator folder or Hub id (ATS heads, the paper's released heads, the
selective-* controls, temperature or vector scaling) or `none` (the uncalibrated model, for the reference row).
Thermometer (`prompt_hidden`: one temperature per prompt) reads it where `ats eval` does: at the context's last
token (the first position predicting the continuation), and scales the continuation's logits by it; a rolling
log-likelihood window, which has no context, is its own prompt, read at its last token (`prompt_ends`). Calibrators
that map a top-1 confidence (histogram, isotonic, scaling-binning) give no log-likelihoods: refused, by their
capability flag (`maps_confidence`).
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from lm_eval.api.registry import register_model
from lm_eval.models.huggingface import HFLM
from torch import Tensor

from ..calibrators import REGISTRY, load_calibrator, saved_class
from ..calibrators.base import Calibrator, Uncalibrated
from ..errors import ATSError
from ..generation import Decoder, Row, SamplingParams
from ..hub import is_repo_id, resolve_folder
from ..model.backbone import DEFAULT_MODEL, Backbone, model_source, revision_of
from .prefix_sharing import SharedPrefixes
from .prompt_ends import PromptEnd, PromptEnds

logger = logging.getLogger(__name__)
# generate_until's options the calibrated decoding honours; any other (repetition_penalty, no_repeat_ngram_size, ...)
# is refused rather than ignored, since lm-eval's hf model would apply it
GEN_KWARGS = frozenset({"attention_mask", "do_sample", "temperature", "top_k", "top_p", "num_beams", "min_new_tokens"})


def check_calibrator(spec) -> Path | Calibrator | None:
    """What `calibrator=` names, checked before any model loads.

    Args:
        spec: a calibrator folder (ats's layout or the paper's released heads), a Hub repo id (owner/name), a
            Calibrator object (Python callers), or None / "" / "none".

    Returns:
        None (uncalibrated, `Uncalibrated` included), the folder's path, or the Calibrator object.

    Raises:
        ATSError: if the folder is missing (or a method name was given), its type is unknown, or the calibrator maps
            confidences.
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
        if not is_repo_id(str(spec)):
            raise ATSError(f"calibrator={spec}: no such calibrator folder (or 'none' for the uncalibrated model)")
        path = resolve_folder(str(spec))
    _check_supported(saved_class(path), f"{path}")
    return path


def _check_supported(cls: type[Calibrator], what: str) -> None:
    reason = cls.position_refusal()
    if reason is not None:
        raise ATSError(f"calibrator {what} {reason}: lm-eval scores batched requests position by position; use "
                       f"Thermometer (`ats train`'s default), an ATS head, temperature or vector scaling")


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


@torch.no_grad()
def prompt_calibrated_logits(backbone: Backbone, calibrator: Calibrator, hidden: Tensor, ends: list[PromptEnd],
                             start: int = 0) -> Tensor:
    """Logits at positions start.. of `hidden` under a calibrator that reads one temperature per prompt
    (Thermometer), row by row where each row's prompt ends (`prompt_ends`): a continuation's logits (positions
    end.at..) as `ats eval` passes them (`index` from the context's last token), a rolling window's whole row as
    `Calibrator.apply` reads a row without `index`. Positions lm-eval never reads (before a continuation, the right
    padding) hold zeros.

    Args:
        backbone: the backbone whose output layer gives the logits.
        calibrator: the calibrator (`prompt_hidden`).
        hidden: (B, T, H) final hidden states of the whole (right-padded) rows.
        ends: each row's PromptEnd.
        start: the first position whose logits are wanted.

    Returns:
        (B, T - start, V) float32 logits.
    """
    B, T = hidden.shape[:2]
    out = None
    for b, end in enumerate(ends):
        first = end.first
        h = hidden[b: b + 1, : end.length]  # (1, L, H)
        index = None if end.whole else torch.arange(first, end.length, device=hidden.device)[None]  # (1, K)
        q = calibrator.apply(backbone.logits(h[:, first:]), h, index=index)[0]  # (L - first, V)
        if out is None:
            out = q.new_zeros((B, T - start, q.shape[-1]))
        keep = max(first, start)
        out[b, keep - start: end.length - start] = q[keep - first:]
    return out


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
        # where each row's prompt ends: where scoring starts (a shared prefix may reach past it) and where a
        # calibrator that reads one temperature per prompt (Thermometer) reads it
        self.prompt_ends = PromptEnds()
        self.per_prompt = self.calibrator is not None and self.calibrator.prompt_hidden
        self._rolling = False  # inside loglikelihood_rolling: each window is its own prompt

    # log-likelihoods: multiple choice, loglikelihood, loglikelihood_rolling ---------------------------------------
    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """HFLM's; its windows (no context) are marked as whole prompts for a per-prompt temperature."""
        self._rolling = True
        try:
            return super().loglikelihood_rolling(requests, disable_tqdm=disable_tqdm)
        finally:
            self._rolling = False

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, override_bs: int | None = None):
        """HFLM's, with each row's prompt end known (`prompt_ends`; in as many runs as rows that look alike end
        differently, nearly always one) and the shared prompt prefixes planned. Neither is needed without a
        per-prompt temperature and without prefix sharing: then this is HFLM's, batches included."""
        if not self.per_prompt and self.prefixes is None:
            return self._planned(requests, disable_tqdm, override_bs)
        results: list = [None] * len(requests)
        for indices, ends in self.prompt_ends.layers(requests, self.max_length, self._rolling):
            self.prompt_ends.use(ends)
            try:
                got = self._planned([requests[i] for i in indices], disable_tqdm, override_bs)
            finally:
                self.prompt_ends.use({})
            for i, result in zip(indices, got):
                results[i] = result
        return results

    def _planned(self, requests, disable_tqdm: bool, override_bs: int | None):
        """HFLM's `_loglikelihood_tokens`, with the prompt prefixes these requests share planned first (see
        `prefix_sharing`)."""
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

        Rows that start with a planned shared prefix run on its cached encoding; their positions before both the
        prefix's end and the first continuation position (which lm-eval never reads: it scores continuations) hold
        zeros. Without any, this is HFLM's own call when uncalibrated, bit for bit.
        """
        ends = self.prompt_ends.of(inps.tolist())  # None for rows no request runs (HFLM's batch-size probe)
        groups = self.prefixes.groups(inps.tolist()) if self.prefixes is not None and self.prefixes.by_head else []
        if all(prefix is None for prefix, _ in groups):
            return self._whole(inps, ends)
        out = None
        with torch.no_grad(), self._autocast():
            for prefix, rows in groups:
                row_ends = None if ends is None else [ends[i] for i in rows]  # (b,)
                if prefix is None:
                    start, logits = 0, self._whole(inps[rows], row_ends)
                else:
                    cache = self.prefixes.cache(prefix)
                    ids = inps[rows].tolist()
                    hidden, _ = cache.forward(ids)  # (b, T, H), the prefix from its cache
                    start = max(0, min(cache.shared_length(r) for r in ids) - 1)  # first position scored
                    if row_ends is not None:  # a continuation that starts inside the prefix is scored from there
                        start = min([start] + [e.first for e in row_ends])
                    logits = self._calibrated(hidden, start, row_ends)
                if out is None:
                    out = logits.new_zeros((*inps.shape, logits.shape[-1]))
                out[rows, start:] = logits
        return out

    def _whole(self, inps: Tensor, ends: list[PromptEnd] | None = None) -> Tensor:
        """Logits (B, T, V) of a whole batch, no prefix reused."""
        if self.calibrator is None:
            return super()._model_call(inps)
        with self._autocast():
            hidden, _ = self.backbone.forward(inps)  # (B, T, H)
            return self._calibrated(hidden, 0, ends)

    def _calibrated(self, hidden: Tensor, start: int, ends: list[PromptEnd] | None) -> Tensor:
        """Calibrated logits (B, T - start, V) of hidden states (B, T, H); `ends`: the rows' prompt ends, for a
        per-prompt temperature."""
        if ends is None or not self.per_prompt:
            return calibrated_logits(self.backbone, self.calibrator, hidden, start)
        return prompt_calibrated_logits(self.backbone, self.calibrator, hidden, ends, start)

    def _autocast(self):
        return torch.autocast(device_type=self.device.type, dtype=self.mixed_precision_dtype,
                              enabled=self.mixed_precision_dtype is not None)

    # generate_until ------------------------------------------------------------------------------------------------
    def _model_generate(self, context: Tensor, max_length: int, stop: list[str], **generation_kwargs) -> Tensor:
        """generate_until's batch through the decoding core (`ats.generation.Decoder`) with the calibrator.

        Args:
            context: (B, P) left-padded prompts (`attention_mask` in `generation_kwargs` marks the padding).
            max_length: P + the new tokens at most.
            stop: lm-eval's stop strings (each row stops at the first; lm-eval cuts the text there itself).
            **generation_kwargs: `do_sample`, `temperature`, `top_k`, `top_p` (the model's generation config fills
                what is not given, as `generate` does), `min_new_tokens`, `num_beams` 1; `attention_mask`.

        Returns:
            (B, P + N) the prompts and every row's new tokens, padded after a row's end.

        Raises:
            ATSError: for beam search, or a generation option the calibrated decoding does not honour (`GEN_KWARGS`;
                lm-eval's `hf` model would, so ignoring it would compare other decodings).
        """
        if self.calibrator is None:
            return super()._model_generate(context, max_length, stop, **generation_kwargs)
        if int(generation_kwargs.get("num_beams", 1) or 1) > 1:
            raise ATSError("the ats model samples from calibrated logits; beam search (num_beams > 1) is not supported")
        unknown = sorted(k for k, v in generation_kwargs.items() if k not in GEN_KWARGS and v is not None)
        if unknown:
            name = unknown[0]
            raise ATSError(f"gen_kwargs {name}={generation_kwargs[name]!r}: not supported by the ats model's "
                           f"calibrated decoding (it honours {', '.join(sorted(GEN_KWARGS - {'attention_mask'}))})")
        mask = generation_kwargs.get("attention_mask")
        mask = torch.ones_like(context) if mask is None else mask
        temperature = float(generation_kwargs.get("temperature", 0.0) or 0.0)
        config = self.model.generation_config
        if generation_kwargs.get("do_sample") and temperature > 0:
            top_k, top_p = generation_kwargs.get("top_k", config.top_k), generation_kwargs.get("top_p", config.top_p)
            sampling = SamplingParams(temperature=temperature, top_k=int(top_k or 0),
                                      top_p=1.0 if top_p is None else float(top_p))
        else:
            sampling = SamplingParams(temperature=0)
        P, tok = context.shape[1], self.tokenizer
        min_tokens = int(generation_kwargs.get("min_new_tokens") or 0)
        rows = [Row(ids[m.bool()].tolist(), i, tok, max_tokens=max_length - P, sampling=sampling, stop=stop,
                    min_tokens=min_tokens) for i, (ids, m) in enumerate(zip(context.cpu(), mask.cpu()))]
        with self._autocast():
            Decoder(self.backbone, self.calibrator).run(rows)
        width = max(len(r.generated) for r in rows)
        out = torch.full((len(rows), P + width), tok.pad_token_id or 0, dtype=torch.long)
        out[:, :P] = context.cpu()
        for i, row in enumerate(rows):
            out[i, P: P + len(row.generated)] = torch.tensor(row.generated, dtype=torch.long)
        return out.to(context.device)

    def get_model_info(self) -> dict:
        """HFLM's model information plus the calibrator (its folder, type and digest) for the results file."""
        info = super().get_model_info()
        if self.calibrator is not None:
            info.update(ats_calibrator=self.calibrator_source, ats_calibrator_type=self.calibrator.name,
                        ats_calibrator_digest=self.calibrator.digest())
        return info
