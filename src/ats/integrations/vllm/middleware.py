"""`ats serve --engine vllm`'s layer inside vLLM's own OpenAI server (its `--middleware` option): the answer-or-abstain
decision in each response, the request checks `ats serve` makes that vLLM does not, and the playground page.

    POST /v1/chat/completions, /v1/completions (plain and streamed)
      request : a chat message whose role `ats serve` refuses (not system, developer, user or assistant), or text
                that is not valid Unicode -> 400 in OpenAI's error format, as `ats serve` answers it (vLLM would
                accept the first and generate, and fail on the second in its tokenizer);
                logprobs asked for when the client did not (the decision reads them)
      response: each choice gets `"ats"`: {"answer_confidence"} and, when the export carries a certified threshold,
                {"answered", "threshold", "target_risk", "delta", "certified_format", "outside_certificate"}:
                `ats serve`'s decision fields, by the same rules (`abstain.AnswerDecider`: the mean calibrated
                probability of the answer's tokens, the end-of-sequence token that ended it left out; whether the
                request is made as the certified answers were, `Certificate.format_fields`). A stream carries it
                where `ats serve`'s does: on the choice of the chunk that finishes it (its tokens gathered over the
                chunks). Logprobs the client did not ask for are removed, from every chunk of a stream too.
    GET  /, /static/*   the playground page (`ats.serving.playground`'s files: one page for both servers), open
    GET  /v1/playground what the page shows here (`page.playground_info`), with the API key
    GET  /v1/ats/monitor the served certificate's decisions, counted (`ats.serving.monitor`), with the API key; the
                        same counts join vLLM's own Prometheus metrics at its GET /metrics

At shutdown, as on `ats serve`: while vLLM drains its engine, /health and each new POST get the 503 of a server
shutting down (vLLM answers 200 and 500: `shutdown.engine_shutting_down`); a request still running when the engine
stops ends with `ats serve`'s shutdown error if vLLM leaves it unanswered (`shutdown.until_engine_stops`); an answer
vLLM cut short (finish_reason "abort") is outside the certified format (`abstain.finished_fields`).

Every request with the API key has its body limited as on `ats serve` (`serving.body_limit`: a 413 over
$ATS_MAX_REQUEST_BYTES, 16 MiB unless `--max-request-bytes` says; vLLM sets no limit).

Completions that echo the prompt (their logprobs start with the prompt's) pass through unchanged. The export comes
from $ATS_VLLM_EXPORT and the served model's name from $ATS_VLLM_MODEL_NAME, which `ats serve --engine vllm` sets. A
plain ASGI middleware: vLLM adds it outside its own, so requests without the server's API key ($VLLM_API_KEY) pass
through untouched to vLLM's 401 (the page's info route answers that 401 itself, in OpenAI's format).
"""

from __future__ import annotations

import hmac
import json
import os
from pathlib import Path

from pydantic import ConfigDict, ValidationError, create_model

from ...serving.api_errors import MAX_REQUEST_BYTES, SHUTTING_DOWN_MESSAGE, APIError, shutdown_error, validation_error
from ...serving.body_limit import BodyLimit
from ...serving.monitor import MONITOR_PATH, DecisionMonitor, report_in_default_registry
from ...serving.request_options import steering_option
from ...serving.schemas import UNICODE_ERROR, ChatMessage, lone_surrogate
from .abstain import finished_fields
from .shutdown import SentTracker, engine_client, engine_shutting_down, until_engine_stops
from .stream import StreamDecisions, StreamRewriter

EXPORT_ENV = "ATS_VLLM_EXPORT"  # the export whose threshold and end tokens decide (set by `ats serve --engine vllm`)
MODEL_NAME_ENV = "ATS_VLLM_MODEL_NAME"  # the model id clients send (--served-model-name), for the page
MAX_REQUEST_BYTES_ENV = "ATS_MAX_REQUEST_BYTES"  # the largest request body (--max-request-bytes; `body_limit`)
ROUTES = {"/v1/chat/completions": "chat", "/v1/completions": "completion"}
_ROLE = create_model("MessageRole", __config__=ConfigDict(extra="ignore"),
                     role=(ChatMessage.model_fields["role"].annotation, ...))  # `ats serve`'s roles, its schema's


