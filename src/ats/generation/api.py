"""Calibrated generation: every step's logits are replaced by ATS's calibrated logits `q = z * exp(tau)`.

Decoding is transformers' own `generate`; ATS plugs into it with two forward hooks and one `LogitsProcessor`:

- a forward hook on the base model (`backbone.model.base_model`) captures the final hidden states of the positions
  processed by each forward pass: the whole prompt on the prefill step (the transformer head needs every prompt
  position to fill its own key/value cache, while `generate` asks the output layer for the last position only,
  `logits_to_keep=1`), then one new position per decoding step;
- a forward hook on the output embedding (`backbone.model.get_output_embeddings()`) captures the raw logits `z` of
  the last position, so that the reported probabilities are the model's own, before any of `generate`'s processors;
- `CalibrationProcessor` runs the head on the new position(s) (the transformer head extends its `HeadCache`, so a
  decoding step costs the head one position attending over T cached keys, O(T), not a pass over the whole prefix),
  and returns `scores * s` with `s = exp(tau).clamp(max_scale) > 0`. Greedy output is therefore unchanged and sampling
  draws from the calibrated distribution.

Order of processors (transformers 5.x, `GenerationMixin._get_logits_processor` in
`transformers/generation/utils.py`): the built-in processors that `generate` creates from its own options
(repetition penalty, no-repeat n-grams, bad words, min length / min new tokens, forced BOS/EOS, ...) come first; then
the user's `logits_processor` list is appended (`_merge_criteria_processor_list`); then, only when `do_sample`, the
sampling warpers: temperature, top-h, top-k, top-p, min-p, typical, epsilon, eta; watermarking and
`LogitNormalization` last. We pass `LogitsProcessorList([calibration, *yours])`, so the calibrator runs before every
warper: the user's temperature divides the calibrated logits (`q / T`) and top-k / top-p cut the calibrated
distribution. The built-in processors that run before it either mask tokens with -inf or apply the repetition
penalty (divide positive / multiply negative logits); both commute with multiplication by `s > 0`, so the result
is the same as calibrating first. Additive ones (`sequence_bias`) do not commute; they are applied before scaling.

Reported per-token values are exact: at step t the processor keeps the raw logits `z_t` (B, V) and `s_t`; the
token chosen at step t is known at step t + 1 (the last column of `input_ids`) or, for the last step, from the
returned sequences; its calibrated log-probability is `z_t[c] * s_t - logsumexp(z_t * s_t)` and its uncalibrated
one `z_t[c] - logsumexp(z_t)` (`ats.numerics.chosen_log_probs`, one shared shift for both). These are computed for
several steps at once when the kept logits fit in 2 MiB (batch 1), which costs far fewer small operations per step
than one step at a time.

Streaming (`stream=` callback, `print_stream` for the CLI) computes them every step instead and is fed one decoding
step behind (tens of milliseconds), with each token's text decoded incrementally per sequence.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from transformers import LogitsProcessorList

from ..calibrators.ats import ATSCalibrator
from ..errors import ATSError
from ..model.backbone import Backbone
from .processor import CalibrationProcessor
from .stream import Streamer, StreamToken, first_stop


@dataclass
class CalibratedGeneration:
    """One generated continuation with per-token calibrated confidence.

    `token_ids`, `confidences`, `uncalibrated`, `taus` have one entry per generated token, up to and including the
    end-of-sequence token when the model produced one (its probability is a prediction too), and cut after a stop
    string. `confidences[i]` is the calibrated probability `softmax(z * exp(tau))[token_ids[i]]` of the token
    that was chosen, `uncalibrated[i]` the backbone's own `softmax(z)[token_ids[i]]`; both are taken before
    `generate`'s own processors and sampling warpers.
    """

    prompt: str
    text: str
    token_ids: list[int]
    confidences: list[float]
    uncalibrated: list[float]
    taus: list[float]
    finish_reason: str  # "eos" | "stop" (a stop string) | "length"
    prompt_text: str = ""  # the prompt as given to the model (after the chat template)
    tokens: list[str] = field(default_factory=list)  # each token decoded on its own

    @property
    def mean_confidence(self) -> float:
        """Mean calibrated probability of the generated tokens (NaN when there are none)."""
        return _mean(self.confidences)

    @property
    def product_confidence(self) -> float:
        """Product of the calibrated probabilities: the sequence's calibrated likelihood."""
        return math.exp(self.log_confidence)

    @property
    def log_confidence(self) -> float:
        """Sum of the calibrated log-probabilities (the sequence's calibrated log-likelihood)."""
        return float(sum(math.log(max(p, 1e-300)) for p in self.confidences))

    @property
    def mean_uncalibrated(self) -> float:
        """Mean of the backbone's own probabilities of the generated tokens (NaN when there are none)."""
        return _mean(self.uncalibrated)

    @property
    def product_uncalibrated(self) -> float:
        """Product of the backbone's own probabilities: the sequence's uncalibrated likelihood."""
        return math.exp(float(sum(math.log(max(p, 1e-300)) for p in self.uncalibrated)))

    def to_dict(self) -> dict:
        """The fields and the four summaries, JSON-ready (the CLI's --json output)."""
        return {"prompt": self.prompt, "text": self.text, "finish_reason": self.finish_reason,
                "token_ids": self.token_ids, "tokens": self.tokens, "confidences": self.confidences,
                "uncalibrated": self.uncalibrated, "taus": self.taus, "mean_confidence": self.mean_confidence,
                "product_confidence": self.product_confidence, "mean_uncalibrated": self.mean_uncalibrated,
                "product_uncalibrated": self.product_uncalibrated}


