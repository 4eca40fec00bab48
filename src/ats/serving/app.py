"""The FastAPI app: OpenAI's REST routes over the batching engine, with calibrated log-probabilities.

    POST /v1/chat/completions   POST /v1/completions   GET /v1/models
    GET /health   POST /tokenize   POST /detokenize   GET /tokenizer_info   (the last three as vLLM's)
    GET /   the playground page, with its routes under /v1/playground (playground.py)

Handlers run on the event loop and never compute there: they validate, tokenize (in a thread), submit a `Job`, wait
for its events (`asyncio.Queue`, filled from the engine thread) and make the response body (in a thread). A client
that disconnects has its job cancelled: a stream's generator is closed by sse-starlette, a plain request is watched
for `http.disconnect`. At shutdown a stream is not cut when the server gets the signal (sse-starlette's default):
it runs as a plain request does, until the engine's drain ends it (`server.py`), and then its last event says so.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import math
import time
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from jinja2 import TemplateError
from sse_starlette import EventSourceResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..errors import ATSError
from ..evaluation.threshold import Certificate, CertifiedThreshold
from ..generation.limits import ContextLengthExceeded
from ..generation.sampling import SamplingParams
from .api_errors import MAX_REQUEST_BYTES, TOO_LARGE, APIError, shutdown_error, validation_error
from .body_limit import BodyLimit
from .engine import Engine, Generated, Job, JobDone, JobFailed, PromptScored, QueueFull, ShuttingDown
from .metrics import ServingMetrics
from .monitor import MONITOR_PATH, DecisionMonitor
from .playground import PAGE_PATHS, Playground, add_playground_routes
from .rescore import ServedCalibrator
from .responses import Collector, Renderer, extension
from .schemas import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    DetokenizeRequest,
    GenerationRequest,
    TokenizeRequest,
)

logger = logging.getLogger(__name__)

OPEN_PATHS = ("/health", "/metrics", *PAGE_PATHS)  # answered without the API key (the page's files hold no data; the
#                                                     metrics are counts, open as vLLM's are, for a scraper)


class _Gone:
    """Put in a run's queue when its client disconnected."""


class Run:
    """A job submitted from the event loop; its events come back through an asyncio queue.

    Args:
        engine: the engine that runs the job.
        job: the job; its sink is set here.
        param: the request field named in a 400 (the prompt's).

    Raises:
        APIError: 503 if the queue is full or the server is shutting down, 400 if the job is refused (e.g. over the
            context length).
    """

    def __init__(self, engine: Engine, job: Job, param: str, metrics: ServingMetrics) -> None:
        self.engine, self.job, self.finished, self.metrics = engine, job, False, metrics
        self.queue: asyncio.Queue = asyncio.Queue()
        loop = asyncio.get_running_loop()
        job.sink = lambda event: loop.call_soon_threadsafe(self.queue.put_nowait, event)
        self.submitted, self.first_tokens = time.monotonic(), True
        try:
            engine.submit(job)
        except QueueFull as err:
            raise APIError(503, f"the server is busy ({err}); try again later", code="overloaded") from None
        except ShuttingDown as err:
            raise shutdown_error(str(err)) from None
        except ContextLengthExceeded as err:
            raise APIError(400, str(err), param=param, code="context_length_exceeded") from None
        except ATSError as err:
            raise APIError(400, str(err), param=param) from None
        metrics.started(sum(len(prompt) for prompt in job.prompts))

    async def events(self):
        """The job's events in order, up to its end.

        Raises:
            APIError: the job's failure (500: the model failed; 503: the server shut down first), 499 if the client
                disconnected.
        """
        while True:
            event = await self.queue.get()
            if isinstance(event, JobDone):
                self._end("finished")
                return
            if isinstance(event, JobFailed):
                if event.status == 503:  # the server's shutdown ended it
                    self._end("shutting_down")
                    raise shutdown_error(event.message)
                self._end("failed")
                raise APIError(event.status, event.message)
            if isinstance(event, _Gone):
                raise APIError(499, "the client closed the request")
            if isinstance(event, Generated):
                first = self.first_tokens and bool(event.tokens)  # the request's first tokens
                self.first_tokens = self.first_tokens and not first
                self.metrics.generated(len(event.tokens), event.finish_reason, first, time.monotonic() - self.submitted)
            yield event

    def cancel(self) -> None:
        """Cancel the job in the engine, unless it has finished."""
        if not self.finished:
            self._end("cancelled")
            self.engine.cancel(self.job)

    def _end(self, outcome: str) -> None:
        """The run has ended with `outcome` (counted once)."""
        if not self.finished:
            self.finished = True
            self.metrics.ended(outcome, time.monotonic() - self.submitted)

    async def collect(self, request: Request, collector: Collector) -> Collector:
        """Wait for every event (cancelling the job if the client disconnects first).

        Args:
            request: the HTTP request, watched for a disconnect.
            collector: receives the events.

        Returns:
            `collector`, filled.
        """
        watcher = asyncio.create_task(self._watch(request))
        try:
            async for event in self.events():
                collector.add(event)
        finally:
            watcher.cancel()
            self.cancel()
        return collector

    async def _watch(self, request: Request) -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass
        self.cancel()
        self.queue.put_nowait(_Gone())


