"""`CalibrationProcessor`: the `LogitsProcessor` that puts the ATS head inside transformers' `generate`.

Two forward hooks feed it: one on the base model captures the final hidden states of the positions each forward pass
processed (the whole prompt on the prefill step, then one position per decoding step), one on the output embedding
captures the raw logits `z` of the last position. Each step it runs the head on the new position(s) (the transformer
head extends its `HeadCache`, so a step costs one position attending over the cached keys) and returns
`scores * s`, `s = exp(tau).clamp(max_scale) > 0`: greedy output is unchanged and sampling draws from the calibrated
distribution. It also keeps what is needed to report each chosen token's calibrated and uncalibrated probability
(see `flush`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor
from transformers import LogitsProcessor

from ..calibrators.ats import ATSCalibrator
from ..errors import ATSError
from ..model.heads import HeadCache, TransformerHead
from ..model.numerics import chosen_log_probs


class CalibrationProcessor(LogitsProcessor):
    """Multiplies each step's scores by `s = exp(tau)` from the ATS head, fed by forward hooks (see `attach`).

    Put it first in the `LogitsProcessorList` given to `generate`. One instance serves one `generate` call.

    The chosen tokens' probabilities are computed in batches of `flush_every` steps (their raw logits are kept until
    then): a vocabulary-wide log-normaliser is a dozen small operations, and at batch 1 their fixed cost exceeds
    their arithmetic, so one call on K steps is far cheaper than K calls on one. Batching stops paying once the kept
    logits no longer fit in cache: every deferred step is read back from memory. None picks 1 when `on_record`
    streams tokens (no delay) and otherwise as many steps as fit in 2 MiB, at most 16 (SmolLM2: 10 at batch 1,
    1 at batch 8).

    Args:
        calibrator: the fitted ATS calibrator whose head gives tau.
        prompt_mask: (B, P) attention mask of the left-padded prompts.
        softcap: the backbone's final-logit softcap, applied to the raw logits the hook captures; None: none.
        on_record: called per step with (tokens (B,), logp_q (B,), logp_z (B,), tau (B,)) once the
            step's probabilities are computed (e.g. a `Streamer`).
        flush_every: steps per probability computation; None: chosen as above.
    """

    def __init__(self, calibrator: ATSCalibrator, prompt_mask: Tensor, *, softcap: float | None = None,
                 on_record: Callable[[Tensor, Tensor, Tensor, Tensor], None] | None = None,
                 flush_every: int | None = None) -> None:
        self.calibrator = calibrator
        self.mask = prompt_mask.long()  # (B, P) prompt mask, then a buffer with room for generated columns (ones)
        self.softcap = softcap
        self.on_record = on_record
        self.flush_every = flush_every
        self.uses_cache = isinstance(calibrator.head, TransformerHead)
        self.cache = HeadCache() if self.uses_cache else None
        self.seen = 0  # positions already passed through the head
        self.hidden: Tensor | None = None  # set by the base-model hook: (B, T_new, H)
        self.raw: Tensor | None = None  # set by the output-embedding hook: (B, T_out, V)
        self.taus: list[Tensor] = []  # per step (B,)
        self.logp_q: list[Tensor] = []  # per step (B,), log-prob of the chosen token, calibrated
        self.logp_z: list[Tensor] = []  # per step (B,), uncalibrated
        self._pending: list[tuple[Tensor, Tensor]] = []  # (z (B, V), s (B,)) of steps after those in logp_q
        self._tokens: list[Tensor] = []  # (B,) chosen tokens of the first pending steps

    # hooks ----------------------------------------------------------------------------------------------------------
    def attach(self, model) -> list:
        """Register the two forward hooks on a HF causal LM.

        Args:
            model: the causal LM `generate` runs (its base model and output embedding are hooked).

        Returns:
            The two hook handles (call `.remove()` on each after `generate`).
        """

        def on_base(module, args, output):
            hidden = getattr(output, "last_hidden_state", None)
            self.hidden = hidden if hidden is not None else output[0]

        def on_head(module, args, output):
            self.raw = output

        return [model.base_model.register_forward_hook(on_base),
                model.get_output_embeddings().register_forward_hook(on_head)]

    # steps ----------------------------------------------------------------------------------------------------------
    @property
    def steps(self) -> int:
        """The number of decoding steps seen so far."""
        return len(self.taus)

    def _flush_size(self, z: Tensor) -> int:
        if self.flush_every is not None:
            return max(1, int(self.flush_every))
        if self.on_record is not None:
            return 1
        return max(1, min(16, (2 << 20) // max(1, z.numel() * z.element_size())))

    def flush(self) -> None:
        """Compute the log-probabilities of every pending step whose chosen token is known (see `chosen_log_probs`)."""
        m = len(self._tokens)
        if m == 0:
            return
        steps, self._pending = self._pending[:m], self._pending[m:]
        if m == 1:  # (1, B, ...) views, no copy
            z, s, tokens = steps[0][0][None], steps[0][1][None], self._tokens[0][None]
        else:
            z = torch.stack([step[0] for step in steps])  # (m, B, V)
            s = torch.stack([step[1] for step in steps])  # (m, B)
            tokens = torch.stack(self._tokens)  # (m, B)
        self._tokens = []
        if tokens.device != z.device or tokens.dtype != torch.long:
            tokens = tokens.to(z.device, torch.long)
        logp_z, logp_q = chosen_log_probs(z, s, tokens)  # (m, B) each
        for i in range(m):
            self.logp_z.append(logp_z[i])
            self.logp_q.append(logp_q[i])
            if self.on_record is not None:
                self.on_record(tokens[i], logp_q[i], logp_z[i], self.taus[len(self.logp_q) - 1])

    def _attention_mask(self, B: int, L: int, device: torch.device) -> Tensor:
        """The mask (B, L) of prompt + generated positions: a view of a buffer that doubles when full (generated
        tokens are real, so every column after the prompt is 1)."""
        if self.mask.shape[0] != B:  # num_return_sequences > 1: rows repeated per prompt
            if B % self.mask.shape[0]:
                raise ATSError(f"calibrated generation: batch of {B} rows for {self.mask.shape[0]} prompts")
            self.mask = self.mask.repeat_interleave(B // self.mask.shape[0], dim=0)
        if self.mask.device != device:
            self.mask = self.mask.to(device)
        if self.mask.shape[1] < L:
            grown = self.mask.new_ones(B, max(L, 2 * self.mask.shape[1]))
            grown[:, : self.mask.shape[1]] = self.mask
            self.mask = grown
        return self.mask[:, :L]

    @torch.no_grad()
    def __call__(self, input_ids: Tensor, scores: Tensor) -> Tensor:
        B, L = input_ids.shape
        if self.steps > len(self.logp_q) + len(self._tokens):  # the previous step's token is the last input id
            self._tokens.append(input_ids[:, -1])
        mask = self._attention_mask(B, L, input_ids.device)
        if self.hidden is None:
            raise ATSError("calibrated generation: no hidden state captured for this step (forward hook not attached)")
        new = L - self.seen
        hidden = self.hidden
        if self.uses_cache:
            if hidden.shape[1] < new:
                raise ATSError(f"calibrated generation: expected hidden states for {new} new positions, got "
                               f"{hidden.shape[1]}")
            tau = self.calibrator.temperature(hidden[:, hidden.shape[1] - new:], mask, cache=self.cache)[:, -1]
        else:  # per-token heads (linear, mlp) only need the last position
            tau = self.calibrator.temperature(hidden[:, -1:], mask)[:, -1]
        self.seen = L
        s = self.calibrator.scale(tau)  # (B,)
        if s.device != scores.device or s.dtype != torch.float32:
            s = s.to(scores.device, torch.float32)
        if self.raw is None:
            z = scores.clone()  # (B, V) kept until flushed
        else:  # the model's own logits; a copy if the output holds more positions than the last (no logits_to_keep)
            z = self.raw[:, -1] if self.raw.shape[1] == 1 else self.raw[:, -1].clone()
        if z.device != scores.device or z.dtype != torch.float32:
            z = z.to(scores.device, torch.float32)
        if self.raw is not None and self.softcap:
            z = torch.tanh(z / self.softcap) * self.softcap
        self._pending.append((z, s))
        self.taus.append(tau if tau.device == scores.device else tau.to(scores.device))
        self.hidden = self.raw = None
        if len(self._tokens) >= self._flush_size(z):
            self.flush()
        return scores * (s[:, None] if scores.dtype == torch.float32 else s[:, None].to(scores.dtype))

    def finish(self, new_tokens: Tensor) -> None:
        """After `generate`: drop steps it undid and compute the remaining steps' probabilities.

        Args:
            new_tokens: (B, N) the generated tokens `generate` returned (the chosen tokens of the pending steps).
        """
        n = new_tokens.shape[1]
        done = len(self.logp_q)
        del self.taus[n:], self.logp_q[n:], self.logp_z[n:]
        self._pending = self._pending[: max(0, n - done)]
        self._tokens = [new_tokens[:, i] for i in range(min(done, n), min(done, n) + len(self._pending))]
        self.flush()
