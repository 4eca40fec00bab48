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
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor
from transformers import LogitsProcessor, LogitsProcessorList

from .ats import ATSCalibrator
from .backbone import Backbone
from .errors import ATSError
from .heads import HeadCache, TransformerHead
from .numerics import chosen_log_probs

# Confidence colours for streaming: red < LOW <= yellow < HIGH <= green.
LOW, HIGH = 0.3, 0.7
_RED, _YELLOW, _GREEN, _RESET = "\033[31m", "\033[33m", "\033[32m", "\033[0m"


# --------------------------------------------------------------------------------------------------------------------
# outputs


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
        return _mean(self.confidences)

    @property
    def product_confidence(self) -> float:
        return math.exp(self.log_confidence)

    @property
    def log_confidence(self) -> float:
        """Sum of the calibrated log-probabilities (the sequence's calibrated log-likelihood)."""
        return float(sum(math.log(max(p, 1e-300)) for p in self.confidences))

    @property
    def mean_uncalibrated(self) -> float:
        return _mean(self.uncalibrated)

    @property
    def product_uncalibrated(self) -> float:
        return math.exp(float(sum(math.log(max(p, 1e-300)) for p in self.uncalibrated)))

    def to_dict(self) -> dict:
        return {"prompt": self.prompt, "text": self.text, "finish_reason": self.finish_reason,
                "token_ids": self.token_ids, "tokens": self.tokens, "confidences": self.confidences,
                "uncalibrated": self.uncalibrated, "taus": self.taus, "mean_confidence": self.mean_confidence,
                "product_confidence": self.product_confidence, "mean_uncalibrated": self.mean_uncalibrated,
                "product_uncalibrated": self.product_uncalibrated}


def _mean(values: Sequence[float]) -> float:
    return float(sum(values) / len(values)) if values else float("nan")


@dataclass
class StreamToken:
    """One streamed token of sequence `row`: `text` is the new text it completes (may be "" for a special token or
    a partial UTF-8 character held back), `done` marks the end of that sequence (no token then)."""

    row: int
    index: int
    token_id: int
    text: str
    confidence: float
    uncalibrated: float
    tau: float
    done: bool = False


def colorize(text: str, confidence: float) -> str:
    """`text` in ANSI red (< 0.3), yellow (< 0.7) or green, by calibrated confidence; plain when NO_COLOR is set."""
    if os.environ.get("NO_COLOR"):
        return text
    colour = _RED if confidence < LOW else _YELLOW if confidence < HIGH else _GREEN
    return f"{colour}{text}{_RESET}"


def print_stream(token: StreamToken, file=None) -> None:
    """Streaming callback for the CLI: prints the first sequence token by token, coloured by confidence."""
    file = file or sys.stdout
    if token.row != 0:
        return
    if token.done:
        print(file=file, flush=True)
    elif token.text:
        print(colorize(token.text, token.confidence), end="", file=file, flush=True)


# --------------------------------------------------------------------------------------------------------------------
# the logits processor


