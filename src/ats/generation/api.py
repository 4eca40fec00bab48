"""`generate_calibrated`: calibrated generation in process, a thin call of the decoding core (`decoder.Decoder`).

Every prompt (times `num_return_sequences`) becomes a row of one batch, prefilled together (left-padded) and decoded
until every row has finished; finished rows leave the batch. Any calibrator works (`calibration.DecodingCalibration`):
an ATS head scales each token's logits by its own `s = exp(tau)` (the transformer head with its KV cache), temperature
or Thermometer by one factor, binning methods map the reported confidence. Greedy text is the model's own; sampling
draws from the calibrated distribution with transformers' warpers on top (temperature, top-k, top-p), from the global
random generator (seed it with `torch.manual_seed`). Reported per-token values are exact: each chosen token's
calibrated and uncalibrated log-probability at its step, before any warper. Streaming (`stream=`) gets one
`StreamToken` per token, its text from the same incremental detokenizer the server uses (`text.TextTracker`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from ..calibrators.base import Calibrator
from ..confidence import ANSWER_MAX_TOKENS
from ..errors import ATSError
from ..model.backbone import Backbone
from .decoder import Decoder, Row
from .limits import check_prompts, context_length
from .logprobs import answer_confidence
from .sampling import SamplingParams
from .stream import StreamToken

OPTIONS = ("num_return_sequences", "min_new_tokens", "logits_processor", "num_beams")  # generate-style extras


class AnswerRule(Protocol):
    """What decides answer-or-abstain (`ats.evaluation.threshold.CertifiedThreshold`, a layer above this one)."""

    def decide(self, confidence: float | None) -> dict:
        """{"answered": bool, "threshold": float | None, ...} for an answer of this confidence."""


@dataclass
class CalibratedGeneration:
    """One generated continuation with per-token calibrated confidence.

    `token_ids`, `confidences`, `uncalibrated`, `taus` have one entry per generated token, up to and including the
    end-of-sequence token when the model produced one (its probability is a prediction too), and cut after a stop
    string. `confidences[i]` is the calibrated probability of the token that was chosen (ATS:
    `softmax(z * exp(tau))[token_ids[i]]`), `uncalibrated[i]` the backbone's own `softmax(z)[token_ids[i]]`; both
    are taken before the sampling warpers. `taus[i]` is the ATS head's tau (0 uncalibrated, NaN for calibrators
    without one). `answer_confidence` is the mean of the tokens' confidences through the calibrator's binning map
    when it has one (`confidence_kind` "mapped"), the end-of-sequence token left out: the number `ats eval`'s
    generative tasks compute for an answer; `uncalibrated_answer_confidence` is the backbone's own by the same rule.
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
    answer_confidence: float = float("nan")  # the answer's confidence as the evaluation tasks compute it
    uncalibrated_answer_confidence: float = float("nan")  # the backbone's own, by the same rule, for the same answer
    confidence_kind: str = "probability"  # "mapped": through a binning calibrator's map
    answered: bool | None = None  # with a certified threshold: answer_confidence >= it (None: no threshold)
    threshold: float | None = None  # that threshold (None: none, or abstain always)

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
                "product_uncalibrated": self.product_uncalibrated, "answer_confidence": self.answer_confidence,
                "uncalibrated_answer_confidence": self.uncalibrated_answer_confidence,
                "confidence_kind": self.confidence_kind, "answered": self.answered, "threshold": self.threshold}


def _mean(values: Sequence[float]) -> float:
    return float(sum(values) / len(values)) if values else float("nan")


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
    # the side is passed with this call only: the shared tokenizer's own `padding_side` is never changed
    enc = backbone.tokenizer(texts, return_tensors="pt", padding=True, padding_side="left",
                             add_special_tokens=not templated)
    return enc["input_ids"].to(backbone.device), enc["attention_mask"].to(backbone.device), texts


