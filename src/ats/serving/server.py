"""Running the app under uvicorn with a bounded, honest shutdown.

On SIGTERM or Ctrl-C uvicorn stops listening and waits for the requests in flight. `DrainingServer` also tells the
engine (`Engine.drain`): no new job, and the requests it has, plain and streamed alike, get `shutdown_timeout`
seconds to finish. Those still running then end with an error their client can see (a 503 body, or an error event
as a stream's last), never with a silently cut answer; an OpenAI client retries the 503, on another replica behind
a load balancer. After the answers, uvicorn gets a few seconds more to close the connections, and then the engine
stops.
"""

from __future__ import annotations

import math
import socket

import uvicorn

from .engine import Engine

CLOSE_SECONDS = 5.0  # past the engine's deadline, for the last responses to go out before uvicorn cancels handlers


class DrainingServer(uvicorn.Server):
    """uvicorn's server, which at shutdown drains `engine` for `shutdown_timeout` seconds (`Engine.drain`)."""

    def __init__(self, config: uvicorn.Config, engine: Engine, shutdown_timeout: float) -> None:
        super().__init__(config)
        self.engine, self.shutdown_timeout = engine, shutdown_timeout

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        self.engine.drain(self.shutdown_timeout)
        await super().shutdown(sockets=sockets)


def run_server(app, engine: Engine, *, host: str, port: int, log_level: str, shutdown_timeout: float) -> None:
    """Serve `app` (whose requests run on `engine`) on host:port until a signal, then drain (module docstring).

    Raises:
        SystemExit: 3 if the server could not start (uvicorn has logged why), as `uvicorn.run` exits.
    """
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level,
                            timeout_graceful_shutdown=math.ceil(shutdown_timeout + CLOSE_SECONDS))
    server = DrainingServer(config, engine, shutdown_timeout)
    server.run()
    if not server.started:
        raise SystemExit(3)
