"""The batching engine: one worker thread owns the model and the decoding core, and decodes every running sequence
together (continuous batching).

Requests (`Job`s: prompts x n sequences) wait in a bounded queue. Between two decoding steps the engine admits as many
waiting sequences as there are free rows (`max_batch`) and hands them to the decoding core (`ats.generation.Decoder`,
the one `generate_calibrated` uses): it prefills them as one left-padded batch, chooses their first token and joins
them to the running batch; each step feeds every running row its last token, runs the calibrator on the new position
and chooses each row's next token from the calibrated logits with that request's sampling options. Finished and
cancelled rows leave before the next step.

Results go out as events through each job's `sink` (called on the engine thread; the server hands them to its event
loop): `PromptScored` (echoed prompt log-probabilities), `Generated` (released tokens and text of one choice, with
its finish reason at the end), then `JobDone`, or `JobFailed` when the model raised. The engine never waits for a
client: a slow reader only lets its own events pile up, and a cancelled job (client gone) frees its rows at the next
step.

Shutting down (`drain`): the engine takes no new job, lets those it has run to their end for a grace period, and then
fails each one still running with `JobFailed(status=503)`, so that every client learns that its answer was cut.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from ..calibrators.base import Calibrator
from ..errors import ATSError
from ..generation.decoder import Decoder, Row
from ..generation.limits import check_prompts, context_length
from ..generation.logprobs import TokenLogprob
from ..generation.sampling import SamplingParams
from ..model.backbone import Backbone
from .api_errors import SHUTTING_DOWN_MESSAGE

logger = logging.getLogger(__name__)


class QueueFull(RuntimeError):
    """The engine's queue of waiting requests is full (the server answers 503)."""


class ShuttingDown(RuntimeError):
    """The engine is draining for shutdown and takes no new job, or stopped before a call ran (the server answers
    503)."""


@dataclass
class PromptScored:
    """The scored tokens of prompt `prompt` (echo with logprobs), sent before its choices' tokens."""

    prompt: int
    tokens: list[TokenLogprob]


@dataclass
class Generated:
    """Newly released tokens and text of choice `choice`; `finish_reason` ("stop" | "length") on its last event."""

    choice: int
    tokens: list[TokenLogprob]
    text: str
    finish_reason: str | None = None


@dataclass
class JobDone:
    """The job's last event: every choice has finished."""

    pass


@dataclass
class JobFailed:
    """The job's last event when the engine failed on it: `message` says why; `status` is the HTTP status a server
    answers with (500: the model failed; 503: the server shut down first, the request may be retried)."""

    message: str
    status: int = 500


@dataclass(eq=False)
class Job:
    """One request: `prompts` (token ids), each continued `n` times (choice index = prompt * n + replica).

    max_tokens: new tokens per choice (0: only score the prompt); top_logprobs: alternatives reported per token;
    prompt_logprobs: also score every prompt token (echo); ignore_eos: keep going after end-of-sequence tokens;
    min_tokens: no end-of-sequence token before this many new tokens.
    sink: receives the events, on the engine thread; it must not block.
    """

    prompts: list[list[int]]
    n: int = 1
    max_tokens: int = 16
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop: Sequence[str] = ()
    top_logprobs: int = 0
    prompt_logprobs: bool = False
    ignore_eos: bool = False
    min_tokens: int = 0
    sink: Callable[[object], None] | None = None
    cancelled: bool = field(default=False, init=False)
    _remaining: int = field(default=0, init=False)
    _generator: torch.Generator | None = field(default=None, init=False)
    _scored: set = field(default_factory=set, init=False)

    def emit(self, event) -> None:
        """Send `event` to the sink, unless the job is cancelled; a sink that raises cancels the job."""
        if self.sink is None or self.cancelled:
            return
        try:
            self.sink(event)
        except Exception:  # a sink that cannot take events any more (its loop closed): stop this job
            logger.warning("dropping a request whose event sink failed", exc_info=True)
            self.cancelled = True


class _Sequence(Row):
    """One choice being generated: a decoding row that belongs to a job (choice index `choice`)."""

    def __init__(self, job: Job, prompt: int, choice: int, tokenizer) -> None:
        super().__init__(job.prompts[prompt], (id(job), prompt), tokenizer, max_tokens=job.max_tokens,
                         sampling=job.sampling, generator=job._generator, stop=job.stop,
                         top_logprobs=job.top_logprobs, ignore_eos=job.ignore_eos, min_tokens=job.min_tokens,
                         score_prompt=job.prompt_logprobs and prompt not in job._scored)
        job._scored.add(prompt)
        self.job, self.index, self.choice = job, prompt, choice

    @property
    def live(self) -> bool:
        """Whether the row still decodes (not finished, its job not cancelled)."""
        return self.finish is None and not self.job.cancelled


