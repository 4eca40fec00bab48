"""Requests in flight when a server is sent SIGTERM (the shutdown tests of `ats serve` and `ats serve --engine
vllm`): a streamed completion and a plain one, each on its own thread through the openai client, and what each got."""

from __future__ import annotations

import signal
import subprocess
import threading
import time
from collections.abc import Callable

import openai

LONG = 1800  # new tokens: seconds of decoding for the tiny models, so the requests are in flight at the signal


class InFlight:
    """A plain completion (`n` choices) and then a streamed one, both of `max_tokens`, started on their threads;
    returns once the stream's first chunk came and `ready()` (if given) says the server runs both.

    After `join()`: `plain` (the response) or `plain_error`; `chunks` (the stream's) and `stream_error` (what ended
    it, if anything did)."""

    def __init__(self, url: str, api_key: str, model: str, *, n: int = 1, max_tokens: int = LONG,
                 ready: Callable[[], bool] | None = None) -> None:
        self.client = openai.OpenAI(base_url=url + "/v1", api_key=api_key, max_retries=0, timeout=120)
        self.model, self.n, self.max_tokens = model, n, max_tokens
        self.chunks, self.stream_error, self.plain, self.plain_error = [], None, None, None
        self.streaming = threading.Event()
        self.threads = [threading.Thread(target=self._plain), threading.Thread(target=self._stream)]
        self.threads[0].start()
        time.sleep(0.5)  # the plain request first: in flight by the time the stream's first chunk comes
        self.threads[1].start()
        assert self.streaming.wait(120) and self.stream_error is None, f"no chunk of the stream: {self.stream_error}"
        deadline = time.monotonic() + 60
        while ready is not None and not ready():
            assert time.monotonic() < deadline, "the requests did not start"
            time.sleep(0.02)

    def _stream(self) -> None:
        try:
            for chunk in self.client.completions.create(model=self.model, prompt="Hi", max_tokens=self.max_tokens,
                                                        stream=True, temperature=0, extra_body={"ignore_eos": True}):
                self.chunks.append(chunk)
                self.streaming.set()
        except openai.APIError as err:
            self.stream_error = err
            self.streaming.set()

    def _plain(self) -> None:
        try:
            self.plain = self.client.completions.create(model=self.model, prompt="Hello", max_tokens=self.max_tokens,
                                                        n=self.n, temperature=0, extra_body={"ignore_eos": True})
        except openai.APIError as err:
            self.plain_error = err

    def join(self) -> None:
        for thread in self.threads:
            thread.join(150)
            assert not thread.is_alive(), "a request was left waiting"


def terminate(process: subprocess.Popen) -> float:
    """SIGTERM `process`; the seconds until it exited."""
    start = time.monotonic()
    process.send_signal(signal.SIGTERM)
    process.wait(150)
    return time.monotonic() - start