class CalibrationProcessor(LogitsProcessor):
    """Multiplies each step's scores by `s = exp(tau)` from the ATS head, fed by forward hooks (see `attach`).

    Put it first in the `LogitsProcessorList` given to `generate`. One instance serves one `generate` call.

    The chosen tokens' probabilities are computed in batches of `flush_every` steps (their raw logits are kept until
    then): a vocabulary-wide log-normaliser is a dozen small operations, and at batch 1 their fixed cost exceeds
    their arithmetic, so one call on K steps is far cheaper than K calls on one. Batching stops paying once the kept
    logits no longer fit in cache: every deferred step is read back from memory. None picks 1 when `on_record`
    streams tokens (no delay) and otherwise as many steps as fit in 2 MiB, at most 16 (SmolLM2: 10 at batch 1,
    1 at batch 8).
    """

    def __init__(self, calibrator: ATSCalibrator, prompt_mask: Tensor, *, softcap: float | None = None,
                 on_record: Callable[[Tensor, Tensor, Tensor, Tensor], None] | None = None,
                 flush_every: int | None = None) -> None:
        self.calibrator = calibrator
        self.mask = prompt_mask.long()  # (B, P) prompt mask, then a buffer with room for generated columns (ones)
        self.softcap = softcap
        self.on_record = on_record
        self.flush_every = flush_every
        self.uses_cache = isinstance(calibrator.head, TransformerHead)
        self.cache = HeadCache() if self.uses_cache else None
        self.seen = 0  # positions already passed through the head
        self.hidden: Tensor | None = None  # set by the base-model hook: (B, T_new, H)
        self.raw: Tensor | None = None  # set by the output-embedding hook: (B, T_out, V)
        self.taus: list[Tensor] = []  # per step (B,)
        self.logp_q: list[Tensor] = []  # per step (B,), log-prob of the chosen token, calibrated
        self.logp_z: list[Tensor] = []  # per step (B,), uncalibrated
        self._pending: list[tuple[Tensor, Tensor]] = []  # (z (B, V), s (B,)) of steps after those in logp_q
        self._tokens: list[Tensor] = []  # (B,) chosen tokens of the first pending steps

    # hooks ----------------------------------------------------------------------------------------------------------
    def attach(self, model) -> list:
        """Register the two forward hooks on a HF causal LM; returns their handles (call `.remove()` on each)."""

        def on_base(module, args, output):
            hidden = getattr(output, "last_hidden_state", None)
            self.hidden = hidden if hidden is not None else output[0]

        def on_head(module, args, output):
            self.raw = output

        return [model.base_model.register_forward_hook(on_base),
                model.get_output_embeddings().register_forward_hook(on_head)]

    # steps ----------------------------------------------------------------------------------------------------------
    @property
    def steps(self) -> int:
        return len(self.taus)

    def _flush_size(self, z: Tensor) -> int:
        if self.flush_every is not None:
            return max(1, int(self.flush_every))
        if self.on_record is not None:
            return 1
        return max(1, min(16, (2 << 20) // max(1, z.numel() * z.element_size())))

    def flush(self) -> None:
        """Compute the log-probabilities of every pending step whose chosen token is known (see `chosen_log_probs`)."""
        m = len(self._tokens)
        if m == 0:
            return
        steps, self._pending = self._pending[:m], self._pending[m:]
        if m == 1:  # (1, B, ...) views, no copy
            z, s, tokens = steps[0][0][None], steps[0][1][None], self._tokens[0][None]
        else:
            z = torch.stack([step[0] for step in steps])  # (m, B, V)
            s = torch.stack([step[1] for step in steps])  # (m, B)
            tokens = torch.stack(self._tokens)  # (m, B)
        self._tokens = []
        if tokens.device != z.device or tokens.dtype != torch.long:
            tokens = tokens.to(z.device, torch.long)
        logp_z, logp_q = chosen_log_probs(z, s, tokens)  # (m, B) each
        for i in range(m):
            self.logp_z.append(logp_z[i])
            self.logp_q.append(logp_q[i])
            if self.on_record is not None:
                self.on_record(tokens[i], logp_q[i], logp_z[i], self.taus[len(self.logp_q) - 1])

    def _attention_mask(self, B: int, L: int, device: torch.device) -> Tensor:
        """The mask (B, L) of prompt + generated positions: a view of a buffer that doubles when full (generated
        tokens are real, so every column after the prompt is 1)."""
        if self.mask.shape[0] != B:  # num_return_sequences > 1: rows repeated per prompt
            if B % self.mask.shape[0]:
                raise ATSError(f"calibrated generation: batch of {B} rows for {self.mask.shape[0]} prompts")
            self.mask = self.mask.repeat_interleave(B // self.mask.shape[0], dim=0)
        if self.mask.device != device:
            self.mask = self.mask.to(device)
        if self.mask.shape[1] < L:
            grown = self.mask.new_ones(B, max(L, 2 * self.mask.shape[1]))
            grown[:, : self.mask.shape[1]] = self.mask
            self.mask = grown
        return self.mask[:, :L]

    @torch.no_grad()
    def __call__(self, input_ids: Tensor, scores: Tensor) -> Tensor:
        B, L = input_ids.shape
        if self.steps > len(self.logp_q) + len(self._tokens):  # the previous step's token is the last input id
            self._tokens.append(input_ids[:, -1])
        mask = self._attention_mask(B, L, input_ids.device)
        if self.hidden is None:
            raise ATSError("calibrated generation: no hidden state captured for this step (forward hook not attached)")
        new = L - self.seen
        hidden = self.hidden
        if self.uses_cache:
            if hidden.shape[1] < new:
                raise ATSError(f"calibrated generation: expected hidden states for {new} new positions, got "
                               f"{hidden.shape[1]}")
            tau = self.calibrator.temperature(hidden[:, hidden.shape[1] - new:], mask, cache=self.cache)[:, -1]
        else:  # per-token heads (linear, mlp) only need the last position
            tau = self.calibrator.temperature(hidden[:, -1:], mask)[:, -1]
        self.seen = L
        s = self.calibrator.scale(tau)  # (B,)
        if s.device != scores.device or s.dtype != torch.float32:
            s = s.to(scores.device, torch.float32)
        if self.raw is None:
            z = scores.clone()  # (B, V) kept until flushed
        else:  # the model's own logits; a copy if the output holds more positions than the last (no logits_to_keep)
            z = self.raw[:, -1] if self.raw.shape[1] == 1 else self.raw[:, -1].clone()
        if z.device != scores.device or z.dtype != torch.float32:
            z = z.to(scores.device, torch.float32)
        if self.raw is not None and self.softcap:
            z = torch.tanh(z / self.softcap) * self.softcap
        self._pending.append((z, s))
        self.taus.append(tau if tau.device == scores.device else tau.to(scores.device))
        self.hidden = self.raw = None
        if len(self._tokens) >= self._flush_size(z):
            self.flush()
        return scores * (s[:, None] if scores.dtype == torch.float32 else s[:, None].to(scores.dtype))

    def finish(self, new_tokens: Tensor) -> None:
        """After `generate`: drop steps it undid and compute the remaining steps' probabilities, with the chosen
        tokens taken from the returned `new_tokens` (B, N)."""
        n = new_tokens.shape[1]
        done = len(self.logp_q)
        del self.taus[n:], self.logp_q[n:], self.logp_z[n:]
        self._pending = self._pending[: max(0, n - done)]
        self._tokens = [new_tokens[:, i] for i in range(min(done, n), min(done, n) + len(self._pending))]
        self.flush()


# --------------------------------------------------------------------------------------------------------------------
# the API


def _eos_ids(backbone: Backbone) -> set[int]:
    ids: set[int] = set()
    for source in (getattr(backbone.model, "generation_config", None), backbone.model.config, backbone.tokenizer):
        eos = getattr(source, "eos_token_id", None)
        if eos is None:
            continue
        ids.update(int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos]))
    return ids


def format_prompts(backbone: Backbone, prompts: Sequence[str], chat_template: bool = True) -> tuple[list[str], bool]:
    """The prompt texts given to the model: each wrapped as one user turn by the chat template when the backbone is
    a chat model and `chat_template`; returns (texts, templated)."""
    if not (chat_template and backbone.is_chat):
        return list(prompts), False
    texts = [backbone.tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                                     tokenize=False) for p in prompts]
    return texts, True