class Engine:
    """Continuous batching of calibrated generation over `backbone` with any calibrator (None: the model's own
    probabilities, tau = 0). `max_batch` rows decode together; `max_queue` requests may wait; prompts plus new
    tokens must fit in `max_model_len` (default: the model's `max_position_embeddings`).

    Args:
        backbone: the frozen backbone; its layers must all use full or sliding-window attention.
        calibrator: any loaded calibrator, checked against the backbone and moved to its device; None: uncalibrated.
        max_batch: rows decoded together.
        max_queue: jobs that may wait.
        max_model_len: the context limit, at most the model's; None: the model's (2048 if it names none).

    Raises:
        ATSError: if the calibrator does not fit the backbone, a layer uses neither full nor sliding-window attention,
            or `max_model_len` is more than the model's context.
    """

    def __init__(self, backbone: Backbone, calibrator: Calibrator | None = None, *, max_batch: int = 16,
                 max_queue: int = 64, max_model_len: int | None = None) -> None:
        self.decoder = Decoder(backbone, calibrator, on_token=self._release)
        self.backbone = backbone
        self.tokenizer = backbone.tokenizer
        self.max_batch, self.max_queue = int(max_batch), int(max_queue)
        limit = context_length(backbone)
        if max_model_len and max_model_len > limit:  # positions the model never saw: refused, as vLLM does
            raise ATSError(f"max_model_len {max_model_len} is more than {backbone.name}'s context of {limit} tokens "
                           f"(max_position_embeddings in its config): give at most {limit}, or leave it out")
        self.max_model_len = int(max_model_len or limit)
        self._jobs: deque[Job] = deque()
        self._ready: deque[_Sequence] = deque()
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._drain_deadline: float | None = None  # time.monotonic() at which draining jobs fail (`drain`)
        self._drain_timeout = 0.0
        self.cancelled = 0  # jobs cancelled before they finished (clients gone)
        self._calls: deque[tuple[Callable[[], object], Future]] = deque()  # run on the engine thread between steps

    @property
    def calibration(self):
        """The decoding calibration (`ats.generation.DecodingCalibration`)."""
        return self.decoder.calibration

    @property
    def calibrated(self) -> bool:
        """Whether a calibrator is applied."""
        return self.decoder.calibration.calibrator is not None

    @property
    def timing(self) -> dict:
        """Cumulative decoding steps, rows, seconds and the calibrator's seconds (the decoder's timers)."""
        return self.decoder.timing

    @property
    def _rows(self) -> list[_Sequence]:
        return self.decoder.rows

    # --- the request side (any thread) ----------------------------------------------------------------------------
    def check(self, job: Job) -> None:
        """Refuse a job that cannot run.

        Args:
            job: the job to check.

        Raises:
            ATSError: naming the prompt, if one is empty or has a token id outside the vocabulary;
                `ContextLengthExceeded` if prompt + max_tokens is over the context.
        """
        check_prompts(job.prompts, vocab_size=self.backbone.vocab_size, max_model_len=self.max_model_len,
                      max_tokens=job.max_tokens)

    def submit(self, job: Job) -> None:
        """Queue `job`, checked first (see `check`).

        Args:
            job: the job; its events go to its sink.

        Raises:
            ATSError: as `check`.
            QueueFull: if `max_queue` jobs already wait.
            ShuttingDown: if the engine is draining (`drain`).
        """
        self.check(job)
        with self._cond:
            if self._drain_deadline is not None:
                raise ShuttingDown(SHUTTING_DOWN_MESSAGE)
            if len(self._jobs) >= self.max_queue:
                raise QueueFull(f"{len(self._jobs)} requests are already waiting")
            self._jobs.append(job)
            self._cond.notify()

    def cancel(self, job: Job) -> None:
        """Stop `job` (its client left): its rows are freed before the next step, its events stop.

        Args:
            job: a submitted job; cancelling it twice counts once.
        """
        with self._cond:
            if not job.cancelled:
                job.cancelled = True
                self.cancelled += 1
            self._cond.notify()

    def call(self, fn: Callable[[], object]) -> Future:
        """Run `fn()` on the engine thread between two decoding steps (that thread owns the model: e.g. rescoring
        tokens under another calibrator never runs the backbone beside a step).

        Args:
            fn: the work; it must not submit jobs and wait for them.

        Returns:
            A future with `fn`'s result or exception (`ShuttingDown` if the engine stops, or its drain ends, first).
        """
        future: Future = Future()
        with self._cond:
            self._calls.append((fn, future))
            self._cond.notify()
        return future

    def _run_calls(self) -> None:
        while True:
            with self._cond:
                if not self._calls:
                    return
                fn, future = self._calls.popleft()
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn())
                except Exception as err:  # the caller gets it; the engine goes on
                    future.set_exception(err)

    def stats(self) -> dict:
        """{"running", "waiting", "cancelled", "max_batch", "max_queue", "timing"}: the engine's state now."""
        return {"running": len(self._rows), "waiting": len(self._jobs) + len(self._ready),
                "cancelled": self.cancelled, "max_batch": self.max_batch, "max_queue": self.max_queue,
                "timing": dict(self.timing)}

    def start(self) -> None:
        """Start the engine thread (nothing if it runs)."""
        if self._thread is None:
            self._stopping = False
            self._thread = threading.Thread(target=self._loop, name="ats-engine", daemon=True)
            self._thread.start()

    def drain(self, timeout: float) -> None:
        """Begin shutting down: take no new job (`submit` raises `ShuttingDown`); the jobs already taken, running or
        waiting, go on for up to `timeout` seconds, and those not done by then fail with
        `JobFailed(status=503)`. Calling it again keeps the earlier deadline.

        Args:
            timeout: the grace period in seconds (0: fail every job at once).
        """
        with self._cond:
            if self._drain_deadline is None:
                self._drain_deadline = time.monotonic() + max(0.0, float(timeout))
                self._drain_timeout = float(timeout)
                stats = self.stats()  # (counts only: the engine thread changes its queues as this runs)
                logger.info("shutting down: the requests in flight (%d sequence(s) running, %d waiting) get up to %g "
                            "s to finish", stats["running"], stats["waiting"], timeout)
            self._cond.notify()

    @property
    def draining(self) -> bool:
        """Whether `drain` was called (the engine takes no new job)."""
        return self._drain_deadline is not None

    def stop(self, timeout: float = 30.0) -> None:
        """Ask the engine thread to stop and wait up to `timeout` seconds for it; every job still there fails with
        status 503."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None
        self._fail_all(SHUTTING_DOWN_MESSAGE)

    def _fail_all(self, message: str) -> None:
        """Fail every job the engine holds (running, ready or waiting) with status 503, and every pending call."""
        for job in {s.job for s in self._rows} | {s.job for s in self._ready} | set(self._jobs):
            job.emit(JobFailed(message, status=503))
            job.cancelled = True
        with self._cond:
            calls, self._calls = list(self._calls), deque()
        for _, future in calls:
            if future.set_running_or_notify_cancel():
                future.set_exception(ShuttingDown(message))
        self.decoder.reset()
        self._ready.clear()
        with self._cond:
            self._jobs.clear()

    # --- the engine thread ----------------------------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._stopping and not (self._rows or self._ready or self._jobs or self._calls):
                    self._cond.wait()
                if self._stopping:
                    return
            if self._past_drain_deadline():
                self._fail_all(f"the server shut down before this request finished (running requests were given "
                               f"{self._drain_timeout:g} s); send it again")
                continue
            self._run_calls()
            try:
                self.step()
            except Exception:  # never let the worker die; step() already failed the jobs concerned
                logger.exception("engine step failed")

    def _past_drain_deadline(self) -> bool:
        return self._drain_deadline is not None and time.monotonic() >= self._drain_deadline

    @torch.no_grad()
    def step(self) -> bool:
        """Drop cancelled rows, admit and prefill waiting sequences, run one decoding step, retire finished rows;
        False when there was nothing to do (no sequence waited or ran)."""
        self.decoder.retire()
        admitted = self._admit()
        if admitted:
            try:
                self.decoder.add(admitted)
            except Exception as err:
                self._fail({s.job for s in admitted}, err)
            self.decoder.retire()  # rows that finished at prefill (max_tokens 1, a first token that ends) are done
        decoded = bool(self._rows)
        if decoded:
            try:
                self.decoder.step()
            except Exception as err:
                self._fail({s.job for s in self._rows}, err)
                self.decoder.reset()
        self.decoder.retire()
        return bool(admitted) or decoded  # (the batch may have just drained, with jobs still waiting)

    def _fail(self, jobs: set[Job], err: Exception) -> None:
        logger.error("generation failed for %d request(s): %s", len(jobs), err, exc_info=err)
        for job in jobs:
            job.emit(JobFailed(f"generation failed: {type(err).__name__}: {err}"))
            job.cancelled = True

    def _admit(self) -> list[_Sequence]:
        free, out = self.max_batch - len(self._rows), []
        while len(out) < free:
            if not self._ready:
                with self._cond:
                    if not self._jobs:
                        break
                    job = self._jobs.popleft()
                if job.cancelled:
                    continue
                try:
                    job._remaining = len(job.prompts) * job.n
                    job._generator = job.sampling.generator()
                    self._ready.extend([_Sequence(job, p, p * job.n + j, self.tokenizer)
                                        for p in range(len(job.prompts)) for j in range(job.n)])
                except Exception as err:  # a job that cannot start fails alone; it must not wait forever
                    self._fail({job}, err)
                continue
            seq = self._ready.popleft()
            if not seq.job.cancelled:
                out.append(seq)
        return out

    def _release(self, seq: _Sequence) -> None:
        """The decoder's `on_token`: send the job what its row can release now (and the scored prompt first)."""
        if seq.prompt_scores is not None:
            seq.job.emit(PromptScored(seq.index, seq.prompt_scores))
            seq.prompt_scores = None
        done = seq.tracker.sent_tokens
        text, n = seq.tracker.release(final=seq.finish is not None)
        tokens = seq.records[done: done + n]
        for record, offset in zip(tokens, seq.tracker.offsets[done: done + n]):
            record.offset = min(offset, len(seq.tracker.text))
        finish = None if seq.finish is None else "length" if seq.finish == "length" else "stop"
        if tokens or text or finish:
            seq.job.emit(Generated(seq.choice, tokens, text, finish))
        if finish is not None:
            seq.job._remaining -= 1
            if seq.job._remaining == 0:
                seq.job.emit(JobDone())
