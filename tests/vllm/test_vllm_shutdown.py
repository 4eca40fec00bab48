"""`ats serve --engine vllm` shut down with requests in flight (slow: a vLLM server per test). Within
--shutdown-timeout (vLLM's, which ats passes on) the requests finish, and /health and new requests get `ats serve`'s
503 of a server shutting down (vLLM alone: 200 and a 500); past it, vLLM 0.32 stops its engine and can leave
a request it was running unanswered, its client waiting until its own timeout and the server with it: ats's layer
ends each such request as `ats serve` does (a 503 with code shutting_down, or a stream's error event), or lets vLLM's
own answer through when vLLM gives one (a 500, or a 200 whose finish_reason is "abort"), and the server exits."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time
from pathlib import Path

import httpx
import pytest

from ats.serving.api_errors import SHUTTING_DOWN_MESSAGE

from vllm_helpers import ats_serve_vllm_process

sys.path.insert(0, str(Path(__file__).parents[1] / "serving"))
from in_flight import InFlight, terminate  # noqa: E402

pytestmark = pytest.mark.slow  # a vLLM server per test (30-90 s to start here)
LONG = 1000  # new tokens, within the tiny model's context of 1024: seconds of decoding


@pytest.fixture()
def serve(tiny_models, tmp_path):
    """Start `ats serve --engine vllm` on the tiny Llama (uncalibrated) with a --shutdown-timeout: (url, process)."""
    folder, _ = tiny_models["llama"]
    env = {key: value for key, value in os.environ.items() if not key.startswith("VLLM_CPU_")}
    env["ATS_CACHE"] = str(tmp_path / "cache")
    env["VLLM_LOGGING_LEVEL"] = "INFO"  # the shutdown lines read below are vLLM's INFO (an in-process `ats -q` of an
    #                                     earlier test sets WARNING in this process's environment)
    with contextlib.ExitStack() as servers:

        def start(shutdown_timeout: int):
            argv = ["--model", str(folder), "--calibrator", "none", "--served-model-name", "tiny",
                    "--shutdown-timeout", str(shutdown_timeout), "--", "--enforce-eager"]
            return servers.enter_context(ats_serve_vllm_process(argv, env, tmp_path / "server.log"))

        yield start


def test_a_drain_finishes_the_requests_in_flight_and_refuses_new_ones_as_ats_serve_does(serve, tmp_path):
    url, process = serve(120)
    requests = InFlight(url, "unused", "tiny", max_tokens=LONG)
    start = time.monotonic()
    process.send_signal(signal.SIGTERM)
    while (health := httpx.get(url + "/health", timeout=10)).status_code == 200 and time.monotonic() < start + 30:
        time.sleep(0.05)
    draining = all(thread.is_alive() for thread in requests.threads)  # both requests still run: vLLM drains
    new = httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": "Hi", "max_tokens": 4}, timeout=10)
    requests.join()
    process.wait(150)
    seconds = time.monotonic() - start
    # while it drains, vLLM alone answers /health 200 and a new request 500 ("cannot schedule new futures after
    # shutdown"); ats's layer answers as `ats serve` does
    assert draining
    assert health.status_code == 503 and health.json()["error"]["code"] == "shutting_down"
    assert new.status_code == 503
    assert new.json()["error"] == {"message": SHUTTING_DOWN_MESSAGE, "type": "server_error", "param": None,
                                   "code": "shutting_down"}
    assert requests.stream_error is None and requests.plain_error is None  # the requests in flight finish
    assert requests.chunks[-1].choices[0].finish_reason == "length"
    assert requests.plain.usage.completion_tokens == LONG
    log = (tmp_path / "server.log").read_text()
    assert "mode=drain timeout=120s" in log  # ats passed its option on to vLLM
    assert seconds < 120


def test_requests_still_running_when_the_engine_stops_end_with_an_error_their_client_sees(serve, tmp_path):
    url, process = serve(0)
    requests = InFlight(url, "unused", "tiny", max_tokens=LONG)
    seconds = terminate(process)
    requests.join()  # none is left waiting (vLLM alone can leave them until the client's timeout)
    # each ends cut, in one of the ways vLLM 0.32 ends it (which one is a race in its shutdown) or ats's 503
    if requests.plain is not None:  # vLLM aborted it: a 200 whose finish_reason says so
        assert requests.plain.choices[0].finish_reason == "abort"
        assert requests.plain.usage.completion_tokens < LONG
    else:  # vLLM's 500 (its engine is dead), or ats's 503 when vLLM left it unanswered
        assert requests.plain_error.status_code in (500, 503)
        assert requests.plain_error.status_code == 500 or requests.plain_error.code == "shutting_down"
    if requests.stream_error is None:  # its last chunk says it was aborted
        assert requests.chunks[-1].choices[0].finish_reason == "abort"
    assert sum(len(c.choices[0].text) for c in requests.chunks) > 0 and len(requests.chunks) < LONG
    log = (tmp_path / "server.log").read_text()
    assert "mode=abort" in log and "AttributeError" not in log
    assert seconds < 60
