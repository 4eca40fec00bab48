"""Request bodies of the OpenAI-compatible API (pydantic), validated field by field.

A field out of range fails validation and the server answers 400 in OpenAI's error format, naming the field.
Unknown fields are ignored (clients send options such as `user`); options the server cannot honour
(`frequency_penalty`, `presence_penalty`, `logit_bias`, `best_of`, `suffix`, tools) are refused unless they are at
their neutral value. Extensions beyond OpenAI's fields: `ignore_eos` (as in vLLM: keep generating after the
end-of-sequence token, for fixed-length benchmarks).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr, field_validator, model_validator

MAX_TOP_LOGPROBS = 20
MAX_N = 64
MAX_STOP = 16


class StreamOptions(BaseModel):
    """OpenAI's `stream_options`: `include_usage` adds a last chunk with the usage."""

    include_usage: bool = False


class GenerationRequest(BaseModel):
    """Fields shared by chat and legacy completions."""

    model_config = ConfigDict(extra="ignore")

    model: str
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, ge=0, le=1)
    n: int = Field(1, ge=1, le=MAX_N)
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict | None = None

    @field_validator("stop")
    @classmethod
    def _stop(cls, value):
        stops = [value] if isinstance(value, str) else list(value or [])
        if len(stops) > MAX_STOP:
            raise ValueError(f"at most {MAX_STOP} stop strings, got {len(stops)}")
        return [s for s in stops if s]

    @model_validator(mode="after")
    def _unsupported(self):
        for name in ("frequency_penalty", "presence_penalty"):
            if getattr(self, name):
                raise ValueError(f"{name} is not supported by this server (use 0)")
        if self.logit_bias:
            raise ValueError("logit_bias is not supported by this server")
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        return self

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
    """The body of POST /v1/chat/completions (tools refused; top_logprobs needs logprobs)."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list | None = None

    @model_validator(mode="after")
    def _chat(self):
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs to be true")
        if self.tools:
            raise ValueError("tools are not supported by this server")
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


class TokenizeRequest(BaseModel):
    """vLLM's /tokenize: a `prompt` or chat `messages` (the chat template applied)."""

    model_config = ConfigDict(extra="ignore")

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


class DetokenizeRequest(BaseModel):
    """vLLM's /detokenize: token ids to text."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    tokens: list[StrictInt]