def request_error(body: dict, kind: str) -> APIError | None:
    """The 400 `ats serve` gives a request that vLLM would take, or None: text that is not valid Unicode (a lone
    surrogate, which vLLM's tokenizer fails on), or a chat message without a role `ats serve` accepts (vLLM would
    generate for it). The messages are ats serve's own, from its schemas."""
    bad = lone_surrogate(body)
    if bad is not None:
        path, index, char = bad
        return APIError(400, UNICODE_ERROR.format(param=path, char=ascii(char), index=index), param=path)
    messages = body.get("messages")
    if kind != "chat" or not isinstance(messages, list):
        return None
    for i, message in enumerate(messages):
        try:
            _ROLE.model_validate(message)
        except ValidationError as err:
            return validation_error([{**e, "loc": ("messages", i, *e["loc"])} for e in err.errors()])
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


def vllm_defaults(export: Path | None) -> dict:
    """The sampling defaults vLLM's server applies to a request that leaves them out: the export's generation
    config's (vLLM's `--generation-config auto`), else vLLM's own (temperature 1)."""
    config = {}
    path = None if export is None else export / "generation_config.json"
    if path is not None and path.is_file():
        config = json.loads(path.read_text())
    return {"temperature": config.get("temperature", 1.0), "max_tokens": config.get("max_new_tokens")}


def request_format(body: dict, kind: str, defaults: dict) -> dict:
    """How vLLM makes the answers of request `body` (`Certificate.outside`'s arguments): its new-token limit (None:
    up to the context; completions: 16 by default), through the chat template or not, sampled or greedy, cut by stop
    strings or tokens, run past end-of-sequence, steered by an option (`request_options.steering_option`)."""
    max_tokens = body.get("max_completion_tokens") or body.get("max_tokens") or defaults.get("max_tokens")
    if max_tokens is None and kind == "completion":
        max_tokens = 16  # vLLM's default for completions, as OpenAI's
    temperature = body.get("temperature")
    temperature = defaults.get("temperature", 1.0) if temperature is None else temperature
    greedy = isinstance(temperature, (int, float)) and temperature == 0  # a bad value: vLLM's own 400 follows
    template = (kind == "chat" and not body.get("chat_template") and body.get("add_generation_prompt", True)
                and not body.get("continue_final_message"))
    return {"max_tokens": max_tokens, "chat_template": bool(template), "sampled": not greedy,
            "stops": bool(body.get("stop")) or bool(body.get("stop_token_ids")),
            "ignore_eos": bool(body.get("ignore_eos")), "steered": steering_option(body)}