class BearerAuth:
    """ASGI middleware: every path but OPEN_PATHS needs `Authorization: Bearer KEY` (checked before the body is
    read, so a wrong key is a 401 whatever the body).

    Args:
        app: the ASGI app behind it.
        key: the API key.
    """

    def __init__(self, app, key: str) -> None:
        self.app, self.key = app, key.encode()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"] not in OPEN_PATHS:
            headers = dict(scope.get("headers") or [])
            scheme, _, token = headers.get(b"authorization", b"").decode("latin-1").partition(" ")
            if not token:
                error = APIError(401, "missing API key: send the header 'Authorization: Bearer KEY'",
                                 code="invalid_api_key")
            elif scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), self.key):
                error = APIError(401, "incorrect API key provided", code="invalid_api_key")
            else:
                error = None
            if error is not None:
                await error.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _sampling(body: GenerationRequest) -> SamplingParams:
    return SamplingParams(temperature=1.0 if body.temperature is None else body.temperature,
                          top_p=1.0 if body.top_p is None else body.top_p, top_k=max(body.top_k or 0, 0),
                          seed=body.seed)


def _data(obj) -> dict:
    return {"data": json.dumps(obj)}


async def _json(make_body) -> JSONResponse:
    """The JSON response of `make_body()`, made and encoded off the event loop (a request of thousands of prompts
    would hold every other client, streams included, for the time it takes)."""
    return await asyncio.to_thread(lambda: JSONResponse(make_body()))


def _event_stream(events) -> EventSourceResponse:
    """A streamed answer's response: server-sent `events`, kept going at shutdown until they end (the engine's drain
    bounds them), where sse-starlette would cut them when the signal comes."""
    return EventSourceResponse(events, shutdown_grace_period=math.inf)


def _error_data(err: APIError) -> dict:
    """A stream's last event for `err`: OpenAI's error body (the status line went out with the first chunk)."""
    return _data(err.body())


class Service:
    """What the routes share: the engine, the served model's name, the response renderer and the start time, with the
    request checks that several routes make.

    Args:
        engine: the engine serving the requests.
        model_name: the model name the API reports and accepts.
        threshold: the calibrator's certified threshold, or None.
        certificate: what the threshold certifies (the answer format), or None: no word on the format.
    """

    def __init__(self, engine: Engine, model_name: str, threshold: CertifiedThreshold | None = None,
                 certificate: Certificate | None = None) -> None:
        self.engine, self.model_name, self.tok = engine, model_name, engine.tokenizer
        self.certificate = certificate
        source = None if certificate is None else certificate.path
        self.monitor = None if threshold is None else DecisionMonitor(threshold, source)
        self.metrics = ServingMetrics(engine)  # GET /metrics, with the monitor's counts when a threshold is served
        if self.monitor is not None:
            self.metrics.registry.register(self.monitor.collector())
        self.renderer = Renderer(self.tok, model_name, {"calibrator": engine.calibration.label,
                                                        "confidence_kind": engine.calibration.confidence_kind},
                                 threshold, self.monitor)
        self.started = int(time.time())

    def renderer_for(self, body: GenerationRequest, *, chat: bool, max_tokens: int | None) -> Renderer:
        """The renderer of one request: each decision it renders says whether the request is made as the certified
        answers were (`Certificate.format_fields`; `max_tokens` None: up to the context length)."""
        if self.certificate is None:
            return self.renderer
        return self.renderer.with_info(self.certificate.format_fields(
            max_tokens=max_tokens, chat_template=chat, sampled=not _sampling(body).greedy, stops=bool(body.stops),
            ignore_eos=body.ignore_eos, steered="min_tokens" if body.min_tokens else None))

    def check_model(self, name: str) -> None:
        """Refuse a request for another model than the served one.

        Raises:
            APIError: 404 naming `name` and the served model.
        """
        if name != self.model_name:
            raise APIError(404, f"the model '{name}' does not exist; this server serves '{self.model_name}'",
                           param="model", code="model_not_found")

    def chat_ids(self, messages: list[ChatMessage], add_generation_prompt: bool = True) -> list[int]:
        """The token ids of `messages` through the model's chat template.

        Raises:
            APIError: 400 if the model has no chat template or the template refuses the messages.
        """
        tok = self.tok
        if not getattr(tok, "chat_template", None):
            raise APIError(400, "this model has no chat template; use /v1/completions", param="messages")
        try:
            text = tok.apply_chat_template([{"role": m.role, "content": m.text} for m in messages],
                                           add_generation_prompt=add_generation_prompt, tokenize=False)
        except TemplateError as err:
            raise APIError(400, f"messages: the chat template refused them ({err})", param="messages") from None
        return tok(text, add_special_tokens=False)["input_ids"]

    def completion_prompts(self, body: CompletionRequest) -> list[tuple[str, list[int]]]:
        """(text, token ids) of each prompt of a completion request (text prompts tokenized, id prompts decoded).

        Raises:
            APIError: 400 if a prompt's token id is outside the vocabulary.
        """
        vocab_size = self.engine.backbone.vocab_size
        prompts = []
        for prompt in body.prompts:
            if isinstance(prompt, str):
                prompts.append((prompt, self.tok(prompt)["input_ids"]))
            else:
                if any(not 0 <= t < vocab_size for t in prompt):
                    raise APIError(400, "prompt: a token id is outside the vocabulary "
                                        f"(0..{vocab_size - 1})", param="prompt")
                prompts.append((self.tok.decode(prompt), list(prompt)))
        return prompts


