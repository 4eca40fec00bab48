"""Response bodies and stream chunks in OpenAI's format, from the engine's events, with ATS's extension field.

Every choice carries `"ats"`: `answer_confidence` (the answer's confidence exactly as `ats eval`'s generative tasks
compute it: the mean of its tokens' confidences, the end-of-sequence token left out, each token's calibrated
probability through the calibrator's binning map when it has one), `confidence_kind` ("probability" or "mapped") and
`calibrator` (its name); `mean_confidence` and `product_confidence` (the mean and the product of the calibrated
probabilities of its generated tokens, the end-of-sequence token included when there is one, as
`CalibratedGeneration` counts them), `mean_uncalibrated` and `product_uncalibrated` (the same for the model's own
probabilities), and per generated token `confidence`, `uncalibrated_logprobs`, `tau` (null for calibrators
without one) and `token_ids` (what the playground rescores under another calibrator). Echoed prompts add
`prompt_uncalibrated_logprobs` and `prompt_tau`. In a stream each chunk carries the
per-token lists of its own tokens, and the chunk that finishes a choice adds the sequence figures.
"""

from __future__ import annotations

import copy
import math
import time
import uuid
from dataclasses import dataclass, field

from ..evaluation.threshold import CertifiedThreshold
from ..generation.logprobs import TokenLogprob, answer_confidence
from .engine import Generated, PromptScored
from .monitor import DecisionMonitor


@dataclass
class Choice:
    """One choice being assembled: its generated text, tokens and finish reason."""

    text: str = ""
    tokens: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None


class Collector:
    """The choices of one request, assembled from its events; `prompts[p]` holds the scored prompt p (echo).

    Args:
        prompts: the request's number of prompts.
        n: choices per prompt (choice index = prompt * n + replica).
    """

    def __init__(self, prompts: int, n: int) -> None:
        self.n = n
        self.choices = [Choice() for _ in range(prompts * n)]
        self.prompts: list[list[TokenLogprob] | None] = [None] * prompts

    def add(self, event) -> None:
        """Take one engine event: a `PromptScored` or `Generated` (others are ignored)."""
        if isinstance(event, PromptScored):
            self.prompts[event.prompt] = event.tokens
        elif isinstance(event, Generated):
            choice = self.choices[event.choice]
            choice.text += event.text
            choice.tokens += event.tokens
            choice.finish_reason = event.finish_reason or choice.finish_reason

    @property
    def completion_tokens(self) -> int:
        """The number of generated tokens over all choices."""
        return sum(len(c.tokens) for c in self.choices)


def _finite(x: float | None) -> float | None:
    return x if x is not None and math.isfinite(x) else None


def summary(tokens: list[TokenLogprob], info: dict | None = None,
            threshold: CertifiedThreshold | None = None) -> dict:
    """The sequence figures of a choice's generated tokens (None when it has none), and with a certified
    `threshold` the decision: answer (answer_confidence >= threshold) or abstain.

    Args:
        tokens: the choice's generated tokens.
        info: the served calibrator's {"calibrator", "confidence_kind"}, copied in.
        threshold: the calibrator's certified threshold (`ats certify`), or None.

    Returns:
        {"answer_confidence", "mean_confidence", "product_confidence", "mean_uncalibrated", "product_uncalibrated"}
        and `info`; with `threshold` also {"answered", "threshold", "target_risk", "delta"}; a value that is not
        finite is None.
    """
    info = dict(info or {})
    if not tokens:
        out = {"answer_confidence": None, "mean_confidence": None, "product_confidence": None,
               "mean_uncalibrated": None, "product_uncalibrated": None, **info}
    else:
        q = [t.logprob for t in tokens]
        z = [t.uncalibrated for t in tokens]
        out = {**info, "answer_confidence": _finite(answer_confidence(tokens)),
               "mean_confidence": _finite(sum(math.exp(x) for x in q) / len(q)),
               "product_confidence": _finite(math.exp(sum(q))),
               "mean_uncalibrated": _finite(sum(math.exp(x) for x in z) / len(z)),
               "product_uncalibrated": _finite(math.exp(sum(z)))}
    if threshold is not None:
        out.update(threshold.decide(out["answer_confidence"]))
    return out