def encode_prompts(backbone: Backbone, prompts: Sequence[str], chat_template: bool = True):
    """Left-padded `input_ids`, `attention_mask` (B, P) on the backbone's device, and the prompt texts."""
    texts, templated = format_prompts(backbone, prompts, chat_template)
    tok = backbone.tokenizer
    side = tok.padding_side
    tok.padding_side = "left"
    try:
        enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=not templated)
    finally:
        tok.padding_side = side
    return enc["input_ids"].to(backbone.device), enc["attention_mask"].to(backbone.device), texts


class _Streamer:
    """Turns per-step records into `StreamToken`s with incrementally decoded text, per sequence."""

    def __init__(self, callback, tokenizer, rows: int, eos: set[int], stop_strings: Sequence[str]) -> None:
        self.callback, self.tokenizer, self.eos, self.stop = callback, tokenizer, eos, list(stop_strings or [])
        self.ids: list[list[int]] = [[] for _ in range(rows)]
        self.emitted = [0] * rows
        self.finished = [False] * rows

    def __call__(self, tokens: Tensor, logp_q: Tensor, logp_z: Tensor, tau: Tensor) -> None:
        tokens, pq, pz, tau = (t.tolist() for t in (tokens, logp_q.exp(), logp_z.exp(), tau))
        for row, token in enumerate(tokens):
            if self.finished[row]:
                continue
            self.ids[row].append(token)
            text = ""
            if token in self.eos:
                self.finished[row] = True
            else:
                full = self.tokenizer.decode(self.ids[row], skip_special_tokens=True)
                cut = _first_stop(full, self.stop)
                if cut is not None:
                    full, self.finished[row] = full[:cut], True
                if cut is not None or not full.endswith("\ufffd"):  # hold back a partial UTF-8 character
                    text, self.emitted[row] = full[self.emitted[row]:], len(full)
            self.callback(StreamToken(row, len(self.ids[row]) - 1, token, text, pq[row], pz[row], tau[row]))

    def close(self) -> None:
        for row in range(len(self.ids)):
            self.callback(StreamToken(row, len(self.ids[row]), -1, "", float("nan"), float("nan"), float("nan"),
                                      done=True))