def _lifespan(engine: Engine):
    """The app's lifespan: the engine starts with the app and stops (off the event loop) when it shuts down."""

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start()
        try:
            yield
        finally:
            await asyncio.to_thread(engine.stop)

    return lifespan


def _add_error_handlers(app: FastAPI) -> None:
    """Answer every error in OpenAI's format: API errors, invalid bodies (400), unknown routes and methods (404,
    405), and any other exception as a logged 500 that names only its type."""

    @app.exception_handler(APIError)
    async def _api_error(request: Request, err: APIError):
        return err.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, err: RequestValidationError):
        return validation_error(list(err.errors())).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, err: StarletteHTTPException):
        code = {404: "not_found", 405: "method_not_allowed", 413: TOO_LARGE}.get(err.status_code)
        return APIError(err.status_code, f"{request.method} {request.url.path}: {err.detail}", code=code).response()

    @app.exception_handler(Exception)
    async def _internal(request: Request, err: Exception):
        logger.exception("internal error on %s", request.url.path)
        return APIError(500, f"internal server error: {type(err).__name__}").response()


# The route handlers below carry no docstrings: FastAPI would publish them as the OpenAPI descriptions.
def _add_info_routes(app: FastAPI, service: Service) -> None:
    """GET (or HEAD) /health, open without the API key; GET /v1/models and /v1/models/{model}: the model, its
    calibration and the engine's counters."""
    engine, renderer = service.engine, service.renderer

    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health():
        return {"status": "ok", "model": service.model_name, "calibrated": engine.calibrated, **renderer.info,
                "calibration": engine.calibration.describe(), **engine.stats()}

    def card() -> dict:
        return {"id": service.model_name, "object": "model", "created": service.started, "owned_by": "ats",
                "max_model_len": engine.max_model_len, "calibrated": engine.calibrated, **renderer.info}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [card()]}

    @app.get("/v1/models/{model:path}")
    async def model(model: str):
        service.check_model(model)
        return card()


def _add_monitor_routes(app: FastAPI, service: Service) -> None:
    """GET /v1/ats/monitor (JSON): the served certificate's decisions, counted (`monitor.py`; 404 when no threshold
    is served); GET /metrics (Prometheus, open without the API key as vLLM's is): the serving metrics
    (`metrics.py`) and those counts."""

    def monitor() -> DecisionMonitor:
        if service.monitor is None:
            raise APIError(404, "no certified threshold is served, so no decisions are counted: serve a calibrator "
                                "folder that holds a threshold.json (ats certify)", code="not_found")
        return service.monitor

    @app.get(MONITOR_PATH)
    async def monitor_report():
        return monitor().report()

    @app.get("/metrics")
    async def metrics():
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return Response(generate_latest(service.metrics.registry), media_type=CONTENT_TYPE_LATEST)


