"""Request bodies of the OpenAI-compatible API (pydantic), validated field by field.

A field out of range fails validation and the server answers 400 in OpenAI's error format, naming the field. Text
must be valid Unicode (JSON can carry a lone surrogate, which no tokenizer takes). Unknown fields are ignored (clients
send options such as `user`); options the server cannot honour are refused unless they are at their neutral value:
those that steer an answer's tokens (`request_options.STEERING`: penalties, `logit_bias`, `response_format`, tools,
vLLM's guided decoding, ...) and the other OpenAI and vLLM options below (`UNHONOURED`, `CHAT_UNHONOURED`).
Extensions beyond OpenAI's fields, as vLLM has them: `ignore_eos` (keep generating after the end-of-sequence token,
for fixed-length benchmarks), `top_k` (-1 or 0: all tokens) and `min_tokens` (no end-of-sequence before that many).
"""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr, field_validator, model_validator
from pydantic_core import PydanticCustomError

from ..generation.sampling import SEED_MAX, SEED_MIN
from .request_options import EMPTY, STEERING, ZERO, Neutral

MAX_TOP_LOGPROBS = 20
MAX_N = 64
MAX_STOP = 16
HONOURED = frozenset({"min_tokens"})  # the STEERING options this server does honour (fields below)
FALSE = Neutral(lambda value: value is None or value is False, "false")
AUTO = Neutral(lambda value: value in (None, "none", "auto"), '"none" or "auto"')
UNHONOURED: dict[str, Neutral] = {  # beyond STEERING, on both routes (vLLM's extensions)
    "min_p": ZERO, "use_beam_search": FALSE, "include_stop_str_in_output": FALSE, "stop_token_ids": EMPTY,
    "truncate_prompt_tokens": EMPTY, "prompt_logprobs": EMPTY,
}
CHAT_UNHONOURED: dict[str, Neutral] = {  # beyond those, on chat (OpenAI's and vLLM's chat options)
    "tool_choice": AUTO, "function_call": AUTO, "modalities": Neutral(lambda value: value in (None, ["text"]),
                                                                      '["text"]'),
    "audio": EMPTY, "echo": FALSE, "add_generation_prompt": Neutral(lambda value: value in (None, True), "true"),
    "continue_final_message": FALSE, "chat_template": EMPTY, "chat_template_kwargs": EMPTY, "documents": EMPTY,
}


UNICODE_ERROR = "{param}: not valid Unicode text (a lone surrogate {char} at character {index})"


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def lone_surrogate(value, path: str = "") -> tuple[str, int, str] | None:
    """(field path, index, character) of the first lone surrogate in the strings of `value` (a parsed JSON body),
    or None. Both servers refuse such text (`UNICODE_ERROR`): JSON's escapes can carry it, no tokenizer takes it."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as err:
            return path, err.start, value[err.start]
        return None
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        found = lone_surrogate(item, f"{path}.{key}" if path else str(key))
        if found is not None:
            return found
    return None


class APIRequest(BaseModel):
    """A request body: unknown fields ignored, every string valid Unicode, no option in `unhonoured` away from its
    neutral value (each refused with a 400 naming it, `api_errors.validation_error`)."""

    model_config = ConfigDict(extra="ignore")
    unhonoured: ClassVar[dict[str, Neutral]] = {}

    @model_validator(mode="before")
    @classmethod
    def _checked(cls, data):
        if not isinstance(data, dict):
            return data
        bad = lone_surrogate(data)
        if bad is not None:
            path, index, char = bad
            raise PydanticCustomError("invalid_unicode", UNICODE_ERROR, {"param": path, "char": ascii(char),
                                                                        "index": index})
        for name, neutral in cls.unhonoured.items():
            if name in data and not neutral.test(data[name]):
                raise PydanticCustomError("unsupported_option", "{param}: not supported by this server; leave it "
                                          "out or send {neutral} (got {value})",
                                          {"param": name, "neutral": neutral.says, "value": _short(data[name])})
        return data


class StreamOptions(BaseModel):
    """OpenAI's `stream_options`: `include_usage` adds a last chunk with the usage."""

    include_usage: bool = False


