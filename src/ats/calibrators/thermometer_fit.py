"""How Thermometer is fitted: per prompt, the mean cross-entropy of its response tokens at the prompt's 1/T plus the
Gamma prior on T, minimised by the shared AdamW loop (`fit_loop`), from one of three views of the same tokens.

    loss = mean over sequences i of [ mean over i's response tokens CE(z_t / T_i, y_t)  +  lambda * R(T_i) ]
    R(T) = -log Gamma(T; alpha0, beta0) = -(alpha0 - 1) log T + T / beta0 + lgamma(alpha0) + alpha0 log beta0

(our token-level setting; the paper fits per-task temperatures on multiple-choice answer tokens, and regularises one
task-level temperature per batch where we regularise each prompt's.) Logits are never built for the whole data:

- `fit_sequences` recomputes them from hidden states in chunks (`ats.model.scaled_ce.scaled_cross_entropy`, exact
  gradient w.r.t. the per-token scale), one full-vocabulary pass per epoch;
- `fit_summary` (what `fit_source` uses when the features carry a scale summary) reads each token's summary row:
  CE = G(s) + s (z_top - z_y) with G from the summary's piecewise quintic, no pass over the vocabulary at all (the
  summary covers s <= its max_scale, T >= 0.1 by default: a prompt whose 1/T goes beyond it is evaluated at
  max_scale, and counted as `beyond_summary_`);
- `fit_sketch` (what `fit_source` uses otherwise, when the source has a sketch) reads each token's `LogitSketch`:
  after the sketch's one shared pass, every epoch costs K + B terms per token instead of V.
"""

from __future__ import annotations

import logging
import math
from typing import Callable

import torch
from torch import Tensor

from ..errors import ATSError
from ..model.labels import IGNORE_INDEX
from ..model.scale_summary import SummaryView, scaled_ce_from_summary
from ..model.scaled_ce import scaled_cross_entropy
from .fit_loop import fit_loop
from .thermometer_net import prompt_positions, prompt_states

logger = logging.getLogger(__name__)


