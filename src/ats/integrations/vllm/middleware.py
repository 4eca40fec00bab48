"""`ats serve --engine vllm`'s layer inside vLLM's own OpenAI server (its `--middleware` option): the answer-or-abstain
decision in each response, and the request checks `ats serve` makes that vLLM does not.

    POST /v1/chat/completions, /v1/completions (not streamed)
      request : a chat message whose role `ats serve` refuses (not system, developer, user or assistant) -> 400 in
                OpenAI's error format, as `ats serve` answers it (vLLM would accept it and generate);
                logprobs asked for when the client did not (the decision reads them)
      response: each choice gets `"ats"`: {"answer_confidence"} and, when the export carries a certified threshold,
                {"answered", "threshold", "target_risk", "delta"}: `ats serve`'s decision fields, by the same rules
                (`abstain.AnswerDecider`: the mean calibrated probability of the answer's tokens, the
                end-of-sequence token that ended it left out); logprobs the client did not ask for are removed.

Streamed responses, and completions that echo the prompt (their logprobs start with the prompt's), pass through
unchanged (a client decides with `AnswerDecider` on the answer's logprobs). The export comes from $ATS_VLLM_EXPORT,
which `ats serve --engine vllm` sets. A plain ASGI middleware: vLLM adds it outside its own, so requests without
the server's API key ($VLLM_API_KEY) pass through untouched to vLLM's 401.
"""

from __future__ import annotations

import json
import os
from typing import get_args

from ...serving.api_errors import APIError
from ...serving.schemas import ChatMessage

EXPORT_ENV = "ATS_VLLM_EXPORT"  # the export whose threshold and end tokens decide (set by `ats serve --engine vllm`)
ROUTES = {"/v1/chat/completions": "chat", "/v1/completions": "completion"}
ROLES = get_args(ChatMessage.model_fields["role"].annotation)  # the roles `ats serve` accepts (its schema's)


def role_error(body: dict) -> APIError | None:
    """The 400 `ats serve` gives a chat request with a message of another role, or None."""
    messages = body.get("messages")
    if not isinstance(messages, list):
        return None
    for i, message in enumerate(messages):
        role = message.get("role") if isinstance(message, dict) else None
        if role not in ROLES:
            allowed = ", ".join(repr(r) for r in ROLES[:-1]) + f" or {ROLES[-1]!r}"
            return APIError(400, f"messages.{i}.role: Input should be {allowed} (got {role!r})",
                            param=f"messages.{i}.role")
    return None


def ask_for_logprobs(body: dict, kind: str) -> bool:
    """Ask for the chosen tokens' logprobs when the request does not (the decision reads them); whether it did."""
    if kind == "chat" and not body.get("logprobs"):
        body["logprobs"] = True
        return True
    if kind == "completion" and body.get("logprobs") is None:
        body["logprobs"] = 0  # the chosen token's logprob only
        return True
    return False


def add_decisions(response: dict, decider, strip_logprobs: bool) -> dict:
    """Put each choice's `ats` field (`AnswerDecider.decide`) in a response body; drop logprobs nobody asked for."""
    for choice in response.get("choices", []):
        if choice.get("logprobs") is not None:
            choice["ats"] = decider.decide(choice)
        if strip_logprobs:
            choice["logprobs"] = None
    return response


class ATSMiddleware:
    """The ASGI middleware (see the module docstring).

    Args:
        app: the ASGI app it wraps (vLLM's).
        decider: the `AnswerDecider` (default: the export in $ATS_VLLM_EXPORT; none: only the request checks).
    """

    def __init__(self, app, decider=None) -> None:
        self.app = app
        if decider is None and os.environ.get(EXPORT_ENV):
            from .abstain import AnswerDecider

            decider = AnswerDecider.from_export(os.environ[EXPORT_ENV])
        self.decider = decider
        self.key = os.environ.get("VLLM_API_KEY") or None

    async def __call__(self, scope, receive, send) -> None:
        kind = ROUTES.get(scope.get("path", "")) if scope["type"] == "http" and scope.get("method") == "POST" else None
        if kind is None or not self._authorized(scope):
            await self.app(scope, receive, send)
            return
        raw = await _read_body(receive)
        try:
            body = json.loads(raw)
        except ValueError:
            body = None
        if not isinstance(body, dict):  # vLLM's own 400 for a body that is not a JSON object
            await self.app(scope, _replay(raw, receive), send)
            return
        if kind == "chat" and (error := role_error(body)) is not None:
            await error.response()(scope, _replay(b"", receive), send)
            return
        if body.get("stream") or body.get("echo") or self.decider is None:
            await self.app(scope, _replay(raw, receive), send)
            return
        strip = ask_for_logprobs(body, kind)
        raw = json.dumps(body).encode()
        scope = {**scope, "headers": _with_length(scope["headers"], len(raw))}
        await self.app(scope, _replay(raw, receive), _Rewriter(send, lambda r: add_decisions(r, self.decider, strip)))

    def _authorized(self, scope) -> bool:
        """Whether the request carries the server's API key (or the server has none)."""
        if self.key is None:
            return True
        headers = dict(scope.get("headers", []))
        return headers.get(b"authorization", b"").decode("latin-1") == f"Bearer {self.key}"


async def _read_body(receive) -> bytes:
    chunks = []
    while True:
        message = await receive()
        chunks.append(message.get("body", b""))
        if not message.get("more_body"):
            return b"".join(chunks)


def _replay(raw: bytes, receive=None):
    """An ASGI `receive` that gives `raw` as the whole body, then what the connection's own `receive` gives (a
    disconnect)."""
    sent = False

    async def replay():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": raw, "more_body": False}
        return await receive()

    return replay


def _with_length(headers, length: int) -> list:
    return [(k, v) for k, v in headers if k.lower() != b"content-length"] + [(b"content-length", str(length).encode())]


class _Rewriter:
    """An ASGI `send` that holds a 200 JSON response, rewrites its body with `edit`, and sends it with its new
    length; any other response passes through as it comes."""

    def __init__(self, send, edit) -> None:
        self.send, self.edit = send, edit
        self.start = None
        self.chunks: list[bytes] = []

    async def __call__(self, message) -> None:
        if message["type"] == "http.response.start":
            headers = dict(message.get("headers", []))
            if message["status"] == 200 and headers.get(b"content-type", b"").startswith(b"application/json"):
                self.start = message
                return
        elif message["type"] == "http.response.body" and self.start is not None:
            self.chunks.append(message.get("body", b""))
            if message.get("more_body"):
                return
            body = json.dumps(self.edit(json.loads(b"".join(self.chunks)))).encode()
            await self.send({**self.start, "headers": _with_length(self.start["headers"], len(body))})
            await self.send({"type": "http.response.body", "body": body})
            return
        await self.send(message)
