"""The batching engine: one worker thread owns the model and decodes every running sequence together.

Requests (`Job`s: prompts x n sequences) wait in a bounded queue. Between two decoding steps the engine admits as many
waiting sequences as there are free rows (`max_batch`), prefills them as one left-padded batch (the prompts once, rows
repeated for n > 1), samples their first token and joins them to the running batch (`BatchCache.extend`). Each step
then feeds every running row its last token, one forward pass for all, runs the ATS head on the new position (the
transformer head extends its own KV cache), and chooses each row's next token from the calibrated logits
`q = z * s` with that request's sampling options. Finished and cancelled rows leave before the next step.

Results go out as events through each job's `sink` (called on the engine thread; the server hands them to its event
loop): `PromptScored` (echoed prompt log-probabilities), `Generated` (released tokens and text of one choice, with
its finish reason at the end), then `JobDone`, or `JobFailed` when the model raised. The engine never waits for a
client: a slow reader only lets its own events pile up, and a cancelled job (client gone) frees its rows at the next
step.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from ..calibrators.ats import ATSCalibrator
from ..errors import ATSError
from ..generation import eos_ids
from ..model.backbone import Backbone
from ..model.heads import TransformerHead
from .kv import BatchCache, check_full_attention
from .logprobs import TokenLogprob, prompt_logprobs, records, score
from .sampling import SamplingParams, choose
from .text import TextTracker

logger = logging.getLogger(__name__)


class QueueFull(RuntimeError):
    """The engine's queue of waiting requests is full (the server answers 503)."""


class ContextLengthExceeded(ATSError):
    """A prompt plus its new tokens do not fit in the model's context."""


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
    """The job's last event when the engine failed on it: `message` says why."""

    message: str


@dataclass(eq=False)
class Job:
    """One request: `prompts` (token ids), each continued `n` times (choice index = prompt * n + replica).

    max_tokens: new tokens per choice (0: only score the prompt); top_logprobs: alternatives reported per token;
    prompt_logprobs: also score every prompt token (echo); ignore_eos: keep going after end-of-sequence tokens.
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


class _Sequence:
    """One choice being generated: its tokens' records, text and the sampled token not yet fed to the model."""

    def __init__(self, job: Job, prompt: int, choice: int, tokenizer) -> None:
        self.job, self.prompt, self.choice = job, prompt, choice
        self.tracker = TextTracker(tokenizer, job.stop)
        self.records: list[TokenLogprob] = []
        self.pending = -1
        self.finish: str | None = None

    @property
    def live(self) -> bool:
        return self.finish is None and not self.job.cancelled