class ThermometerFit:
    """The fitting routes of `Thermometer` (mixed into it: it uses `net`, `inverse_temperature`, `prior` and the
    options of `ThermometerConfig`)."""

    # --- the routes `fit_source` takes (`Calibrator.fit_source`) ---------------------------------------------------
    def fit_source_summary(self, source, summary: Tensor) -> "ThermometerFit":
        """The scale-summary route: `fit_summary` on the source's prompts and summary rows."""
        return self.fit_summary(prompt_states(source.store), summary, source.sequence_ids)

    def fit_source_sketch(self, source, sketch) -> "ThermometerFit":
        """The shared-sketch route: `fit_sketch` on the source's prompts and sketch."""
        return self.fit_sketch(prompt_states(source.store), sketch, source.sequence_ids)

    def fit_source_data(self, source) -> "ThermometerFit":
        """Without summary or sketch: `fit_sequences` on the source's hidden states."""
        return self.fit_sequences(source.store, source.logits_fn)

    def fit(self, chunks) -> "ThermometerFit":
        """Not supported: Thermometer trains on whole sequences.

        Args:
            chunks: ignored.

        Raises:
            ATSError: always; use `fit_sequences` (or `fit_source`).
        """
        raise ATSError("Thermometer predicts a temperature per prompt and trains on whole sequences: use "
                       "fit_sequences(feature_store, backbone.logits)")

    # --- the loss ----------------------------------------------------------------------------------------------
    def prompt_loss(self, nll: Tensor, row: Tensor, counts: Tensor, s: Tensor) -> tuple[Tensor, dict, int]:
        """The module docstring's loss for B prompts from the CE of their tokens at their 1/T.

        Args:
            nll: (N,) each token's CE at its prompt's s.
            row: (N,) the prompt of each token, in [0, B).
            counts: (B,) tokens per prompt (all > 0).
            s: (B,) each prompt's 1/T.

        Returns:
            (loss, {"nll": mean NLL per prompt, "temperature": mean T}, B).
        """
        per_seq = torch.zeros(len(counts), dtype=nll.dtype, device=nll.device).index_add(0, row, nll) / counts
        temperature = 1.0 / s
        loss = per_seq.mean() + self.prior_weight * self.prior(temperature.to(per_seq.dtype)).mean()
        return loss, {"nll": float(per_seq.detach().mean()), "temperature": float(temperature.detach().mean())}, \
            len(counts)

    def _sequence_step(self, hidden: Tensor, labels: Tensor, logits_fn: Callable[[Tensor], Tensor]
                       ) -> tuple[Tensor, dict, int]:
        """One `fit_loop` step on a padded batch hidden (B, T, H), labels (B, T) (-100 off the response): (the
        module docstring's loss, differentiable; {"nll": mean NLL per sequence, "temperature": mean T}; sequences
        kept). Rows without a response label are dropped; with none kept, a zero that keeps the graph, {}, 0."""
        pos = prompt_positions(labels)  # (B,)
        keep = pos >= 0
        if not bool(keep.any()):
            return next(self.net.parameters()).sum() * 0.0, {}, 0
        hidden, labels, pos = hidden[keep], labels[keep], pos[keep]
        B = hidden.shape[0]
        s = self.inverse_temperature(hidden[torch.arange(B, device=hidden.device), pos])  # (B,)
        select = labels != IGNORE_INDEX  # (B, T)
        row = torch.arange(B, device=hidden.device)[:, None].expand_as(labels)[select]  # (N,) sequence of each token
        scale = s.to(hidden.device)[row]  # (N,) every token of a sequence shares its scale
        ce_y = scaled_cross_entropy(hidden[select], scale, labels[select], logits_fn, self.chunk_size).ce_label
        return self.prompt_loss(ce_y, row, select.sum(dim=1).to(ce_y.dtype), s)

    # --- the three routes --------------------------------------------------------------------------------------
    def fit_sequences(self, store, logits_fn: Callable[[Tensor], Tensor], *, device=None,
                      progress: bool = False) -> "ThermometerFit":
        """Fit on a FeatureStore's sequences; `logits_fn` = backbone.logits. Returns self.

        The per-epoch mean loss / NLL / temperature go to `self.history`.

        Args:
            store: a `FeatureStore` (or anything with `batches`, `len` and `hidden_size`) of the fitting sequences.
            logits_fn: the output layer, h (n, H) -> z (n, V).
            device: where the network and hidden states live; default the device of `logits_fn`'s backbone (CPU if
                unknown).
            progress: show a progress bar.

        Returns:
            self, fitted, the network in eval mode.

        Raises:
            ATSError: if the store's hidden size differs, a loss is not finite, or no sequence has response tokens.
        """
        if getattr(store, "hidden_size", self.hidden_size) != self.hidden_size:
            raise ATSError(f"Thermometer: built for hidden size {self.hidden_size}, the features have "
                           f"{store.hidden_size}")
        if device is None:
            owner = getattr(logits_fn, "__self__", None)
            device = getattr(owner, "device", torch.device("cpu"))
        return self._fit(
            lambda epoch: store.batches(self.batch_size, shuffle=True, seed=self.seed * 1000 + epoch),
            lambda batch: self._sequence_step(batch.hidden.to(device), batch.labels.to(device), logits_fn),
            math.ceil(len(store) / self.batch_size), device, progress)

    def fit_sketch(self, prompts: Tensor, sketch, sequence_ids: Tensor, *, progress: bool = False) -> "ThermometerFit":
        """Fit as `fit_sequences` does, each sequence's mean cross-entropy computed from the `LogitSketch` rows of
        its response tokens (all of them, or the fitting subset's: then the mean over the sampled ones).

        Args:
            prompts: (S, H) each sequence's prompt feature (`prompt_states`).
            sketch: the `LogitSketch` of the fitting tokens.
            sequence_ids: (N,) the sequence of each sketch row, in [0, S).

        Returns:
            self, fitted, the network in eval mode (on the CPU).

        Raises:
            ATSError: if the sizes disagree, a loss is not finite, or no sequence has a fitting token.
        """
        return self._fit_tokens(prompts, len(sketch), sequence_ids, lambda rows, s: sketch.select(rows).nll(s),
                                "sketch", progress)

    def fit_summary(self, prompts: Tensor, summary: Tensor, sequence_ids: Tensor, *,
                    progress: bool = False) -> "ThermometerFit":
        """Fit as `fit_sequences` does, each sequence's mean cross-entropy computed from the scale summary rows of
        its response tokens (all of them, or the fitting subset's: then the mean over the sampled ones); the
        gradient w.r.t. each prompt's 1/T is that of the summary's piecewise quintic.

        A token whose prompt's 1/T exceeds the summary's max_scale (T below 0.1 by default) is evaluated at
        max_scale (the loss is flat beyond it); `beyond_summary_` counts such token evaluations over the fit (with a
        warning when there are any).

        Args:
            prompts: (S, H) each sequence's prompt feature (`prompt_states`).
            summary: (N, D) the scale summary rows of the fitting tokens (`summarize_logits`).
            sequence_ids: (N,) the sequence of each row, in [0, S).

        Returns:
            self, fitted, the network in eval mode (on the CPU).

        Raises:
            ATSError: if the sizes disagree, a loss is not finite, or no sequence has a fitting token.
        """
        if summary.dim() != 2 or summary.shape[0] == 0:
            raise ATSError(f"Thermometer: expected scale summary rows (N, D), N > 0, got {tuple(summary.shape)}")
        max_scale = SummaryView(summary).spec.max_scale
        self.beyond_summary_ = 0

        def nll(rows: Tensor, s: Tensor) -> Tensor:
            self.beyond_summary_ += int((s.detach() > max_scale).sum())
            return scaled_ce_from_summary(summary[rows], s.clamp(max=max_scale)).ce_label

        self._fit_tokens(prompts, summary.shape[0], sequence_ids, nll, "summary", progress)
        if self.beyond_summary_:
            logger.warning("Thermometer: %d token evaluations had 1/T above the scale summary's max_scale %g and "
                           "were evaluated at it; fit on the sketch or the sequences for temperatures below %g",
                           self.beyond_summary_, max_scale, 1 / max_scale)
        return self

    def _fit_tokens(self, prompts: Tensor, n_rows: int, sequence_ids: Tensor, nll_of: Callable, what: str,
                    progress: bool) -> "ThermometerFit":
        """`fit_sketch` / `fit_summary`: batches of sequences, each token's CE at its prompt's 1/T from
        `nll_of(rows (n,), s (n,))` -> (n,), over `n_rows` per-token rows of the fitting tokens."""
        if prompts.dim() != 2 or prompts.shape[1] != self.hidden_size:
            raise ATSError(f"Thermometer: prompts must be (S, {self.hidden_size}), got {tuple(prompts.shape)}")
        if sequence_ids.shape != (n_rows,):
            raise ATSError(f"Thermometer: {n_rows} {what} rows but sequence_ids of shape "
                           f"{tuple(sequence_ids.shape)}")
        counts = torch.bincount(sequence_ids, minlength=prompts.shape[0])  # (S,) fitting tokens per sequence
        rows = torch.argsort(sequence_ids, stable=True)  # the rows grouped by sequence
        starts = torch.cumsum(counts, 0) - counts
        present = (counts > 0).nonzero().squeeze(1)
        gen = torch.Generator().manual_seed(self.seed)

        def batches(epoch: int):
            return present[torch.randperm(len(present), generator=gen)].split(self.batch_size)

        def step(batch: Tensor):
            local = torch.repeat_interleave(torch.arange(len(batch)), counts[batch])  # (n,) batch row of each token
            picked = torch.cat([rows[starts[i]:starts[i] + counts[i]] for i in batch.tolist()])
            s = self.inverse_temperature(prompts[batch])  # (b,)
            return self.prompt_loss(nll_of(picked, s[local]), local, counts[batch], s)

        return self._fit(batches, step, math.ceil(len(present) / self.batch_size), torch.device("cpu"), progress)

    def _fit(self, epoch_batches: Callable, step: Callable, steps_per_epoch: int, device,
             progress: bool) -> "ThermometerFit":
        """The shared loop (`fit_loop`) with the options; the history goes to `self.history`."""
        self.history = fit_loop(self.net, epoch_batches, step, epochs=self.epochs, lr=self.lr,
                                weight_decay=self.weight_decay, steps_per_epoch=steps_per_epoch, device=device,
                                what="Thermometer", progress=progress)
        self.fitted = True
        return self
