"""How Thermometer is fitted on instruction tokens: per prompt, the mean cross-entropy of its response tokens at the
prompt's 1/T plus the Gamma prior on T, minimised by the one loop (`fit_loop.FitLoop`), from the source's scale
summary or from its sequences.

    loss = mean over sequences i of [ mean over i's response tokens CE(z_t / T_i, y_t)  +  lambda * R(T_i) ]
    R(T) = -log Gamma(T; alpha0, beta0) = -(alpha0 - 1) log T + T / beta0 + lgamma(alpha0) + alpha0 log beta0

(our token-level setting; the paper fits per-task temperatures on multiple-choice answer tokens, and regularises one
task-level temperature per batch where we regularise each prompt's.) Logits are never built for the whole data:

- with the source's scale summary (`fit_tokens` on its rows): CE = G(s) + s (z_top - z_y) with G from the summary's
  piecewise quintic, no pass over the vocabulary at all (the summary covers s <= its max_scale, T >= 0.1 by default:
  a prompt whose 1/T goes beyond it is evaluated at max_scale, and counted as `beyond_summary_`);
- without it (`fit_sequences`): the logits recomputed from the hidden states in chunks
  (`ats.model.scaled_ce.scaled_cross_entropy`, exact gradient w.r.t. the per-token scale), one full-vocabulary pass
  per epoch.
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
from .fit_loop import BatchObjective, FitLoop
from .thermometer_net import prompt_positions, prompt_states

logger = logging.getLogger(__name__)


class ThermometerFit:
    """The fitting of `Thermometer` (mixed into it: it uses `net`, `inverse_temperature`, `prior` and the options of
    `ThermometerConfig`)."""

    def _fit(self, source) -> None:
        """The source's scale summary when it has one (`fit_tokens`), else its sequences (`fit_sequences`)."""
        summary = source.summary
        if summary is None:
            self.fit_sequences(source.store, source.logits_fn)
            return
        if summary.dim() != 2 or summary.shape[0] == 0:
            raise ATSError(f"Thermometer: expected scale summary rows (N, D), N > 0, got {tuple(summary.shape)}")
        sequence_ids = source.sequence_ids
        if sequence_ids.shape != (summary.shape[0],):
            raise ATSError(f"Thermometer: {summary.shape[0]} summary rows but sequence_ids of shape "
                           f"{tuple(sequence_ids.shape)}")
        max_scale = SummaryView(summary).spec.max_scale
        self.beyond_summary_ = 0

        def nll(rows: Tensor, s: Tensor) -> Tensor:
            self.beyond_summary_ += int((s.detach() > max_scale).sum())
            return scaled_ce_from_summary(summary[rows], s.clamp(max=max_scale)).ce_label

        self.fit_tokens(prompt_states(source.store), sequence_ids, nll)
        if self.beyond_summary_:
            logger.warning("Thermometer: %d token evaluations had 1/T above the scale summary's max_scale %g and "
                           "were evaluated at it; fit on the sequences (the exact route) for temperatures below %g",
                           self.beyond_summary_, max_scale, 1 / max_scale)

    # --- the loss ----------------------------------------------------------------------------------------------
    def prompt_loss(self, nll: Tensor, row: Tensor, counts: Tensor, s: Tensor) -> tuple[Tensor, dict]:
        """The module docstring's loss for B prompts from the CE of their tokens at their 1/T.

        Args:
            nll: (N,) each token's CE at its prompt's s.
            row: (N,) the prompt of each token, in [0, B).
            counts: (B,) tokens per prompt (all > 0).
            s: (B,) each prompt's 1/T.

        Returns:
            (loss, {"nll": mean NLL per prompt, "temperature": mean T, "sequences": B}).
        """
        per_seq = torch.zeros(len(counts), dtype=nll.dtype, device=nll.device).index_add(0, row, nll) / counts
        temperature = 1.0 / s
        loss = per_seq.mean() + self.prior_weight * self.prior(temperature.to(per_seq.dtype)).mean()
        return loss, {"nll": float(per_seq.detach().mean()), "temperature": float(temperature.detach().mean()),
                      "sequences": len(counts)}

    def _sequence_step(self, hidden: Tensor, labels: Tensor, logits_fn: Callable[[Tensor], Tensor]
                       ) -> tuple[Tensor, dict] | None:
        """The loss of a padded batch hidden (B, T, H), labels (B, T) (-100 off the response), differentiable; rows
        without a response label are dropped, and a batch without any gives None (no step)."""
        pos = prompt_positions(labels)  # (B,)
        keep = pos >= 0
        if not bool(keep.any()):
            return None
        hidden, labels, pos = hidden[keep], labels[keep], pos[keep]
        B = hidden.shape[0]
        s = self.inverse_temperature(hidden[torch.arange(B, device=hidden.device), pos])  # (B,)
        select = labels != IGNORE_INDEX  # (B, T)
        row = torch.arange(B, device=hidden.device)[:, None].expand_as(labels)[select]  # (N,) sequence of each token
        scale = s.to(hidden.device)[row]  # (N,) every token of a sequence shares its scale
        ce_y = scaled_cross_entropy(hidden[select], scale, labels[select], logits_fn, self.chunk_size).ce_label
        return self.prompt_loss(ce_y, row, select.sum(dim=1).to(ce_y.dtype), s)

    # --- the two routes ----------------------------------------------------------------------------------------
    def fit_sequences(self, store, logits_fn: Callable[[Tensor], Tensor], *, device=None,
                      progress: bool = False) -> "ThermometerFit":
        """Fit on a FeatureStore's sequences (the exact route); `logits_fn` = backbone.logits. Returns self.

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
        objective = BatchObjective(
            "Thermometer", lambda epoch: store.batches(self.batch_size, shuffle=True, seed=self.seed * 1000 + epoch),
            lambda batch: self._sequence_step(batch.hidden.to(device), batch.labels.to(device), logits_fn))
        return self._run(objective, device, progress)

    def fit_tokens(self, prompts: Tensor, sequence_ids: Tensor, nll_of: Callable[[Tensor, Tensor], Tensor], *,
                   progress: bool = False) -> "ThermometerFit":
        """Fit on per-token rows (the summary route's shape): batches of sequences, each token's CE at its prompt's
        1/T from `nll_of(rows (n,), s (n,)) -> (n,)`, each sequence's loss the mean over its rows (all its response
        tokens, or the fitting subset's).

        Args:
            prompts: (S, H) each sequence's prompt feature (`prompt_states`).
            sequence_ids: (N,) the sequence of each row, in [0, S).
            nll_of: rows, their prompts' s -> their CE, differentiable in s.
            progress: show a progress bar.

        Returns:
            self, fitted, the network in eval mode (on the CPU).

        Raises:
            ATSError: if the sizes disagree, a loss is not finite, or no sequence has a fitting token.
        """
        if prompts.dim() != 2 or prompts.shape[1] != self.hidden_size:
            raise ATSError(f"Thermometer: prompts must be (S, {self.hidden_size}), got {tuple(prompts.shape)}")
        if sequence_ids.dim() != 1 or (len(sequence_ids) and int(sequence_ids.max()) >= prompts.shape[0]):
            raise ATSError(f"Thermometer: sequence_ids of shape {tuple(sequence_ids.shape)} must index the "
                           f"{prompts.shape[0]} prompts")
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

        objective = BatchObjective("Thermometer", batches, step, math.ceil(len(present) / self.batch_size))
        return self._run(objective, torch.device("cpu"), progress)

    def _run(self, objective: BatchObjective, device, progress: bool) -> "ThermometerFit":
        """The one loop (`FitLoop`, AdamW at a constant rate) on `objective`; the per-epoch means of its steps'
        statistics, weighted by their sequences, go to `self.history`.

        Raises:
            ATSError: if a loss is not finite or an epoch had no sequence to fit on.
        """
        steps = FitLoop(self.net.to(device), objective, lr=self.lr, weight_decay=self.weight_decay,
                        epochs=self.epochs, seed=self.seed, progress=progress).run()
        self.history = []
        for epoch in range(self.epochs):
            rows = [row for row in steps if row["epoch"] == epoch]
            seen = sum(row["sequences"] for row in rows)
            if seen == 0:
                raise ATSError("Thermometer: no sequence with response tokens to fit on")
            means = {}
            for row in rows:
                for key in ("loss", "nll", "temperature"):
                    means[key] = means.get(key, 0.0) + row[key] * row["sequences"]
            self.history.append({"epoch": epoch, "sequences": seen, **{k: v / seen for k, v in means.items()}})
        self.fitted = True
        return self
