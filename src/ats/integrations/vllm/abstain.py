"""Answer or abstain on answers vLLM generated: the decision fields of `ats serve`'s `ats` field.

vLLM's OpenAI server returns the calibrated log-probabilities (the export's `compute_logits`) but not ats's `ats`
field. `ats serve --engine vllm` adds it in the server (`middleware.ATSMiddleware` calls this class); clients of a
plain vLLM server on an export make the decision where the response arrives. Both by the same
rules `ats serve` applies: the answer's
confidence is the mean calibrated probability of its tokens, the end-of-sequence token that ended it left out
(`generation.logprobs.answer_confidence`), and the certified threshold the export carries (`ats certify` wrote it
beside the calibrator; `ats export --engine vllm` copies it to OUT/calibrator/threshold.json) decides
(`CertifiedThreshold.decide`).

    decider = AnswerDecider.from_export("exports/smollm2-ats")
    out = client.chat.completions.create(..., logprobs=True)
    decider.decide(out.choices[0])  # {"answer_confidence", "answered", "threshold", "target_risk", "delta"}

Only calibrators that run inside vLLM reach here (scaling methods: `check_engine_calibrator`), so a token's
confidence is its calibrated probability, `exp(logprob)`.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from ...errors import ATSError
from ...evaluation.threshold import Certificate, CertifiedThreshold, read_certificate, template_digest
from ...generation.logprobs import TokenLogprob, answer_confidence
from . import CALIBRATOR_FOLDER
from .export import read_export


def _checked_certificate(folder: Path, tokenizer) -> Certificate | None:
    """The export's certificate (its threshold and the answer format it certifies), checked against the calibrator
    and the backbone the export serves (its record's base model and revision, its tokenizer's chat template); None
    when it carries none.

    Raises:
        ATSError: naming the file and the field, if it was certified for another calibrator or backbone.
    """
    from ...calibrators import load_calibrator

    certificate = read_certificate(folder / CALIBRATOR_FOLDER)
    if certificate is None:
        return None
    record = read_export(folder)
    calibrator = None if record.get("calibrator") is None else load_calibrator(folder / record["calibrator"])
    certificate.check(calibrator=None if calibrator is None else calibrator.digest(),
                      backbone={"base_model": record.get("base_model"), "revision": record.get("revision"),
                                "chat_template": template_digest(tokenizer)})
    return certificate


def _field(item, name: str):
    """`item.name` for the openai client's objects, `item[name]` for JSON dicts."""
    return item[name] if isinstance(item, Mapping) else getattr(item, name)


@dataclass(frozen=True)
class AnswerDecider:
    """Decides whether each generated answer is given, from its calibrated token log-probabilities.

    Args:
        threshold: the certified threshold, or None (then only the confidence is reported).
        end_tokens: the end-of-sequence tokens as a response names them: the token's text and "token_id:N" (vLLM's
            `return_tokens_as_token_ids`).
        certificate: what the threshold certifies (the answer format, `Certificate.format_fields`), or None.
    """

    threshold: CertifiedThreshold | None
    end_tokens: frozenset[str]
    certificate: Certificate | None = None

    @classmethod
    def from_export(cls, folder: str | Path) -> "AnswerDecider":
        """The decider of an `ats export --engine vllm` folder: its calibrator's threshold and its end-of-sequence
        tokens (the generation config's, the model config's and the tokenizer's, as ats's decoder stops on them).

        Raises:
            ATSError: if the folder is not an export, or its threshold record is invalid.
        """
        from transformers import AutoTokenizer

        folder = Path(folder)
        read_export(folder)
        tokenizer = AutoTokenizer.from_pretrained(folder)
        ids: set[int] = set()
        for name in ("generation_config.json", "config.json"):
            path = folder / name
            eos = json.loads(path.read_text()).get("eos_token_id") if path.is_file() else None
            ids.update(int(e) for e in (eos if isinstance(eos, list) else [] if eos is None else [eos]))
        if tokenizer.eos_token_id is not None:
            ids.add(int(tokenizer.eos_token_id))
        names = {f"token_id:{i}" for i in ids} | set(tokenizer.convert_ids_to_tokens(sorted(ids)))
        names |= {tokenizer.decode([i]) for i in ids}
        certificate = _checked_certificate(folder, tokenizer)
        return cls(None if certificate is None else certificate.threshold, frozenset(names), certificate)

    def confidence(self, tokens: Iterable, finish_reason: str | None) -> float | None:
        """The answer's confidence from its tokens' calibrated log-probabilities.

        Args:
            tokens: the response's logprobs entries (`choice.logprobs.content`: objects or dicts with "token" and
                "logprob"), in order.
            finish_reason: the choice's; "stop" with an end-of-sequence token last leaves that token out.

        Returns:
            The mean calibrated probability of the answer tokens, or None without any.
        """
        tokens = list(tokens)
        records = [TokenLogprob(token=i, logprob=float(_field(t, "logprob")), uncalibrated=None, tau=None,
                                confidence=math.exp(float(_field(t, "logprob")))) for i, t in enumerate(tokens)]
        if records and finish_reason == "stop" and _field(tokens[-1], "token") in self.end_tokens:
            records[-1].answer = False
        return answer_confidence(records)

    def decide(self, choice) -> dict:
        """The `ats` fields of one chat or completion choice of vLLM's server.

        Args:
            choice: `response.choices[i]` (openai client object or JSON dict), requested with logprobs.

        Returns:
            {"answer_confidence"} and, with a threshold, {"answered", "threshold", "target_risk", "delta"}.

        Raises:
            ATSError: if the choice carries no log-probabilities (request them: logprobs=True).
        """
        logprobs = _field(choice, "logprobs")
        if logprobs is None:
            raise ATSError("choice.logprobs: missing; request the answer with logprobs=True (chat) or logprobs=1")
        return self.decide_tokens(answer_entries(logprobs), _field(choice, "finish_reason"))

    def decide_tokens(self, tokens: Iterable, finish_reason: str | None) -> dict:
        """`decide` on an answer's logprobs entries in the chat layout (a stream's, gathered over its chunks)."""
        confidence = self.confidence(tokens, finish_reason)
        out = {"answer_confidence": confidence}
        if self.threshold is not None:
            out.update(self.threshold.decide(confidence))
        return out


def _has_tokens(logprobs) -> bool:
    """Whether `logprobs` is the completions API's layout (parallel "tokens" and "token_logprobs" lists)."""
    try:
        _field(logprobs, "token_logprobs")
    except (KeyError, AttributeError):
        return False
    return True


def answer_entries(logprobs) -> list:
    """A choice's (or a stream chunk's) logprobs entries in the chat layout ("token", "logprob"): the chat API's
    `content`, or the completions API's parallel lists made into entries."""
    if not _has_tokens(logprobs):
        return list(_field(logprobs, "content") or [])
    return [{"token": t, "logprob": p} for t, p in zip(_field(logprobs, "tokens"), _field(logprobs, "token_logprobs"))]


CUT_SHORT = "the server cut this answer short (finish_reason 'abort'): not an answer in the certified format"


def finished_fields(fields: dict, finish_reason: str | None) -> dict:
    """The request's word on the certified format (`fields`, `Certificate.format_fields`'s) for one answer that
    finished with `finish_reason`: an answer vLLM cut short ("abort": its engine stopped at shutdown, or an operator
    aborted the request) is outside, whatever the request asked; {} (no certificate) stays {}."""
    if fields and finish_reason == "abort":
        return {**fields, "certified_format": False, "outside_certificate": CUT_SHORT}
    return fields
