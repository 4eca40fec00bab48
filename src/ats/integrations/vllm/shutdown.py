"""Requests that vLLM's shutdown would leave waiting for ever, ended with `ats serve`'s shutdown error.

On SIGTERM vLLM's server (0.32) drains its engine for `--shutdown-timeout` seconds (0: none), stops it, and then
waits for its connections to close. A request still running when the engine stopped gets, by a race in that
shutdown, a 200 whose finish_reason is "abort", vLLM's 500, or no answer at all (no abort reaches it:
vllm-project/vllm#36964): then its client waits until its own timeout (the openai client's: 10 minutes), and the
server waits with it. `until_engine_stops` runs vLLM's handler of one generation request and
watches the engine: once the engine has stopped, vLLM gets `GRACE` seconds to answer the request itself (an engine
that died of an error fails its requests at once), and then the request ends as it does on `ats serve`: a 503 with
code `shutting_down` if nothing was sent yet, else a stream's last event, an `error` (the openai client raises
both).

From the signal until its engine stops vLLM keeps listening, though it takes nothing new: its /health says 200 and a
new request gets a 500 ("cannot schedule new futures after shutdown": its tokenizer's threads are shut down first).
`engine_shutting_down` sees that drain begin, so that the middleware answers as `ats serve` does: /health 503, so that
a load balancer stops sending, and each new request `ats serve`'s 503 (code `shutting_down`), which clients retry.
"""

from __future__ import annotations

import asyncio
import json
from contextlib import suppress

from ...serving.api_errors import APIError, shutdown_error

POLL = 0.5  # seconds between two looks at the engine
GRACE = 2.0  # seconds vLLM gets to answer a request itself once its engine has stopped


def engine_stopped(engine) -> bool:
    """Whether vLLM's engine client has stopped or died (`EngineClient.errored`: its output handler is done)."""
    return bool(getattr(engine, "errored", False))


def engine_client(scope):
    """vLLM's engine client of the app that serves the ASGI call `scope` (its state's `engine_client`), or None."""
    return getattr(getattr(scope.get("app"), "state", None), "engine_client", None)


def engine_shutting_down(engine) -> bool:
    """Whether vLLM's engine client has begun its shutdown: its engine core's `shutdown` detaches the finalizer it
    holds (`weakref.finalize`, dead from then on). An engine that died of an error is not shutting down."""
    finalizer = getattr(getattr(engine, "engine_core", None), "_finalizer", None)
    return finalizer is not None and not finalizer.alive


class SentTracker:
    """An ASGI `send` that passes everything on and remembers what the client got: the response's start (and
    whether it streams server-sent events) and its end."""

    def __init__(self, send) -> None:
        self.send = send
        self.started = self.streaming = self.complete = False

    async def __call__(self, message) -> None:
        if message["type"] == "http.response.start":
            self.started = True
            headers = dict(message.get("headers", []))
            self.streaming = headers.get(b"content-type", b"").startswith(b"text/event-stream")
        elif message["type"] == "http.response.body" and not message.get("more_body", False):
            self.complete = True
        await self.send(message)

    async def end_with(self, error: APIError) -> None:
        """End the response with `error`: its JSON body when nothing was sent yet, an `error` event as a stream's
        last; a plain response cut after its start (none is: the decisions hold it whole) is only closed."""
        if self.complete:
            return
        body = json.dumps(error.body()).encode()
        if not self.started:
            await self.send({"type": "http.response.start", "status": error.status,
                             "headers": [(b"content-type", b"application/json"),
                                         (b"content-length", str(len(body)).encode())]})
            await self.send({"type": "http.response.body", "body": body})
        else:
            event = b"data: " + body + b"\n\n" if self.streaming else b""
            await self.send({"type": "http.response.body", "body": event})
        self.complete = True


async def until_engine_stops(app, scope, receive, send, tracker: SentTracker) -> None:
    """Run `app` (vLLM's server) on a generation request; end the request with the shutdown error if vLLM's engine
    stops while it runs and vLLM does not answer it within `GRACE` seconds (module docstring).

    Args:
        app, scope, receive: the ASGI app and call.
        send: the `send` the app gets (ats's rewriters, over `tracker`).
        tracker: the client's side of `send`, through which the error goes.
    """
    engine = engine_client(scope)
    if engine is None:
        await app(scope, receive, send)
        return
    handler = asyncio.ensure_future(app(scope, receive, send))
    try:
        while not engine_stopped(engine) and not handler.done():
            await asyncio.wait({handler}, timeout=POLL)
        if not handler.done():
            await asyncio.wait({handler}, timeout=GRACE)
        if handler.done():
            handler.result()  # vLLM answered (or raised: its error goes on up)
            return
    finally:
        if not handler.done():
            handler.cancel()
            with suppress(asyncio.CancelledError):
                await handler
    await tracker.end_with(shutdown_error("the server shut down before this request finished (vLLM's engine "
                                          "stopped); send it again"))