def _mean(values: Sequence[float]) -> float:
    return float(sum(values) / len(values)) if values else float("nan")


def eos_ids(backbone: Backbone) -> set[int]:
    """The end-of-sequence token ids of the generation config, the model config and the tokenizer.

    Args:
        backbone: the backbone whose configs and tokenizer are read.

    Returns:
        The union of their ids (empty when none names one).
    """
    ids: set[int] = set()
    for source in (getattr(backbone.model, "generation_config", None), backbone.model.config, backbone.tokenizer):
        eos = getattr(source, "eos_token_id", None)
        if eos is None:
            continue
        ids.update(int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos]))
    return ids


def format_prompts(backbone: Backbone, prompts: Sequence[str], chat_template: bool = True) -> tuple[list[str], bool]:
    """The prompt texts given to the model: each wrapped as one user turn by the chat template when the backbone is
    a chat model and `chat_template`.

    Args:
        backbone: the backbone (its tokenizer holds the template).
        prompts: the user's prompts.
        chat_template: use the template when there is one.

    Returns:
        (texts, templated): `templated` tells whether the template was applied (it adds the special tokens).
    """
    if not (chat_template and backbone.is_chat):
        return list(prompts), False
    texts = [backbone.tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                                     tokenize=False) for p in prompts]
    return texts, True


def encode_prompts(backbone: Backbone, prompts: Sequence[str], chat_template: bool = True):
    """Left-padded `input_ids`, `attention_mask` (B, P) on the backbone's device, and the prompt texts.

    Args:
        backbone: the backbone whose tokenizer encodes the prompts.
        prompts: B prompts.
        chat_template: as for `format_prompts`.

    Returns:
        (input_ids (B, P) long, attention_mask (B, P) long, the B texts given to the model).
    """
    texts, templated = format_prompts(backbone, prompts, chat_template)
    tok = backbone.tokenizer
    side = tok.padding_side
    tok.padding_side = "left"
    try:
        enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=not templated)
    finally:
        tok.padding_side = side
    return enc["input_ids"].to(backbone.device), enc["attention_mask"].to(backbone.device), texts