class GenerationRequest(APIRequest):
    """Fields shared by chat and legacy completions."""

    unhonoured: ClassVar[dict[str, Neutral]] = {
        **{name: neutral for name, neutral in STEERING.items() if name not in HONOURED}, **UNHONOURED}

    model: str
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, ge=0, le=1)
    top_k: int | None = Field(None, ge=-1)
    min_tokens: int = Field(0, ge=0)
    n: int = Field(1, ge=1, le=MAX_N)
    seed: int | None = Field(None, ge=SEED_MIN, le=SEED_MAX)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False

    @field_validator("stop")
    @classmethod
    def _stop(cls, value):
        stops = [value] if isinstance(value, str) else list(value or [])
        if len(stops) > MAX_STOP:
            raise ValueError(f"at most {MAX_STOP} stop strings, got {len(stops)}")
        return [s for s in stops if s]

    @model_validator(mode="after")
    def _consistent(self):
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        return self

    def check_min_tokens(self, max_tokens: int | None) -> None:
        """Refuse `min_tokens` above the request's new-token limit (None: none given), as vLLM does."""
        if max_tokens is not None and self.min_tokens > max_tokens:
            raise PydanticCustomError("min_tokens", "{param}: {min_tokens} is more than max_tokens ({max_tokens})",
                                      {"param": "min_tokens", "min_tokens": self.min_tokens,
                                       "max_tokens": max_tokens})

    @property
    def stops(self) -> list[str]:
        """The non-empty stop strings (a single string becomes one)."""
        return list(self.stop or [])

    @property
    def include_usage(self) -> bool:
        """Whether a stream ends with a usage chunk."""
        return bool(self.stream_options and self.stream_options.include_usage)


class TextPart(BaseModel):
    """A text part of a message's content (the only kind accepted)."""

    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    """One chat message: a role and text content (a string or text parts)."""

    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart] | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _text_only(cls, value):
        if isinstance(value, list):
            for part in value:
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                if kind != "text":
                    raise ValueError(f"only text content is supported (a string or parts of type 'text'), got a "
                                     f"part of type {kind!r}")
        elif value is not None and not isinstance(value, str):
            raise ValueError(f"expected a string or a list of text parts, got {type(value).__name__}")
        return value

    @property
    def text(self) -> str:
        """The content as one string (parts joined; "" for none)."""
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class ChatCompletionRequest(GenerationRequest):
    """The body of POST /v1/chat/completions (top_logprobs needs logprobs)."""

    unhonoured: ClassVar[dict[str, Neutral]] = {**GenerationRequest.unhonoured, **CHAT_UNHONOURED}

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)

    @model_validator(mode="after")
    def _chat(self):
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs to be true")
        self.check_min_tokens(self.new_tokens)
        return self

    @property
    def new_tokens(self) -> int | None:
        """max_completion_tokens, else max_tokens; None: neither given."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


PromptField = StrictStr | list[StrictStr] | list[StrictInt] | list[list[StrictInt]]


class CompletionRequest(GenerationRequest):
    """The body of POST /v1/completions: `prompt` is a string, strings, token ids or lists of token ids."""

    prompt: PromptField
    max_tokens: int | None = Field(16, ge=0)
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    best_of: int | None = Field(None, ge=1)
    suffix: str | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt(cls, value):
        def ints(x) -> bool:
            return isinstance(x, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in x)

        if isinstance(value, list) and (not value or any(isinstance(p, list) and not p for p in value)):
            raise ValueError("a prompt list must not be empty (nor hold an empty list of token ids)")
        if not (isinstance(value, str) or ints(value) or (isinstance(value, list) and (
                all(isinstance(p, str) for p in value) or all(ints(p) for p in value)))):
            raise ValueError("expected a string, a list of strings, a list of token ids or a list of lists of token "
                             "ids")
        return value

    @model_validator(mode="after")
    def _completion(self):
        if self.best_of not in (None, 1) and self.best_of != self.n:
            raise ValueError("best_of is not supported by this server")
        if self.suffix:
            raise ValueError("suffix is not supported by this server")
        self.check_min_tokens(16 if self.max_tokens is None else self.max_tokens)
        return self

    @property
    def prompts(self) -> list[str | list[int]]:
        """The prompt(s): strings or lists of token ids."""
        value = self.prompt
        if isinstance(value, str):
            return [value]
        if value and isinstance(value[0], int):
            return [list(value)]
        return list(value)


class TokenizeRequest(APIRequest):
    """vLLM's /tokenize: a `prompt` or chat `messages` (the chat template applied)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True

    @model_validator(mode="after")
    def _one(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt or messages")
        return self


class DetokenizeRequest(APIRequest):
    """vLLM's /detokenize: token ids to text."""

    model: str | None = None
    tokens: list[StrictInt]