def _add_tokenizer_routes(app: FastAPI, service: Service) -> None:
    """POST /tokenize, POST /detokenize and GET /tokenizer_info, as vLLM's (clients count tokens before sending)."""
    engine, tok = service.engine, service.tok

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        if body.model is not None:
            service.check_model(body.model)
        if body.messages is not None:
            ids = service.chat_ids(body.messages, body.add_generation_prompt)
        else:
            ids = tok(body.prompt, add_special_tokens=body.add_special_tokens)["input_ids"]
        return {"tokens": ids, "count": len(ids), "max_model_len": engine.max_model_len}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        if body.model is not None:
            service.check_model(body.model)
        bad = [t for t in body.tokens if not 0 <= t < engine.backbone.vocab_size]
        if bad:
            raise APIError(400, f"tokens: token id {bad[0]} is outside the vocabulary", param="tokens")
        return {"prompt": tok.decode(body.tokens)}

    @app.get("/tokenizer_info")
    async def tokenizer_info():
        return {"tokenizer_class": type(tok).__name__, "eos_token": tok.eos_token, "bos_token": tok.bos_token,
                "pad_token": tok.pad_token, "chat_template": getattr(tok, "chat_template", None),
                "model_max_length": engine.max_model_len}


def _add_chat_route(app: FastAPI, service: Service) -> None:
    """POST /v1/chat/completions: the messages through the chat template, answered whole or streamed."""
    engine = service.engine

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, request: Request):
        service.check_model(body.model)
        ids = await asyncio.to_thread(service.chat_ids, body.messages)
        max_tokens = body.new_tokens if body.new_tokens is not None else max(1, engine.max_model_len - len(ids))
        job = Job([ids], n=body.n, max_tokens=max_tokens, sampling=_sampling(body), stop=body.stops,
                  top_logprobs=(body.top_logprobs or 0) if body.logprobs else 0, ignore_eos=body.ignore_eos,
                  min_tokens=body.min_tokens)
        run = Run(engine, job, "messages", service.metrics)
        renderer = service.renderer_for(body, chat=True, max_tokens=body.new_tokens)
        if body.stream:
            return _event_stream(_chat_stream(renderer, run, body, len(ids)))
        collected = await run.collect(request, Collector(1, body.n))
        return await _json(lambda: renderer.chat(collected, logprobs=body.logprobs, prompt_tokens=len(ids)))


async def _chat_stream(renderer: Renderer, run: Run, body: ChatCompletionRequest, prompt_tokens: int):
    """The server-sent events of a streamed chat completion: a role chunk per choice, then a chunk per generated
    piece, the usage if asked, and [DONE] (or an error event); the job is cancelled when the stream ends or closes."""
    envelope = renderer.envelope("chatcmpl", "chat.completion.chunk")
    collected = Collector(1, body.n)
    try:
        for i in range(body.n):
            yield _data(renderer.chat_chunk(envelope, i, delta={"role": "assistant", "content": ""}))
        async for event in run.events():
            collected.add(event)
            if isinstance(event, Generated):
                done = event.finish_reason is not None
                yield _data(renderer.chat_chunk(
                    envelope, event.choice, delta={"content": event.text} if event.text else {},
                    tokens=event.tokens, logprobs=body.logprobs, finish_reason=event.finish_reason,
                    all_tokens=collected.choices[event.choice].tokens if done else None))
        if body.include_usage:
            yield _data({**envelope, "choices": [],
                         "usage": renderer.usage(prompt_tokens, collected.completion_tokens)})
        yield {"data": "[DONE]"}
    except APIError as err:
        yield _error_data(err)
    finally:
        run.cancel()


def _add_completion_route(app: FastAPI, service: Service) -> None:
    """POST /v1/completions: text or token-id prompts, optionally echoed with their scores, whole or streamed."""
    engine = service.engine

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        service.check_model(body.model)
        prompts = await asyncio.to_thread(service.completion_prompts, body)  # (text, ids)
        logprobs = body.logprobs is not None
        max_tokens = 16 if body.max_tokens is None else body.max_tokens
        renderer = service.renderer_for(body, chat=False, max_tokens=max_tokens)
        job = Job([ids for _, ids in prompts], n=body.n, max_tokens=max_tokens,
                  sampling=_sampling(body), stop=body.stops, top_logprobs=body.logprobs or 0,
                  prompt_logprobs=body.echo and logprobs, ignore_eos=body.ignore_eos, min_tokens=body.min_tokens)
        run = Run(engine, job, "prompt", service.metrics)
        if body.stream:
            return _event_stream(_completion_stream(renderer, run, body, prompts))
        collected = await run.collect(request, Collector(len(prompts), body.n))

        def body_of_response() -> dict:
            offsets = [renderer.prompt_offsets(ids) for _, ids in prompts] if body.echo and logprobs else None
            return renderer.completion(collected, prompts=prompts, echo=body.echo, logprobs=logprobs,
                                       prompt_offsets=offsets)

        return await _json(body_of_response)


