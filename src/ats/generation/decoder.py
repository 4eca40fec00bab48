"""The decoding core: batched prefill and decoding with the backbone's KV cache and the calibrator's state, rows that
join and leave between steps. `generate_calibrated` (the Python API and `ats generate`), the lm-eval model's
`generate_until` and the server's engine (`ats serve`, continuous batching) all decode through a `Decoder`.

- `add(rows)` prefills new rows as one left-padded batch (a prompt once, rows repeated for n > 1), runs the
  calibrator's prefill (the transformer head fills its KV cache; Thermometer reads the prompt's last hidden state),
  scores echoed prompts, chooses each row's first token and joins the rows to the running batch (`BatchCache.extend`).
- `step()` feeds every row its last token in one forward pass, runs the calibrator on the new position and chooses
  each row's next token from the calibrated logits with that row's sampling options (`sampling.choose`).
- `retire()` drops finished and cancelled rows and the columns that became padding in every row.

RoPE positions come from each row's own count of tokens and padding is never attended to, so a sequence gets the same
values whatever batch it runs in. Each chosen token becomes a `TokenLogprob` (calibrated and uncalibrated
log-probabilities, tau, confidence) appended to its row, whose `TextTracker` decodes the text incrementally and finds
stop strings; `on_token(row)` then tells the owner (streaming, the server's events).

With a correctness probe that reads layers, the forward passes also capture those layers (`LayerCapture`): at the
prompt's last position at prefill, then at each answer token as it is fed (`RunningAnswerViews`), so a finished
answer's P(correct) needs no pass of its own. An answer whose last token was never fed (cut by max_tokens) stays in
the batch one more step to feed it; only then is it finished and handed to `on_token`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable, Sequence
from contextlib import nullcontext

import torch
from torch import Tensor

from ..calibrators.base import Calibrator
from ..model.backbone import Backbone
from ..model.layers import LayerCapture, RunningAnswerViews
from .batch import BatchCache, check_attention
from .calibration import DecodingCalibration, StepLogits
from .logprobs import TokenLogprob, prompt_logprobs, records, score
from .sampling import SamplingParams, choose
from .text import TextTracker


def eos_ids(backbone: Backbone) -> set[int]:
    """The end-of-sequence token ids of the generation config, the model config and the tokenizer.

    Args:
        backbone: the backbone whose configs and tokenizer are read.

    Returns:
        The union of their ids (empty when none names one).
    """
    ids: set[int] = set()
    for source in (getattr(backbone.model, "generation_config", None), backbone.model.config, backbone.tokenizer):
        eos = getattr(source, "eos_token_id", None)
        if eos is None:
            continue
        ids.update(int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos]))
    return ids


class Row:
    """One sequence being generated: its options, its tokens' records and text, the token not yet fed to the model.

    Args:
        prompt: the prompt's token ids.
        key: rows with equal keys share one prompt (prefilled once, e.g. the n choices of a request).
        max_tokens: new tokens at most (0: only score the prompt).
        sampling: temperature / top-k / top-p.
        generator: the row's random generator; None: the global one.
        stop: stop strings (the text is cut before the first).
        top_logprobs: alternatives reported per token.
        ignore_eos: keep going after end-of-sequence tokens.
        min_tokens: end-of-sequence tokens cannot be chosen before this many new tokens.
        score_prompt: report every prompt token's probabilities (`prompt_scores`).
    """

    def __init__(self, prompt: list[int], key: Hashable, tokenizer, *, max_tokens: int,
                 sampling: SamplingParams = SamplingParams(), generator: torch.Generator | None = None,
                 stop: Sequence[str] = (), top_logprobs: int = 0, ignore_eos: bool = False, min_tokens: int = 0,
                 score_prompt: bool = False) -> None:
        self.prompt, self.key = prompt, key
        self.max_tokens, self.sampling, self.generator = max_tokens, sampling, generator
        self.top_logprobs, self.ignore_eos, self.min_tokens = top_logprobs, ignore_eos, min_tokens
        self.score_prompt = score_prompt
        self.tracker = TextTracker(tokenizer, stop)
        self.records: list[TokenLogprob] = []
        self.generated: list[int] = []  # every chosen token, also those a stop string cut off
        self.prompt_scores: list[TokenLogprob] | None = None
        self.pending = -1
        self.finish: str | None = None  # "eos" | "stop" (a stop string) | "length"
        self.cancelled = False
        self.answer_states: RunningAnswerViews | None = None  # a correctness probe's layers at the answer so far
        self.held_finish: str | None = None  # a finish held back one step, until the answer's last token is fed

    @property
    def live(self) -> bool:
        """Whether the row still decodes (not finished, not cancelled)."""
        return self.finish is None and not self.cancelled


GREEDY = SamplingParams(temperature=0)


def _sampling(row: Row) -> SamplingParams:
    """The row's sampling options; greedy for a row held one step to be fed its last token (its choice is dropped,
    and it draws nothing from a shared random generator)."""
    return GREEDY if row.held_finish is not None else row.sampling


class Decoder:
    """Batched calibrated decoding over `backbone` with any calibrator (see the module docstring).

    Args:
        backbone: the frozen backbone; its layers must all use full or sliding-window attention.
        calibrator: any loaded calibrator, or None for the model's own probabilities.
        on_token: called with a row after each token it gets (and once when it finishes while prefilling with
            max_tokens 0); None: nothing.
        logits_processors: transformers `LogitsProcessor`s applied to the calibrated logits before sampling (they
            see the rows' left-padded token ids); they shape the choice only, not the reported probabilities.

    Raises:
        ATSError: if the calibrator does not fit the backbone or a layer uses neither full nor sliding-window attention.
    """

    def __init__(self, backbone: Backbone, calibrator: Calibrator | None = None, *,
                 on_token: Callable[[Row], None] | None = None, logits_processors: Sequence = ()) -> None:
        self.backbone = backbone
        self.calibration = DecodingCalibration(calibrator, backbone)
        self.num_layers = check_attention(backbone.model.config)
        self.eos = eos_ids(backbone)
        self.pad_id = backbone.tokenizer.pad_token_id if backbone.tokenizer.pad_token_id is not None else 0
        self.on_token = on_token
        self.processors = list(logits_processors)
        self.rows: list[Row] = []
        self.batch = self._new_batch()
        # cumulative: decoding steps, rows, their seconds, the calibrator's seconds in them (head_s) and the scoring's
        self.timing = {"decode_steps": 0, "decode_rows": 0, "decode_s": 0.0, "head_s": 0.0, "score_s": 0.0}

    def _new_batch(self) -> BatchCache:
        return BatchCache(self.num_layers, head=self.calibration.head_cached)

    def reset(self) -> None:
        """Forget every row (e.g. after a failure)."""
        self.rows, self.batch = [], self._new_batch()

    # --- prefill --------------------------------------------------------------------------------------------------
    @torch.no_grad()
    def add(self, rows: Sequence[Row]) -> None:
        """Prefill `rows` together and join those that generate to the running batch.

        Args:
            rows: new rows; rows with equal keys share one prompt.
        """
        slot: dict[Hashable, int] = {}
        firsts: list[Row] = []
        for row in rows:
            if slot.setdefault(row.key, len(firsts)) == len(firsts):
                firsts.append(row)
        prompts = [r.prompt for r in firsts]
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
        with self._capture() as capture:
            hidden, _ = self.backbone.forward(ids, mask, past_key_values=batch.kv, use_cache=True,
                                              position_ids=positions)
            prompt_last = capture.take(-1) if capture else None  # (G, L, H): the probe's layers, prompts' ends
        if prompt_last is not None:
            for row in rows:
                row.answer_states = RunningAnswerViews(prompt_last[slot[row.key]])
        tau = self.calibration.prefill(hidden, mask, batch)  # (G, P) or None
        state = batch.rows_state  # (G, H) or None
        for g, first in enumerate(firsts):
            if first.score_prompt:
                n = len(prompts[g])
                first.prompt_scores = prompt_logprobs(self.backbone, self.calibration, hidden[g, P - n:],
                                                      None if tau is None else tau[g, P - n:],
                                                      None if state is None else state[g], prompts[g],
                                                      first.top_logprobs)
        for row in rows:
            if row.max_tokens == 0:
                row.finish = "length"
                if self.on_token is not None:
                    self.on_token(row)
        live = [r for r in rows if r.max_tokens > 0]
        if not live:
            return
        index = torch.tensor([slot[r.key] for r in live], device=device)
        z = self.backbone.logits(hidden[:, -1]).index_select(0, index)  # (B, V)
        last_tau = None if tau is None else tau[:, -1].index_select(0, index)
        if index.tolist() != list(range(len(firsts))):
            batch.select(index)
        self._advance(live, self.calibration.logits(z, last_tau, batch.rows_state))
        self.rows += live
        self.batch.extend(batch)

    # --- decoding ---------------------------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self) -> None:
        """Feed every row its last token and choose the next ones. `timing` adds up the steps' time, the
        calibrator's share of it (the head's tau, or the logits map) and the scoring's (the chosen tokens'
        calibrated and uncalibrated log-probabilities): measures of the calibration's cost that machine load does
        not skew."""
        if not self.rows:
            return
        started = time.perf_counter()
        ids = torch.tensor([[r.pending] for r in self.rows], device=self.backbone.device)
        mask = self.batch.append_column()
        with self._capture() as capture:
            hidden, _ = self.backbone.forward(ids, mask, past_key_values=self.batch.kv, use_cache=True,
                                              position_ids=self.batch.next_positions())
            if capture:  # the probe's layers at the tokens just fed: each row's latest answer token
                for row, state in zip(self.rows, capture.take(-1)):  # (L, H) each
                    row.answer_states.add(state)
        z = self.backbone.logits(hidden[:, -1])  # (B, V)
        head_started = time.perf_counter()
        tau = self.calibration.step(hidden, mask, self.batch)
        step = self.calibration.logits(z, tau, self.batch.rows_state)
        head_s = time.perf_counter() - head_started
        self.timing["score_s"] += self._advance(self.rows, step)
        self.timing["decode_steps"] += 1
        self.timing["decode_rows"] += len(self.rows)
        self.timing["decode_s"] += time.perf_counter() - started
        self.timing["head_s"] += head_s

    def _capture(self) -> LayerCapture | nullcontext:
        """Hooks on a correctness probe's layers for one forward pass (nothing without a probe that reads layers),
        so its views of an answer are read as the answer is decoded, not by a second pass."""
        layers = self.calibration.probe_layers
        return LayerCapture(self.backbone.model, layers) if layers else nullcontext()

    def _choice_logits(self, rows: list[Row], step: StepLogits) -> tuple[Tensor, Tensor]:
        """(z, q) for the sampler: end-of-sequence masked in rows under their `min_tokens`, then the processors.
        Greedy rows read z only (q is built only for sampled rows or processors); with processors, every row
        chooses from their output on q (greedy rows its argmax), so a processor that bans a token bans it for
        greedy decoding too, as in transformers' `generate`."""
        needs_q = bool(self.processors) or any(not _sampling(r).greedy for r in rows)
        z, q = step.z, step.q if needs_q else step.z
        blocked = [i for i, r in enumerate(rows) if len(r.records) < r.min_tokens]
        if blocked and self.eos:
            z, q = z.clone(), q.clone()
            where = torch.tensor(blocked, device=z.device)[:, None]
            eos = torch.tensor(sorted(self.eos), device=z.device)[None]
            z[where, eos] = q[where, eos] = float("-inf")
        if self.processors:
            width = max(len(r.prompt) + len(r.records) for r in rows)
            ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
            for i, r in enumerate(rows):
                seq = r.prompt + [t.token for t in r.records]
                ids[i, width - len(seq):] = torch.tensor(seq)
            ids = ids.to(q.device)
            for processor in self.processors:
                q = processor(ids, q)
            return q, q
        return z, q

    def _advance(self, rows: list[Row], step: StepLogits) -> float:
        """Choose each row's next token, score it, and hand it to its row; returns the seconds spent scoring."""
        z, q = self._choice_logits(rows, step)
        tokens = choose(z, q, [_sampling(r) for r in rows], [r.generator for r in rows])
        k = max(r.top_logprobs for r in rows)
        started = time.perf_counter()
        logp_q, logp_z, top_ids, top_logp = score(step, tokens, k)
        made = records(tokens.tolist(), logp_q, logp_z, step.tau, top_ids, top_logp,
                       self.calibration.confidence(logp_q))
        scored = time.perf_counter() - started
        for row, record in zip(rows, made):
            if row.held_finish is not None:  # its answer's last token was just fed: finish it; this token is not its
                row.finish, row.held_finish = row.held_finish, None
                self._probe(row)
                if self.on_token is not None:
                    self.on_token(row)
                continue
            del record.top[row.top_logprobs:]
            self._append(row, record)
        return scored

    def _append(self, row: Row, record: TokenLogprob) -> None:
        row.records.append(record)
        row.generated.append(record.token)
        row.pending = record.token
        if row.tracker.add(record.token):
            del row.records[len(row.tracker.ids):]
            row.finish = "stop"
        elif record.token in self.eos and not row.ignore_eos:
            record.answer = False
            row.finish = "eos"
        elif len(row.records) >= row.max_tokens:
            row.finish = "length"
        if row.finish is not None and row.records and self.calibration.answer_probe:
            states, answer_len = row.answer_states, sum(r.answer for r in row.records)
            if states is not None and states.fed + 1 == answer_len:  # its last token is the one not fed yet
                row.held_finish, row.finish = row.finish, None  # the next step feeds it, then finishes the row
                return
            self._probe(row)
        if self.on_token is not None:
            self.on_token(row)

    def _probe(self, row: Row) -> None:
        """Put the correctness probe's P(correct) on a finished row's last answer token."""
        last = next((r for r in reversed(row.records) if r.answer), row.records[-1])
        last.answer_probability = self.calibration.probe_answer(self.backbone, row.prompt, row.records,
                                                                row.answer_states)
        row.answer_states = None

    def retire(self) -> None:
        """Drop the rows that finished or were cancelled, and the columns that are now padding in every row."""
        keep = [i for i, r in enumerate(self.rows) if r.live]
        if len(keep) == len(self.rows):
            return
        if keep:
            self.batch.select(torch.tensor(keep, device=self.backbone.device))
            self.rows = [self.rows[i] for i in keep]
            self.batch.trim()
        else:
            self.reset()

    def run(self, rows: Sequence[Row]) -> None:
        """Decode `rows` to the end, all in one batch (the Python API).

        Args:
            rows: new rows.
        """
        self.add(rows)
        self.retire()
        while self.rows:
            self.step()
            self.retire()
