"""A real `ats serve` process for the tests: started on a free port, waited for, always stopped."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[2]
MODEL_NAME = "tiny"
API_KEY = "test-key"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _interruptible() -> None:
    """Ctrl-C reaches the server as it does one started from a terminal: a shell without job control (a CI script,
    `nohup ... &`) starts its background commands with SIGINT ignored, and the server would inherit that."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def server_env() -> dict:
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TQDM_DISABLE="1")
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "src"), *filter(None, [env.get("PYTHONPATH")])])
    return env


class Server:
    """`python -m ats serve ...` as a subprocess on a free port (one torch thread unless `args` say otherwise);
    waits until /health answers unless `wait=False` (then call `wait()`); `stop()` ends it. Also used by
    benchmarks/bench_serve.py."""

    def __init__(self, args: list[str], log: Path, api_key: str | None = None, timeout: float = 180.0,
                 wait: bool = True) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.api_key = api_key
        self.log = log
        threads = [] if "--threads" in args else ["--threads", "1"]
        command = [sys.executable, "-m", "ats", "serve", *args, "--port", str(self.port), *threads]
        if api_key:
            command += ["--api-key", api_key]
        self._log_file = log.open("w")
        self.process = subprocess.Popen(command, stdout=self._log_file, stderr=subprocess.STDOUT, env=server_env(),
                                        preexec_fn=_interruptible)
        if wait:
            self.wait(timeout)

    def wait(self, timeout: float = 180.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(f"server exited with {self.process.returncode}:\n{self.log.read_text()[-3000:]}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"server not up after {timeout:.0f} s:\n{self.log.read_text()[-3000:]}")
            time.sleep(0.3)

    def health(self) -> dict:
        return httpx.get(self.url + "/health", timeout=10).json()

    def headers(self) -> dict:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(15)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(5)
        self._log_file.close()