class Engine:
    """Continuous batching of calibrated generation over `backbone` (`calibrator` None: the model's own
    probabilities, tau = 0). `max_batch` rows decode together; `max_queue` requests may wait; prompts plus new
    tokens must fit in `max_model_len` (default: the model's `max_position_embeddings`).

    Args:
        backbone: the frozen backbone; its layers must all use full attention.
        calibrator: the ATS calibrator, checked against the backbone and moved to its device; None: uncalibrated.
        max_batch: rows decoded together.
        max_queue: jobs that may wait.
        max_model_len: the context limit, at most the model's; None: the model's (2048 if it names none).

    Raises:
        ATSError: if the calibrator does not fit the backbone or a layer does not use full attention.
    """

    def __init__(self, backbone: Backbone, calibrator: ATSCalibrator | None = None, *, max_batch: int = 16,
                 max_queue: int = 64, max_model_len: int | None = None) -> None:
        if calibrator is not None:
            calibrator.check_backbone(backbone)
            calibrator.to(backbone.device)
            calibrator.head.eval()
        self.backbone, self.calibrator = backbone, calibrator
        self.tokenizer = backbone.tokenizer
        self.num_layers = check_full_attention(backbone.model.config)
        self.max_batch, self.max_queue = int(max_batch), int(max_queue)
        limit = getattr(backbone.model.config, "max_position_embeddings", None) or 2048
        self.max_model_len = int(min(max_model_len, limit) if max_model_len else limit)
        self.eos = eos_ids(backbone)
        self.head_cached = calibrator is not None and isinstance(calibrator.head, TransformerHead)
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        self._jobs: deque[Job] = deque()
        self._ready: deque[_Sequence] = deque()
        self._rows: list[_Sequence] = []
        self._batch = self._new_batch()
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self.cancelled = 0  # jobs cancelled before they finished (clients gone)
        self.timing = {"decode_steps": 0, "decode_rows": 0, "decode_s": 0.0, "head_s": 0.0}  # cumulative

    @property
    def calibrated(self) -> bool:
        """Whether an ATS calibrator scales the logits."""
        return self.calibrator is not None

    def _new_batch(self) -> BatchCache:
        return BatchCache(self.num_layers, head=self.head_cached)

    # --- the request side (any thread) ----------------------------------------------------------------------------
    def check(self, job: Job) -> None:
        """Refuse a job that cannot run.

        Args:
            job: the job to check.

        Raises:
            ATSError: naming the prompt, if one is empty or has a token id outside the vocabulary;
                `ContextLengthExceeded` if prompt + max_tokens is over the context.
        """
        vocab = self.backbone.vocab_size
        for i, prompt in enumerate(job.prompts):
            if not prompt:
                raise ATSError(f"prompt {i}: empty (no tokens)")
            bad = [t for t in prompt if not 0 <= t < vocab]
            if bad:
                raise ATSError(f"prompt {i}: token id {bad[0]} is outside the vocabulary (0..{vocab - 1})")
            if len(prompt) + job.max_tokens > self.max_model_len:
                raise ContextLengthExceeded(f"this model's maximum context length is {self.max_model_len} tokens, but "
                                            f"prompt {i} has {len(prompt)} tokens and max_tokens is {job.max_tokens}")

    def submit(self, job: Job) -> None:
        """Queue `job`, checked first (see `check`).

        Args:
            job: the job; its events go to its sink.

        Raises:
            ATSError: as `check`.
            QueueFull: if `max_queue` jobs already wait.
        """
        self.check(job)
        with self._cond:
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

    def stop(self, timeout: float = 30.0) -> None:
        """Ask the engine thread to stop and wait up to `timeout` seconds for it."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None
        for job in {s.job for s in self._rows} | {s.job for s in self._ready} | set(self._jobs):
            job.emit(JobFailed("the server is shutting down"))
        self._rows, self._batch = [], self._new_batch()
        self._ready.clear()
        self._jobs.clear()

    # --- the engine thread ----------------------------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._stopping and not (self._rows or self._ready or self._jobs):
                    self._cond.wait()
                if self._stopping:
                    return
            try:
                self.step()
            except Exception:  # never let the worker die; step() already failed the jobs concerned
                logger.exception("engine step failed")

    @torch.no_grad()
    def step(self) -> bool:
        """Drop cancelled rows, admit and prefill waiting sequences, run one decoding step, retire finished rows;
        False when there was nothing to do."""
        self._retire()
        admitted = self._admit()
        if admitted:
            try:
                self._prefill(admitted)
            except Exception as err:
                self._fail({s.job for s in admitted}, err)
        if self._rows:
            try:
                self._decode()
            except Exception as err:
                self._fail({s.job for s in self._rows}, err)
                self._rows, self._batch = [], self._new_batch()
        self._retire()
        return bool(admitted or self._rows)

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
                job._remaining = len(job.prompts) * job.n
                job._generator = job.sampling.generator()
                self._ready.extend(_Sequence(job, p, p * job.n + j, self.tokenizer)
                                   for p in range(len(job.prompts)) for j in range(job.n))
                continue
            seq = self._ready.popleft()
            if not seq.job.cancelled:
                out.append(seq)
        return out

    def _tau(self, hidden: Tensor, mask: Tensor, cache) -> Tensor:
        """tau (B, T) of the new positions `hidden` (B, T, H); `mask` (B, L) covers the cached and new positions."""
        B, T = hidden.shape[:2]
        if self.calibrator is None:
            return torch.zeros(B, T, device=hidden.device)
        if self.head_cached:
            return self.calibrator.temperature(hidden, mask, cache=cache).float()
        return self.calibrator.temperature(hidden, mask[:, mask.shape[1] - T:]).float()

    def _scale(self, tau: Tensor) -> Tensor | None:
        return None if self.calibrator is None else self.calibrator.scale(tau).float()

    def _prefill(self, seqs: list[_Sequence]) -> None:
        """One forward pass over the distinct prompts of `seqs` (left-padded); score echoed prompts; sample each
        sequence's first token; join the rows to the running batch."""
        rows: dict[tuple[int, int], int] = {}
        firsts: list[_Sequence] = []
        for seq in seqs:
            if rows.setdefault((id(seq.job), seq.prompt), len(firsts)) == len(firsts):
                firsts.append(seq)
        prompts = [s.job.prompts[s.prompt] for s in firsts]
        P, device = max(len(p) for p in prompts), self.backbone.device
        ids = torch.full((len(prompts), P), self.pad_id, dtype=torch.long)
        mask = torch.zeros(len(prompts), P, dtype=torch.long)
        for i, prompt in enumerate(prompts):
            ids[i, P - len(prompt):] = torch.tensor(prompt)
            mask[i, P - len(prompt):] = 1
        ids, mask = ids.to(device), mask.to(device)
        batch = self._new_batch()
        batch.mask = mask
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        hidden, _ = self.backbone.forward(ids, mask, past_key_values=batch.kv, use_cache=True, position_ids=positions)
        tau = self._tau(hidden, mask, batch.head)  # (G, P)
        scale = self._scale(tau)
        for g, first in enumerate(firsts):
            job = first.job
            if job.prompt_logprobs and first.prompt not in job._scored:
                job._scored.add(first.prompt)
                n = len(prompts[g])
                scored = prompt_logprobs(self.backbone.logits, hidden[g, P - n:],
                                         None if scale is None else scale[g, P - n:], tau[g, P - n:], prompts[g],
                                         job.top_logprobs)
                job.emit(PromptScored(first.prompt, scored))
        live = [s for s in seqs if s.job.max_tokens > 0]
        for seq in seqs:
            if seq.job.max_tokens == 0:
                self._finish(seq, "length")
        if not live:
            return
        index = torch.tensor([rows[(id(s.job), s.prompt)] for s in live], device=device)
        z = self.backbone.logits(hidden[:, -1]).float().index_select(0, index)  # (B, V)
        last_tau = tau[:, -1].index_select(0, index)
        if index.tolist() != list(range(len(firsts))):
            batch.select(index)
        self._advance(live, z, last_tau)
        self._rows += live
        self._batch.extend(batch)

    def _decode(self) -> None:
        """Feed every running row its last token; choose the next ones. `timing` adds up the decoding steps' time
        and the head's share of it (tau), a measure of the calibration's cost that machine load does not skew."""
        started = time.perf_counter()
        ids = torch.tensor([[s.pending] for s in self._rows], device=self.backbone.device)
        mask = self._batch.append_column()
        hidden, _ = self.backbone.forward(ids, mask, past_key_values=self._batch.kv, use_cache=True,
                                          position_ids=self._batch.next_positions())
        z = self.backbone.logits(hidden[:, -1]).float()  # (B, V)
        head_started = time.perf_counter()
        tau = self._tau(hidden, mask, self._batch.head)[:, -1]
        head_s = time.perf_counter() - head_started
        self._advance(self._rows, z, tau)
        self.timing["decode_steps"] += 1
        self.timing["decode_rows"] += len(self._rows)
        self.timing["decode_s"] += time.perf_counter() - started
        self.timing["head_s"] += head_s

    def _advance(self, seqs: list[_Sequence], z: Tensor, tau: Tensor) -> None:
        """Choose each row's next token from q = z * s (z (B, V), tau (B,)), score it, and hand it to its sequence."""
        scale = self._scale(tau)
        q = z if scale is None else z * scale[:, None]
        jobs = [s.job for s in seqs]
        tokens = choose(q, [j.sampling for j in jobs], [j._generator for j in jobs])
        k = max(j.top_logprobs for j in jobs)
        logp_q, logp_z, top_ids, top_logp = score(z, scale, tokens, k)
        for seq, record in zip(seqs, records(tokens.tolist(), logp_q, logp_z, tau, top_ids, top_logp)):
            del record.top[seq.job.top_logprobs:]
            self._append(seq, record)

    def _append(self, seq: _Sequence, record: TokenLogprob) -> None:
        seq.records.append(record)
        seq.pending = record.token
        if seq.tracker.add(record.token):
            del seq.records[len(seq.tracker.ids):]
            seq.finish = "stop"
        elif record.token in self.eos and not seq.job.ignore_eos:
            seq.finish = "stop"
        elif len(seq.records) >= seq.job.max_tokens:
            seq.finish = "length"
        self._release(seq)

    def _release(self, seq: _Sequence) -> None:
        done = seq.tracker.sent_tokens
        text, n = seq.tracker.release(final=seq.finish is not None)
        tokens = seq.records[done: done + n]
        for record, offset in zip(tokens, seq.tracker.offsets[done: done + n]):
            record.offset = min(offset, len(seq.tracker.text))
        if tokens or text or seq.finish:
            seq.job.emit(Generated(seq.choice, tokens, text, seq.finish))
        if seq.finish is not None:
            seq.job._remaining -= 1
            if seq.job._remaining == 0:
                seq.job.emit(JobDone())

    def _finish(self, seq: _Sequence, reason: str) -> None:
        seq.finish = reason
        self._release(seq)

    def _retire(self) -> None:
        keep = [i for i, s in enumerate(self._rows) if s.live]
        if len(keep) == len(self._rows):
            return
        if keep:
            self._batch.select(torch.tensor(keep, device=self.backbone.device))
            self._rows = [self._rows[i] for i in keep]
            self._batch.trim()
        else:
            self._rows, self._batch = [], self._new_batch()