async def _completion_stream(renderer: Renderer, run: Run, body: CompletionRequest,
                             prompts: list[tuple[str, list[int]]]):
    """The server-sent events of a streamed completion: the echoed prompts (with their scores when logprobs are
    asked), a chunk per generated piece, the usage if asked, and [DONE] (or an error event); the job is cancelled
    when the stream ends or closes."""
    envelope = renderer.envelope("cmpl", "text_completion")
    logprobs = body.logprobs is not None
    collected = Collector(len(prompts), body.n)
    bases = [len(text) if body.echo else 0 for text, _ in prompts]

    def chunk(index: int, text: str, tokens, offsets, finish_reason=None, ats=None) -> dict:
        choice = renderer.completion_choice(index, text, tokens, offsets, logprobs=logprobs,
                                            finish_reason=finish_reason, ats=ats or extension(tokens))
        return {**envelope, "choices": [choice]}

    try:
        if body.echo and not logprobs:  # the prompt text first (with logprobs it comes with its scores)
            for i in range(len(collected.choices)):
                yield _data(chunk(i, prompts[i // body.n][0], [], []))
        async for event in run.events():
            collected.add(event)
            if isinstance(event, PromptScored):
                text, ids = prompts[event.prompt]
                offsets = await asyncio.to_thread(renderer.prompt_offsets, ids)
                for j in range(body.n):
                    yield _data(chunk(event.prompt * body.n + j, text, event.tokens, offsets,
                                      ats=extension([], prompt=event.tokens)))
            elif isinstance(event, Generated):
                base = bases[event.choice // body.n]
                ats = extension(event.tokens)
                if event.finish_reason is not None:
                    ats.update(renderer.decision(collected.choices[event.choice].tokens))
                yield _data(chunk(event.choice, event.text, event.tokens, [t.offset + base for t in event.tokens],
                                  event.finish_reason, ats))
        if body.include_usage:
            usage = renderer.usage(sum(len(ids) for _, ids in prompts), collected.completion_tokens)
            yield _data({**envelope, "choices": [], "usage": usage})
        yield {"data": "[DONE]"}
    except APIError as err:
        yield _error_data(err)
    finally:
        run.cancel()


def create_app(engine: Engine, *, model_name: str, api_key: str | None = None,
               threshold: CertifiedThreshold | None = None, playground: Playground | None = None,
               certificate: Certificate | None = None, max_request_bytes: int = MAX_REQUEST_BYTES) -> FastAPI:
    """The app serving `engine` as model `model_name`; with `api_key`, every route but `OPEN_PATHS` needs it.

    Args:
        engine: the engine; started and stopped with the app.
        model_name: the model name the API reports and accepts.
        api_key: the key clients must send as `Authorization: Bearer KEY`; None: no key.
        threshold: the calibrator's certified threshold (`ats certify`): every choice's `ats` field then says
            whether it is answered; None: no decision.
        playground: the calibrators the page can rescore with (the served one first: the engine's) and the saved
            evaluation; None: the served calibrator only, no evaluation.
        certificate: what `threshold` certifies (`read_certificate`): every decision then says whether its request
            is made as the certified answers were (`certified_format`, `outside_certificate`); None: it does not.
        max_request_bytes: the largest request body accepted (`body_limit`; a larger one gets a 413).

    Returns:
        The FastAPI app.
    """
    service = Service(engine, model_name, threshold, certificate)
    app = FastAPI(title="ats: calibrated OpenAI-compatible server", lifespan=_lifespan(engine))
    app.add_middleware(BodyLimit, max_bytes=max_request_bytes)
    if api_key:  # added last, so checked first: a request without the key gets its 401 whatever its size
        app.add_middleware(BearerAuth, key=api_key)
    _add_error_handlers(app)
    _add_info_routes(app, service)  # in the order of the OpenAPI listing: info, tokenizer, chat, completions
    _add_tokenizer_routes(app, service)
    _add_chat_route(app, service)
    _add_completion_route(app, service)
    _add_monitor_routes(app, service)
    if playground is None:
        playground = Playground([ServedCalibrator(engine.calibration.label, engine.calibration, threshold)])
    add_playground_routes(app, service, playground)
    return app
