"""A limit on the size of a request body, for `ats serve` (both engines: `app.create_app` and vLLM's server through
`ATSMiddleware`).

Without one, every body is read whole into memory before anything looks at it (FastAPI, vLLM and uvicorn set no
limit; uvicorn only bounds headers), so one client can make the server hold gigabytes. A body over the limit is
refused with a 413 in OpenAI's error format, code `request_too_large`: at once when its Content-Length says so (the
body is never read), else as soon as the bytes received pass the limit (a chunked body). The default, 16 MiB, is far
above what a prompt at any context length takes; `--max-request-bytes` changes it.
"""

from __future__ import annotations

from starlette.exceptions import HTTPException

from .api_errors import MAX_REQUEST_BYTES, TOO_LARGE, APIError


def too_large_message(limit: int) -> str:
    """The refusal's message."""
    return f"the request body is over this server's limit of {limit} bytes (ats serve --max-request-bytes)"


class RequestTooLarge(HTTPException):
    """Raised by the counting `receive` when the bytes received pass the limit: an HTTPException, so FastAPI lets it
    through its body parsing to the app's handlers (status 413), and `BodyLimit` answers it where no app did."""

    def __init__(self, limit: int) -> None:
        super().__init__(413, too_large_message(limit))
        self.limit = limit


def too_large(limit: int) -> APIError:
    """The 413 of a body over `limit` bytes."""
    return APIError(413, too_large_message(limit), code=TOO_LARGE)


class BodyLimit:
    """ASGI middleware that refuses request bodies over `max_bytes` (module docstring).

    Args:
        app: the ASGI app behind it.
        max_bytes: the largest body accepted, in bytes.
    """

    def __init__(self, app, max_bytes: int = MAX_REQUEST_BYTES) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await too_large(self.max_bytes).response()(scope, receive, send)
            return
        received, started = 0, False

        async def counting_receive():
            nonlocal received
            message = await receive()
            received += len(message.get("body", b""))
            if received > self.max_bytes:
                raise RequestTooLarge(self.max_bytes)
            return message

        async def tracking_send(message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counting_receive, tracking_send)
        except RequestTooLarge:
            if started:  # the app answered already: nothing more can be said on this connection
                raise
            await too_large(self.max_bytes).response()(scope, receive, send)