def extension(tokens: list[TokenLogprob], *, prompt: list[TokenLogprob] | None = None) -> dict:
    """The `ats` field's per-token lists: confidences, uncalibrated log-probabilities, taus and ids of `tokens` (the
    tokens this body or chunk carries), and of the scored `prompt` tokens (echo) when given. A choice's finishing
    body or chunk adds the sequence figures (`Renderer.decision`)."""
    out = {"confidence": [t.confidence for t in tokens], "uncalibrated_logprobs": [t.uncalibrated for t in tokens],
           "tau": [t.tau for t in tokens], "token_ids": [t.token for t in tokens]}
    if prompt is not None:
        out.update(prompt_uncalibrated_logprobs=[t.uncalibrated for t in prompt], prompt_tau=[t.tau for t in prompt])
    return out


class Renderer:
    """OpenAI JSON for one served model: token strings (cached), ids, timestamps.

    Args:
        tokenizer: decodes token ids.
        model_name: the model name in every body.
        info: the served calibrator's {"calibrator", "confidence_kind"}, copied into every sequence summary.
        threshold: the calibrator's certified answer-or-abstain threshold, decided in every sequence summary.
        monitor: counts every decision rendered (`DecisionMonitor`), or None.
    """

    def __init__(self, tokenizer, model_name: str, info: dict | None = None,
                 threshold: CertifiedThreshold | None = None, monitor: DecisionMonitor | None = None) -> None:
        self.tokenizer, self.model_name, self.info = tokenizer, model_name, dict(info or {})
        self.threshold, self.monitor = threshold, monitor
        self._strings: dict[int, str] = {}

    def with_info(self, extra: dict) -> "Renderer":
        """This renderer with `extra` (a request's own fields, e.g. its word on the certified format) added to what
        every sequence summary copies; the token cache is shared."""
        if not extra:
            return self
        other = copy.copy(self)
        other.info = {**self.info, **extra}
        return other

    def decision(self, tokens: list[TokenLogprob]) -> dict:
        """The sequence figures of a finished choice's generated tokens (`summary`), with the decision when a
        threshold is served, counted by the monitor: every body and stream sends a choice's decision through here."""
        out = summary(tokens, self.info, self.threshold)
        if self.monitor is not None:
            self.monitor.record(out)
        return out

    def token(self, token_id: int) -> str:
        """The text of one token, decoded on its own (cached)."""
        text = self._strings.get(token_id)
        if text is None:
            text = self._strings[token_id] = self.tokenizer.decode([token_id])
        return text

    def envelope(self, prefix: str, obj: str) -> dict:
        """{"id": a fresh `prefix`-id, "object": `obj`, "created", "model"}: the fields every body starts with."""
        return {"id": f"{prefix}-{uuid.uuid4().hex}", "object": obj, "created": int(time.time()),
                "model": self.model_name}

    # --- logprobs ---------------------------------------------------------------------------------------------------
    def _entry(self, token_id: int, logprob: float) -> dict:
        text = self.token(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    def chat_logprobs(self, tokens: list[TokenLogprob]) -> dict:
        """The chat API's `logprobs` ({"content": [...]}) of `tokens`, each with its `top_logprobs`."""
        return {"content": [{**self._entry(t.token, t.logprob), "top_logprobs": [self._entry(i, lp) for i, lp in t.top]}
                            for t in tokens]}

    def legacy_logprobs(self, tokens: list[TokenLogprob], offsets: list[int]) -> dict:
        """The completions API's `logprobs` of `tokens` at character offsets `offsets`.

        Returns:
            {"tokens", "token_logprobs", "top_logprobs" (the top tokens and the chosen one; None where the logprob is
            None, a prompt's first token), "text_offset"}.
        """
        tops = []
        for t in tokens:
            if t.logprob is None:
                tops.append(None)
                continue
            top = {self.token(i): lp for i, lp in t.top}
            top.setdefault(self.token(t.token), t.logprob)
            tops.append(top)
        return {"tokens": [self.token(t.token) for t in tokens], "token_logprobs": [t.logprob for t in tokens],
                "top_logprobs": tops, "text_offset": offsets}

    def prompt_offsets(self, ids: list[int]) -> list[int]:
        """Character offset of each prompt token (`ids`) in the decoded prompt."""
        prefixes = self.tokenizer.batch_decode([ids[:i] for i in range(len(ids))])
        return [len(p) for p in prefixes]

    # --- bodies -----------------------------------------------------------------------------------------------------
    def usage(self, prompt_tokens: int, completion_tokens: int) -> dict:
        """OpenAI's `usage` object from the two counts."""
        return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens}

    def chat(self, collected: Collector, *, logprobs: bool, prompt_tokens: int) -> dict:
        """The `chat.completion` body of a finished request (`logprobs`: include them; `prompt_tokens`: for usage)."""
        choices = [{"index": i, "message": {"role": "assistant", "content": c.text},
                    "logprobs": self.chat_logprobs(c.tokens) if logprobs else None,
                    "finish_reason": c.finish_reason, "ats": {**extension(c.tokens), **self.decision(c.tokens)}}
                   for i, c in enumerate(collected.choices)]
        return {**self.envelope("chatcmpl", "chat.completion"), "choices": choices,
                "usage": self.usage(prompt_tokens, collected.completion_tokens)}

    def chat_chunk(self, envelope: dict, index: int, *, delta: dict, tokens: list[TokenLogprob] | None = None,
                   logprobs: bool = False, finish_reason: str | None = None, all_tokens=None) -> dict:
        """One `chat.completion.chunk` with one choice.

        Args:
            envelope: the stream's shared envelope (same id in every chunk).
            index: the choice's index.
            delta: the message delta.
            tokens: the tokens this chunk carries.
            logprobs: include their logprobs.
            finish_reason: set on the choice's last chunk.
            all_tokens: all of the choice's tokens, for the sequence figures of its last chunk.

        Returns:
            The chunk's dict; an `ats` field when it carries tokens or `all_tokens` is given.
        """
        tokens = tokens or []
        choice = {"index": index, "delta": delta, "logprobs": self.chat_logprobs(tokens) if logprobs else None,
                  "finish_reason": finish_reason}
        if all_tokens is not None or tokens:
            choice["ats"] = extension(tokens)
            if finish_reason is not None:
                choice["ats"].update(self.decision(all_tokens or []))
        return {**envelope, "choices": [choice]}

    def completion_choice(self, index: int, text: str, tokens: list[TokenLogprob], offsets: list[int], *,
                          logprobs: bool, finish_reason: str | None, ats: dict) -> dict:
        """One choice of a `text_completion` body; `logprobs` includes `legacy_logprobs(tokens, offsets)`."""
        return {"index": index, "text": text, "logprobs": self.legacy_logprobs(tokens, offsets) if logprobs else None,
                "finish_reason": finish_reason, "ats": ats}

    def completion(self, collected: Collector, *, prompts: list[tuple[str, list[int]]], echo: bool, logprobs: bool,
                   prompt_offsets: list[list[int]] | None) -> dict:
        """The `text_completion` body of a finished request.

        Args:
            collected: the request's choices.
            prompts: (text, ids) of each prompt.
            echo: prepend each prompt (and, with logprobs, its scored tokens).
            logprobs: include the logprobs.
            prompt_offsets: each prompt's token offsets (echo with logprobs), else None.

        Returns:
            The body's dict.
        """
        choices = []
        for i, c in enumerate(collected.choices):
            p = i // collected.n
            text, tokens, offsets = c.text, c.tokens, [t.offset for t in c.tokens]
            scored = collected.prompts[p] if echo else None
            if echo:
                base = len(prompts[p][0])
                text = prompts[p][0] + text
                offsets = [o + base for o in offsets]
                if scored is not None:
                    tokens, offsets = scored + tokens, prompt_offsets[p] + offsets
            choices.append(self.completion_choice(i, text, tokens, offsets, logprobs=logprobs,
                                                  finish_reason=c.finish_reason,
                                                  ats={**extension(c.tokens, prompt=scored),
                                                       **self.decision(c.tokens)}))
        prompt_tokens = sum(len(ids) for _, ids in prompts)
        return {**self.envelope("cmpl", "text_completion"), "choices": choices,
                "usage": self.usage(prompt_tokens, collected.completion_tokens)}