@torch.no_grad()
def generate_calibrated(
    backbone: Backbone,
    calibrator: ATSCalibrator,
    prompts: str | Sequence[str],
    *,
    max_new_tokens: int = 64,
    do_sample: bool = False,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    stop_strings: str | Sequence[str] | None = None,
    chat_template: bool = True,
    stream: Callable[[StreamToken], None] | None = None,
    flush_every: int | None = None,
    **generate_kwargs,
) -> list[CalibratedGeneration]:
    """Generate from `backbone` with ATS-calibrated logits and per-token calibrated confidence.

    Args:
        backbone: the frozen backbone.
        calibrator: an ATS calibrator fitted for `backbone`.
        prompts: one string or a list (batched, left-padded). For a chat backbone (`backbone.is_chat`) each prompt
            is sent as one user turn through the chat template unless `chat_template=False`.
        max_new_tokens: the most tokens generated per sequence.
        do_sample: False: greedy (the same text as plain `generate`, since `s > 0` keeps the argmax). True: samples
            from the calibrated distribution, then `temperature`, `top_k`, `top_p` apply on top of it. Seed with
            `torch.manual_seed`.
        temperature: sampling temperature on top of the calibrated logits.
        top_k: top-k sampling; None disables it, whatever the model's generation config says.
        top_p: nucleus sampling; None disables it, likewise.
        stop_strings: generation stops at the first one and the text is cut before it.
        chat_template: see `prompts`.
        stream: called with a `StreamToken` per generated token (use `print_stream` for coloured terminal output).
        flush_every: how many steps' token probabilities are computed together (see `CalibrationProcessor`); None:
            1 when streaming, else as many as fit in 2 MiB (at most 16). The results do not depend on it.
        **generate_kwargs: passed on to `model.generate` (e.g. `min_new_tokens`, `repetition_penalty`,
            `num_return_sequences`, your own `logits_processor`, which runs after the calibrator).

    Returns:
        One `CalibratedGeneration` per output sequence (per prompt, or prompt-major with `num_return_sequences`).

    Raises:
        ATSError: if the calibrator does not fit the backbone, beam search is asked for, or `max_new_tokens` or
            `flush_every` is invalid.
    """
    calibrator.check_backbone(backbone)
    prompts = [prompts] if isinstance(prompts, str) else list(prompts)
    stop_strings = [s for s in ([stop_strings] if isinstance(stop_strings, str) else stop_strings or []) if s]
    _check_options(max_new_tokens, flush_every, generate_kwargs)
    if not prompts:
        return []
    tok = backbone.tokenizer
    input_ids, attention_mask, texts = encode_prompts(backbone, prompts, chat_template)
    eos = eos_ids(backbone)
    repeats = int(generate_kwargs.get("num_return_sequences", 1) or 1)
    streamer = Streamer(stream, tok, len(prompts) * repeats, eos, stop_strings) if stream is not None else None
    processor = CalibrationProcessor(calibrator, attention_mask, softcap=backbone.softcap, on_record=streamer,
                                     flush_every=flush_every)
    user_processors = generate_kwargs.pop("logits_processor", None) or []
    options = dict(max_new_tokens=max_new_tokens, do_sample=do_sample, pad_token_id=tok.pad_token_id,
                   logits_processor=LogitsProcessorList([processor, *user_processors]))
    if do_sample:
        options.update(temperature=temperature, top_k=top_k or 0, top_p=1.0 if top_p is None else top_p)
    if stop_strings:
        options.update(stop_strings=stop_strings, tokenizer=tok)
    options.update(generate_kwargs, return_dict_in_generate=False)

    handles = processor.attach(backbone.model)
    try:
        sequences = backbone.model.generate(input_ids=input_ids, attention_mask=attention_mask, **options)
    finally:
        for handle in handles:
            handle.remove()
    new_tokens = sequences[:, input_ids.shape[1]:]  # (rows, N)
    processor.finish(new_tokens)
    if streamer is not None:
        streamer.close()
    rows, n = new_tokens.shape
    stacked = [torch.stack(values, 1).cpu() if n else torch.zeros(rows, 0)  # (rows, N) each
               for values in (processor.logp_q, processor.logp_z, processor.taus)]
    conf, raw, taus = stacked[0].exp(), stacked[1].exp(), stacked[2]
    return [_output(tok, new_tokens[row].tolist(), (conf[row], raw[row], taus[row]), prompts[row // repeats],
                    texts[row // repeats], eos, stop_strings) for row in range(rows)]


def _check_options(max_new_tokens, flush_every, generate_kwargs: dict) -> None:
    if int(generate_kwargs.get("num_beams", 1) or 1) > 1:
        raise ATSError("calibrated generation does not support beam search (num_beams > 1); use greedy or sampling")
    if flush_every is not None and (isinstance(flush_every, bool) or not isinstance(flush_every, int)
                                    or flush_every < 1):
        raise ATSError(f"flush_every: expected a positive integer or None, got {flush_every!r}")
    if max_new_tokens < 1:
        raise ATSError(f"max_new_tokens: expected a positive integer, got {max_new_tokens!r}")


def _output(tok, ids: list[int], values: tuple[torch.Tensor, torch.Tensor, torch.Tensor], prompt: str,
            text_in: str, eos: set[int], stop_strings: list[str]) -> CalibratedGeneration:
    """One row's result: cut after end-of-sequence or before a stop string, with its per-token calibrated and
    uncalibrated probabilities and taus (`values`, (N,) each)."""
    length, reason = len(ids), "length"
    for i, token in enumerate(ids):
        if token in eos:
            length, reason = i + 1, "eos"
            break
    ids = ids[:length]
    text = tok.decode(ids, skip_special_tokens=True)
    cut = first_stop(text, stop_strings)
    if cut is not None:
        text, reason = text[:cut], "stop"
        length = tokens_covering(tok, ids, cut)
        ids = ids[:length]
    conf, raw, taus = (v[:length].tolist() for v in values)
    return CalibratedGeneration(prompt=prompt, prompt_text=text_in, text=text, token_ids=ids,
                                tokens=[tok.decode([i]) for i in ids], confidences=conf, uncalibrated=raw, taus=taus,
                                finish_reason=reason)


def tokens_covering(tokenizer, ids: list[int], chars: int) -> int:
    """The fewest leading tokens whose decoded text reaches `chars` characters (the tokens before a stop string).

    Args:
        tokenizer: decodes the ids.
        ids: the generated token ids.
        chars: the length of the text to cover.

    Returns:
        The number of tokens (all of them if their text is shorter).
    """
    if chars <= 0:
        return 0
    for n in range(1, len(ids) + 1):
        if len(tokenizer.decode(ids[:n], skip_special_tokens=True)) >= chars:
            return n
    return len(ids)