def add_decisions(response: dict, decider, strip_logprobs: bool, fields: dict | None = None,
                  monitor: DecisionMonitor | None = None) -> dict:
    """Put each choice's `ats` field (`AnswerDecider.decide`, and the request's word on the certified format
    `fields`) in a response body, counted by `monitor`; drop logprobs nobody asked for. A body that is not a JSON
    object (vLLM answers `null` to a request whose engine stopped) is left as it is."""
    if not isinstance(response, dict):
        return response
    for choice in response.get("choices", []):
        if choice.get("logprobs") is not None:
            choice["ats"] = {**decider.decide(choice), **finished_fields(fields or {}, choice.get("finish_reason"))}
            if monitor is not None:
                monitor.record(choice["ats"])
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
        self.export = Path(os.environ[EXPORT_ENV]) if os.environ.get(EXPORT_ENV) else None
        if decider is None and self.export is not None:
            from .abstain import AnswerDecider

            decider = AnswerDecider.from_export(self.export)
        self.decider = decider
        threshold = getattr(decider, "threshold", None)
        certificate = getattr(decider, "certificate", None)
        self.monitor = None if threshold is None else DecisionMonitor(threshold, getattr(certificate, "path", None))
        report_in_default_registry(self.monitor)  # vLLM's /metrics
        self.defaults = vllm_defaults(self.export)
        self.key = os.environ.get("VLLM_API_KEY") or None
        self.limited = BodyLimit(self.handle, int(os.environ.get(MAX_REQUEST_BYTES_ENV) or MAX_REQUEST_BYTES))

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and not self._authorized(scope):
            await self.handle(scope, receive, send)  # vLLM's 401 (or the page's), whatever the body's size
            return
        await self.limited(scope, receive, send)

    async def handle(self, scope, receive, send) -> None:
        """Every request, its body within the limit (`__call__`; the module docstring says what is done)."""
        if scope["type"] == "http" and (refusal := self._while_draining(scope)) is not None:
            await refusal.response()(scope, receive, send)
            return
        if scope["type"] == "http" and scope.get("method") == "GET" and self.export is not None:
            response = self._page(scope)
            if response is not None:
                await response(scope, receive, send)
                return
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
        if (error := request_error(body, kind)) is not None:
            await error.response()(scope, _replay(b"", receive), send)
            return
        tracker = SentTracker(send)  # what the client got, for a request that vLLM's shutdown leaves unanswered
        if body.get("echo") or self.decider is None:
            await until_engine_stops(self.app, scope, _replay(raw, receive), tracker, tracker)
            return
        fields = self._format_fields(body, kind)
        strip = ask_for_logprobs(body, kind)
        raw = json.dumps(body).encode()
        scope = {**scope, "headers": _with_length(scope["headers"], len(raw))}
        if body.get("stream"):
            send = StreamRewriter(tracker, StreamDecisions(self.decider, strip, fields, self.monitor).edit)
        else:
            send = _Rewriter(tracker, lambda r: add_decisions(r, self.decider, strip, fields, self.monitor))
        await until_engine_stops(self.app, scope, _replay(raw, receive), send, tracker)

    def _while_draining(self, scope) -> APIError | None:
        """`ats serve`'s 503 for what vLLM's drain at shutdown would get wrong (`shutdown.engine_shutting_down`):
        /health, which vLLM answers 200 until its engine stops, and a new POST with the API key, which vLLM answers
        500; None for any other request, or while the engine is not shutting down."""
        engine = engine_client(scope)
        if engine is None or not engine_shutting_down(engine):
            return None
        if scope.get("path") == "/health":
            return shutdown_error("the server is shutting down")
        if scope.get("method") == "POST" and self._authorized(scope):
            return shutdown_error(SHUTTING_DOWN_MESSAGE)
        return None

    def _format_fields(self, body: dict, kind: str) -> dict:
        """The request's word on the certified format (`Certificate.format_fields`), {} without a certificate."""
        certificate = getattr(self.decider, "certificate", None)
        return {} if certificate is None else certificate.format_fields(**request_format(body, kind, self.defaults))

    def _page(self, scope):
        """The playground's response to a GET, or None for a path that is not the page's."""
        from starlette.responses import HTMLResponse, JSONResponse, Response

        from ...serving.playground import STATIC, page_file

        path = scope.get("path", "")
        if path == "/":
            return HTMLResponse(page_file("index.html"), headers={"Cache-Control": "no-cache"})
        name = path.removeprefix("/static/")
        if path.startswith("/static/") and name in STATIC:
            return Response(page_file(name), media_type=STATIC[name], headers={"Cache-Control": "no-cache"})
        if path not in ("/v1/playground", MONITOR_PATH):
            return None
        if not self._authorized(scope):
            return APIError(401, "incorrect or missing API key: send the header 'Authorization: Bearer KEY'",
                            code="invalid_api_key").response()
        if path == MONITOR_PATH:
            if self.monitor is None:
                return APIError(404, f"{self.export}: no certified threshold is served, so no decisions are counted "
                                     f"(ats certify, then ats export --engine vllm)", code="not_found").response()
            return JSONResponse(self.monitor.report())
        from .page import playground_info

        name = os.environ.get(MODEL_NAME_ENV) or str(self.export)  # vLLM's default served name: the --model path
        return JSONResponse(playground_info(self.export, name, self.decider))

    def _authorized(self, scope) -> bool:
        """Whether the request carries the server's API key (or the server has none)."""
        if self.key is None:
            return True
        headers = dict(scope.get("headers", []))
        return hmac.compare_digest(headers.get(b"authorization", b""), f"Bearer {self.key}".encode())


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
