"""Request options that steer which tokens an answer gets, beyond those a certificate's format already names
(temperature, top_p, stop, max_tokens, ignore_eos): OpenAI's penalties, `logit_bias`, `response_format` and tools, and
vLLM's extensions. One table for both servers: `ats serve` honours `min_tokens` and refuses the others away from
their neutral value (`schemas`); vLLM honours them all; on either, an answer made with one of them steered is outside
a certificate, whose answers were greedy and unsteered (`Certificate.outside`, via `steering_option`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple


class Neutral(NamedTuple):
    """An option's neutral value: `test(value)` says whether a value is it; `says` names it for an error message."""

    test: Callable[[object], bool]
    says: str


def _zero(value) -> bool:
    return value is None or (isinstance(value, (int, float)) and not isinstance(value, bool) and value == 0)


def _one(value) -> bool:
    return value is None or (isinstance(value, (int, float)) and not isinstance(value, bool) and value == 1)


def _empty(value) -> bool:
    return value is None or value == [] or value == {} or value == ""


def _no_bias(value) -> bool:
    return _empty(value) or (isinstance(value, dict) and all(_zero(bias) for bias in value.values()))


def _text_format(value) -> bool:
    return value is None or (isinstance(value, dict) and value.get("type") == "text")


ZERO, ONE, EMPTY = Neutral(_zero, "0"), Neutral(_one, "1"), Neutral(_empty, "none")

STEERING: dict[str, Neutral] = {
    "frequency_penalty": ZERO, "presence_penalty": ZERO, "repetition_penalty": ONE,
    "logit_bias": Neutral(_no_bias, "none (or all biases 0)"), "min_tokens": ZERO,
    "response_format": Neutral(_text_format, '{"type": "text"}'), "tools": EMPTY, "functions": EMPTY,
    "bad_words": EMPTY, "allowed_token_ids": EMPTY, "logits_processors": EMPTY, "structured_outputs": EMPTY,
    "guided_json": EMPTY, "guided_regex": EMPTY, "guided_choice": EMPTY, "guided_grammar": EMPTY,
}


def steering_option(body: dict) -> str | None:
    """The first option in request `body` that steers its answer's tokens (a STEERING option away from its neutral
    value), or None."""
    return next((name for name, neutral in STEERING.items() if name in body and not neutral.test(body[name])), None)