@torch.no_grad()
def generate_calibrated(
    backbone: Backbone,
    calibrator: Calibrator | None,
    prompts: str | Sequence[str],
    *,
    max_new_tokens: int = ANSWER_MAX_TOKENS,
    do_sample: bool = False,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    stop_strings: str | Sequence[str] | None = None,
    chat_template: bool = True,
    stream: Callable[[StreamToken], None] | None = None,
    threshold: AnswerRule | None = None,
    **options,
) -> list[CalibratedGeneration]:
    """Generate from `backbone` with calibrated logits and per-token calibrated confidence.

    Args:
        backbone: the frozen backbone.
        calibrator: any calibrator fitted for `backbone` (ATS heads, temperature, vector, binning, isotonic,
            Thermometer, ...), or None for the model's own probabilities.
        prompts: one string or a list (one batch). For a chat backbone (`backbone.is_chat`) each prompt is sent as
            one user turn through the chat template unless `chat_template=False`.
        max_new_tokens: the most tokens generated per sequence.
        do_sample: False: greedy (the model's own text). True: samples from the calibrated distribution, with
            `temperature`, `top_k`, `top_p` on top of it. Seed with `torch.manual_seed`.
        temperature: sampling temperature on top of the calibrated logits.
        top_k: top-k sampling; None disables it.
        top_p: nucleus sampling; None disables it.
        stop_strings: generation stops at the first one and the text is cut before it.
        chat_template: see `prompts`.
        stream: called with a `StreamToken` per generated token (use `print_stream` for coloured terminal output).
        threshold: a certified answer-or-abstain threshold (`ats certify`; `read_threshold(folder)`): each output
            then says whether it is answered (`answered`).
        **options: `num_return_sequences` (sequences per prompt), `min_new_tokens` (no end-of-sequence before),
            `logits_processor` (transformers processors, run on the calibrated logits before the warpers);
            `num_beams` must be 1.

    Returns:
        One `CalibratedGeneration` per output sequence (per prompt, or prompt-major with `num_return_sequences`).

    Raises:
        ATSError: if the calibrator does not fit the backbone, beam search or an unknown option is asked for, an
            option or sampling setting is out of range, a prompt is empty, or a prompt + `max_new_tokens` is over
            the model's context (`limits.check_prompts`).
    """
    prompts = _strings(prompts, "prompts")
    stop_strings = [s for s in _strings(stop_strings or [], "stop_strings") if s]
    _check_options(max_new_tokens, options)
    sampling = (SamplingParams(temperature=temperature, top_k=top_k or 0, top_p=1.0 if top_p is None else top_p)
                if do_sample else SamplingParams(temperature=0))
    if not prompts:
        return []
    input_ids, attention_mask, texts = encode_prompts(backbone, prompts, chat_template)
    encoded = [ids[mask.bool()].tolist() for ids, mask in zip(input_ids.cpu(), attention_mask.cpu())]
    check_prompts(encoded, vocab_size=backbone.vocab_size, max_model_len=context_length(backbone),
                  max_tokens=max_new_tokens)
    repeats = int(options.get("num_return_sequences") or 1)
    min_tokens = int(options.get("min_new_tokens") or 0)
    rows = [Row(encoded[p], p, backbone.tokenizer, max_tokens=max_new_tokens, sampling=sampling, stop=stop_strings,
                min_tokens=min_tokens) for p in range(len(prompts)) for _ in range(repeats)]
    streamer = _Streamer(rows, stream) if stream is not None else None
    decoder = Decoder(backbone, calibrator, on_token=streamer,
                      logits_processors=options.get("logits_processor") or ())
    decoder.run(rows)
    if streamer is not None:
        streamer.close()
    kind = decoder.calibration.confidence_kind
    outputs = [_output(backbone.tokenizer, row, prompts[i // repeats], texts[i // repeats], kind)
               for i, row in enumerate(rows)]
    if threshold is not None:
        for out in outputs:
            decision = threshold.decide(out.answer_confidence)
            out.threshold, out.answered = decision["threshold"], decision["answered"]
    return outputs


def _strings(value, name: str) -> list[str]:
    """`value` (a string or a sequence of strings) as a list of strings; an ATSError naming `name` otherwise."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, Sequence) and all(isinstance(item, str) for item in value):
        return list(value)
    bad = next((item for item in value if not isinstance(item, str)), None) if isinstance(value, Sequence) else value
    raise ATSError(f"{name}: expected a string or a list of strings, got {type(bad).__name__} {bad!r:.80}")


def _check_options(max_new_tokens, options: dict) -> None:
    unknown = sorted(set(options) - set(OPTIONS))
    if unknown:
        raise ATSError(f"generate_calibrated: unsupported option {unknown[0]!r}; supported: {', '.join(OPTIONS)}")
    if int(options.get("num_beams", 1) or 1) > 1:
        raise ATSError("calibrated generation does not support beam search (num_beams > 1); use greedy or sampling")
    for name, value, low in (("max_new_tokens", max_new_tokens, 1),
                             ("num_return_sequences", options.get("num_return_sequences", 1), 1),
                             ("min_new_tokens", options.get("min_new_tokens", 0), 0)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < low):
            raise ATSError(f"{name}: expected an integer >= {low}, got {value!r}")


class _Streamer:
    """The decoder's `on_token` for `stream=`: one `StreamToken` per token with the text its row's tracker releases,
    and a final `done` token per row (`close`)."""

    def __init__(self, rows: list[Row], callback: Callable[[StreamToken], None]) -> None:
        self.index = {id(row): i for i, row in enumerate(rows)}
        self.rows, self.callback = rows, callback
        self.sent = [0] * len(rows)  # tokens streamed per row

    def __call__(self, row: Row) -> None:
        i = self.index[id(row)]
        if len(row.records) <= self.sent[i]:  # a stop string cut the row: its rest of text goes with `close`
            return
        text, _ = row.tracker.release(final=row.finish is not None)
        self.sent[i] = len(row.records)
        record = row.records[-1]
        self.callback(StreamToken(i, len(row.records) - 1, record.token, text,
                                  math.exp(record.logprob), math.exp(record.uncalibrated),
                                  float("nan") if record.tau is None else record.tau))

    def close(self) -> None:
        """Send every row a final `done` token (token_id -1, no text, NaN probabilities)."""
        for i, row in enumerate(self.rows):
            text, _ = row.tracker.release(final=True)
            self.callback(StreamToken(i, len(row.records), -1, text, float("nan"), float("nan"), float("nan"),
                                      done=True))


def _output(tok, row: Row, prompt: str, text_in: str, kind: str) -> CalibratedGeneration:
    """One row's result: its tokens (cut after end-of-sequence or before a stop string) and their values."""
    recs = row.records
    return CalibratedGeneration(prompt=prompt, prompt_text=text_in, text=row.tracker.text,
                                token_ids=[r.token for r in recs], tokens=[tok.decode([r.token]) for r in recs],
                                confidences=[math.exp(r.logprob) for r in recs],
                                uncalibrated=[math.exp(r.uncalibrated) for r in recs],
                                taus=[float("nan") if r.tau is None else r.tau for r in recs],
                                finish_reason=row.finish or "length", answer_confidence=_nan(answer_confidence(recs)),
                                uncalibrated_answer_confidence=_nan(answer_confidence(recs, uncalibrated=True)),
                                confidence_kind=kind)


def _nan(x: float | None) -> float:
    return float("nan") if x is None else x