def _first_stop(text: str, stops: Sequence[str]) -> int | None:
    hits = [i for i in (text.find(s) for s in stops if s) if i >= 0]
    return min(hits) if hits else None


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

    prompts: one string or a list (batched, left-padded). For a chat backbone (`backbone.is_chat`) each prompt is
    sent as one user turn through the chat template unless `chat_template=False`.
    do_sample=False: greedy (the same text as plain `generate`, since `s > 0` keeps the argmax). do_sample=True:
    samples from the calibrated distribution, then `temperature`, `top_k`, `top_p` apply on top of it
    (None disables top-k / top-p, whatever the model's generation config says). Seed with `torch.manual_seed`.
    stop_strings: generation stops at the first one and the text is cut before it.
    stream: called with a `StreamToken` per generated token (use `print_stream` for coloured terminal output).
    flush_every: how many steps' token probabilities are computed together (see `CalibrationProcessor`); None: 1
    when streaming, else as many as fit in 2 MiB (at most 16). The results do not depend on it.
    generate_kwargs: passed on to `model.generate` (e.g. `min_new_tokens`, `repetition_penalty`,
    `num_return_sequences`, your own `logits_processor`, which runs after the calibrator). Beam search is refused.
    Returns one `CalibratedGeneration` per output sequence (per prompt, or prompt-major with
    `num_return_sequences`).
    """
    calibrator.check_backbone(backbone)
    if isinstance(prompts, str):
        prompts = [prompts]
    prompts = list(prompts)
    if not prompts:
        return []
    if isinstance(stop_strings, str):
        stop_strings = [stop_strings]
    stop_strings = [s for s in (stop_strings or []) if s]
    if int(generate_kwargs.get("num_beams", 1) or 1) > 1:
        raise ATSError("calibrated generation does not support beam search (num_beams > 1); use greedy or sampling")
    if flush_every is not None and (isinstance(flush_every, bool) or not isinstance(flush_every, int)
                                    or flush_every < 1):
        raise ATSError(f"flush_every: expected a positive integer or None, got {flush_every!r}")
    if max_new_tokens < 1:
        raise ATSError(f"max_new_tokens: expected a positive integer, got {max_new_tokens!r}")

    tok = backbone.tokenizer
    input_ids, attention_mask, texts = encode_prompts(backbone, prompts, chat_template)
    eos = _eos_ids(backbone)
    repeats = int(generate_kwargs.get("num_return_sequences", 1) or 1)
    rows = len(prompts) * repeats
    streamer = _Streamer(stream, tok, rows, eos, stop_strings) if stream is not None else None
    processor = CalibrationProcessor(calibrator, attention_mask, softcap=backbone.softcap, on_record=streamer,
                                     flush_every=flush_every)

    user_processors = generate_kwargs.pop("logits_processor", None) or []
    options = dict(max_new_tokens=max_new_tokens, do_sample=do_sample, pad_token_id=tok.pad_token_id,
                   logits_processor=LogitsProcessorList([processor, *user_processors]))
    if do_sample:
        options.update(temperature=temperature, top_k=top_k or 0, top_p=1.0 if top_p is None else top_p)
    if stop_strings:
        options.update(stop_strings=stop_strings, tokenizer=tok)
    options.update(generate_kwargs)
    options["return_dict_in_generate"] = False

    handles = processor.attach(backbone.model)
    try:
        sequences = backbone.model.generate(input_ids=input_ids, attention_mask=attention_mask, **options)
    finally:
        for handle in handles:
            handle.remove()
    prompt_len = input_ids.shape[1]
    new_tokens = sequences[:, prompt_len:]
    processor.finish(new_tokens)
    if streamer is not None:
        streamer.close()

    n = new_tokens.shape[1]
    taus = torch.stack(processor.taus, 1).cpu() if n else torch.zeros(rows, 0)  # (B, N)
    conf = torch.stack(processor.logp_q, 1).exp().cpu() if n else torch.zeros(rows, 0)
    raw = torch.stack(processor.logp_z, 1).exp().cpu() if n else torch.zeros(rows, 0)
    outputs = []
    for row in range(rows):
        ids = new_tokens[row].tolist()
        length, reason = len(ids), "length"
        for i, token in enumerate(ids):
            if token in eos:
                length, reason = i + 1, "eos"
                break
        ids = ids[:length]
        text = tok.decode(ids, skip_special_tokens=True)
        cut = _first_stop(text, stop_strings)
        if cut is not None:
            text, reason = text[:cut], "stop"
            length = _tokens_covering(tok, ids, cut)
            ids = ids[:length]
        outputs.append(CalibratedGeneration(
            prompt=prompts[row // repeats], prompt_text=texts[row // repeats], text=text, token_ids=ids,
            tokens=[tok.decode([i]) for i in ids], confidences=conf[row, :length].tolist(),
            uncalibrated=raw[row, :length].tolist(), taus=taus[row, :length].tolist(), finish_reason=reason))
    return outputs


def _tokens_covering(tokenizer, ids: list[int], chars: int) -> int:
    """The fewest leading tokens whose decoded text reaches `chars` characters (the tokens before a stop string)."""
    if chars <= 0:
        return 0
    for n in range(1, len(ids) + 1):
        if len(tokenizer.decode(ids[:n], skip_special_tokens=True)) >= chars:
            return n
    return len(ids)
