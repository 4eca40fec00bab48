"""`ats serve` shut down with requests in flight (SIGTERM, as an orchestrator stops a replica): within
--shutdown-timeout they finish as if nothing happened, plain and streamed alike; past it each ends with an error its
client sees (a 503, a stream's error event), never a silently cut answer; and the server exits."""

from __future__ import annotations

import signal

import httpx
import pytest

from in_flight import LONG, InFlight, terminate
from server_process import API_KEY, MODEL_NAME, Server


def in_flight(server: Server) -> InFlight:
    """A stream and a plain request of n=4 running on `server` (its rows counted in /health)."""
    return InFlight(server.url, API_KEY, MODEL_NAME, n=4, ready=lambda: server.health()["running"] >= 5)


@pytest.fixture()
def serve(model_dir, head_dir, tmp_path):
    servers = []

    def start(shutdown_timeout: int) -> Server:
        servers.append(Server(["--model", str(model_dir), "--calibrator", str(head_dir), "--served-model-name",
                               MODEL_NAME, "--max-batch", "8", "--shutdown-timeout", str(shutdown_timeout)],
                              tmp_path / f"server-{len(servers)}.log", api_key=API_KEY))
        return servers[-1]

    yield start
    for server in servers:
        server.stop()


def test_requests_in_flight_finish_within_the_shutdown_timeout(serve):
    server = serve(120)
    requests = in_flight(server)
    seconds = terminate(server.process)
    requests.join()
    assert requests.stream_error is None and requests.plain_error is None
    assert requests.chunks[-1].choices[0].finish_reason == "length"
    assert sum(len(c.choices[0].text) > 0 for c in requests.chunks) > 0
    assert [c.finish_reason for c in requests.plain.choices] == ["length"] * 4
    assert requests.plain.usage.completion_tokens == 4 * LONG
    log = server.log.read_text()
    assert "shutting down: the requests in flight (5 sequence(s) running, 0 waiting) get up to 120 s" in log
    assert seconds < 110 and "Traceback" not in log
    assert server.process.returncode == -signal.SIGTERM  # uvicorn raises the signal again: the caller sees it
    with pytest.raises(httpx.TransportError):  # and it listens no more
        httpx.get(server.url + "/health", timeout=5)


def test_requests_still_running_at_the_shutdown_timeout_end_with_an_error_their_client_sees(serve):
    server = serve(0)
    requests = in_flight(server)
    seconds = terminate(server.process)
    requests.join()
    assert requests.plain is None and requests.plain_error.status_code == 503  # openai.InternalServerError
    assert requests.plain_error.code == "shutting_down"
    assert "the server shut down before this request finished" in requests.plain_error.message
    # the stream's last event is an error, which the openai client raises: not an answer cut without a word
    assert requests.stream_error is not None and "shut down before this request finished" in str(
        requests.stream_error)
    assert all(c.choices[0].finish_reason is None for c in requests.chunks)
    log = server.log.read_text()
    assert '"POST /v1/completions HTTP/1.1" 503' in log and "Traceback" not in log
    assert seconds < 30


def test_ctrl_c_drains_and_exits_130_without_a_word_of_resuming(serve):
    server = serve(20)
    server.process.send_signal(signal.SIGINT)
    assert server.process.wait(60) == 130  # uvicorn raises the signal again after its shutdown: 128 + SIGINT
    log = server.log.read_text()
    assert "shutting down: the requests in flight (0 sequence(s) running, 0 waiting)" in log
    assert "Finished server process" in log and "Traceback" not in log and "interrupted" not in log
