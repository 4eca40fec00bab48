"""Thermometer (Shen et al., ICML 2024): an MLP on the prompt's last-token hidden state predicts ONE temperature per
prompt; every response token of that prompt is scaled by it, q = z / T(prompt).

The network follows the authors' code (github.com/maohaos2/Thermometer): three parallel branches
Linear(H, m) -> ReLU -> Linear(m, 1), combined by Linear(3, 1); a softplus of the output is the INVERSE temperature
s = 1/T (> 0, so argmax q == argmax z). Here s is also clamped to [0.01, 100] (T in [0.01, 100]), the range the
temperature-scaling baseline uses.

Training (our token-level setting; the paper fits per-task temperatures on multiple-choice answer tokens):

    loss = mean over sequences i of [ mean over i's response tokens CE(z_t / T_i, y_t)  +  lambda * R(T_i) ]
    R(T) = -log Gamma(T; alpha0, beta0) = -(alpha0 - 1) log T + T / beta0 + lgamma(alpha0) + alpha0 log beta0

The Gamma prior is parameterised by shape alpha0 and SCALE beta0, as in the authors' code (`GammaLoss(Gamma_k=1.25,
Gamma_theta=4.0)`, `lambda_reg=1e-2`): its mode (alpha0 - 1) * beta0 = 1, a weak prior centred on T = 1. These are
the defaults here (`prior_alpha=1.25, prior_beta=4.0, prior_weight=1e-2`), and so are the authors' AdamW settings
(lr 1e-3, weight decay 1e-4). (The authors regularise one task-level temperature per batch; we regularise each
prompt's temperature, which is what is predicted per prompt here.)

Which hidden state is "the prompt's last token":
- fitting (`fit_sequences`): `labels[t]` is the id of token t+1 on response positions, so the FIRST position with
  a label != -100 is the last prompt token (it predicts the first response token); its hidden state is the input.
- calibrating (`calibrate`): the calibrator does not know where the prompt ends, so the input is the hidden state at
  `index[:, 0]`, the first position whose logits are passed (for MMLU / TruthfulQA / multiple-choice tasks that is
  the last prompt token predicting the first answer token; for token-level evaluation it is the first response
  position, i.e. the same position as in fitting). Without `index` (K == T, e.g. a whole prompt being continued), the
  last real token of each row (per `attention_mask`) is used: the whole input is taken as the prompt. With 2-D
  logits (N, V) and hidden (N, H), each row is its own prompt.

Logits are never built for the whole data. `fit_sequences` recomputes them from hidden states in chunks
(`ats.model.scaled_ce.scaled_cross_entropy`, exact gradient w.r.t. the per-token scale), one full-vocabulary pass per
epoch. `fit_summary` (what `fit_source` uses when the features carry a scale summary) reads each token's summary row
instead: CE = G(s) + s (z_top - z_y) with G from the summary's piecewise quintic, no pass over the vocabulary at all
(the summary covers s <= its max_scale, T >= 0.1 by default: a prompt whose 1/T goes beyond it is evaluated at
max_scale, and counted in the history as `beyond_summary`). `fit_sketch` (what `fit_source` uses otherwise, when the
source has a sketch) reads each token's `LogitSketch`: after the sketch's one shared pass, every epoch costs K + B
terms per token instead of V.
"""

from __future__ import annotations

import logging
import math
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from tqdm.auto import tqdm

from ..checks import check_nonnegative_float, check_number, check_positive_float, check_positive_int
from ..errors import ATSError
from ..model.backbone import IGNORE_INDEX
from ..model.scale_summary import SummaryView, scaled_ce_from_summary
from ..model.scaled_ce import scaled_cross_entropy
from ._fitting import source_summary
from .base import Calibrator, FitSource, LogitChunks
from .temperature import S_MAX, S_MIN

logger = logging.getLogger(__name__)
SOFTPLUS_ONE = math.log(math.e - 1.0)  # softplus(SOFTPLUS_ONE) == 1: the network starts at T = 1


def gamma_neg_log_prior(temperature: Tensor, alpha: float, beta: float) -> Tensor:
    """-log p(T) for T ~ Gamma(shape=alpha, scale=beta), elementwise (scipy.stats.gamma(a=alpha, scale=beta)).

    Args:
        temperature: T > 0, any shape.
        alpha: the shape alpha0.
        beta: the scale beta0.

    Returns:
        -log p(T), same shape as `temperature`.
    """
    t = temperature
    return -(alpha - 1.0) * torch.log(t) + t / beta + math.lgamma(alpha) + alpha * math.log(beta)


class ThermometerNet(nn.Module):
    """The authors' architecture: three Linear-ReLU-Linear branches mixed by Linear(3, 1); output = raw 1/T.

    Starts near T = 1 (softplus of the output is 1 at initialisation, up to a small slope).

    Args:
        input_size: H, the backbone's hidden size.
        hidden_size: m, the width of each branch.
    """

    def __init__(self, input_size: int, hidden_size: int) -> None:
        super().__init__()
        self.branches = nn.ModuleList(
            nn.Sequential(nn.Linear(input_size, hidden_size), nn.ReLU(), nn.Linear(hidden_size, 1)) for _ in range(3))
        self.final = nn.Linear(3, 1)
        with torch.no_grad():  # start at T = 1 (near the identity), with a small, non-zero slope
            self.final.weight.mul_(0.01)
            self.final.bias.fill_(SOFTPLUS_ONE)

    def forward(self, x: Tensor) -> Tensor:
        """(B, H) -> (B,) pre-softplus inverse temperature.

        Args:
            x: (B, H) prompt features.

        Returns:
            (B,) the raw output; softplus of it is 1/T.
        """
        return self.final(torch.cat([b(x) for b in self.branches], dim=-1)).squeeze(-1)


def prompt_positions(labels: Tensor) -> Tensor:
    """(B,) index of the first response label in each row of labels (B, T): the prompt's last token; -1 if none.

    Args:
        labels: (B, T) next-token ids on response positions, -100 elsewhere.

    Returns:
        (B,) long positions, -1 for a row without a response label.
    """
    has = labels != IGNORE_INDEX
    first = has.to(torch.int8).argmax(dim=1)
    return torch.where(has.any(dim=1), first, torch.full_like(first, -1))


def prompt_states(store) -> Tensor:
    """(S, H) float32: each stored sequence's hidden state at its prompt position (`prompt_positions`), in stored
    order; zeros for a sequence without response tokens.

    Args:
        store: a `FeatureStore` (anything with `sequences()` and `hidden_size`).

    Returns:
        (S, H), row i for the i-th sequence of `store.sequences()`.
    """
    states = []
    for hidden, labels in store.sequences():
        pos = int(prompt_positions(labels[None])[0])
        states.append(hidden[pos].float() if pos >= 0 else torch.zeros(store.hidden_size))
    return torch.stack(states)


class Thermometer(Calibrator):
    """One temperature per prompt, predicted by an MLP from the prompt's last-token hidden state (Shen et al. 2024).

    Args:
        hidden_size: H, the backbone's hidden size the network reads.
        mlp_hidden: the width of each of the network's branches.
        epochs: passes over the sequences.
        lr: AdamW's learning rate.
        weight_decay: AdamW's weight decay (on weight matrices only).
        batch_size: sequences per step.
        prior_alpha: the Gamma prior's shape alpha0.
        prior_beta: the Gamma prior's scale beta0.
        prior_weight: lambda, the weight of the prior in the loss.
        chunk_size: tokens per chunk when computing the cross-entropy from hidden states.
        seed: the seed of the initial weights and of the shuffling.
    """

    name = "thermometer"
    needs_hidden = True
    prompt_hidden = True
    fits_on_sketch = True
    fits_on_summary = True

    def __init__(self, *, hidden_size: int, mlp_hidden: int = 256, epochs: int = 2, lr: float = 1e-3,
                 weight_decay: float = 1e-4, batch_size: int = 8, prior_alpha: float = 1.25,
                 prior_beta: float = 4.0, prior_weight: float = 1e-2, chunk_size: int = 1024, seed: int = 0) -> None:
        self.hidden_size = check_positive_int("hidden_size", hidden_size)
        self.mlp_hidden = check_positive_int("mlp_hidden", mlp_hidden)
        self.epochs = check_positive_int("epochs", epochs)
        self.lr = check_positive_float("lr", lr)
        self.weight_decay = check_nonnegative_float("weight_decay", weight_decay)
        self.batch_size = check_positive_int("batch_size", batch_size)
        self.prior_alpha = check_positive_float("prior_alpha", prior_alpha)
        self.prior_beta = check_positive_float("prior_beta", prior_beta)
        self.prior_weight = check_nonnegative_float("prior_weight", prior_weight)
        self.chunk_size = check_positive_int("chunk_size", chunk_size)
        self.seed = check_number("seed", seed, integer=True)
        self.fitted = False
        self.history: list[dict] = []
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.net = ThermometerNet(self.hidden_size, self.mlp_hidden)

    # --- the method --------------------------------------------------------------------------------------------
    def prior(self, temperature: Tensor) -> Tensor:
        """-log Gamma(T; prior_alpha, scale=prior_beta), elementwise.

        Args:
            temperature: T > 0, any shape.

        Returns:
            R(T), same shape.
        """
        return gamma_neg_log_prior(temperature, self.prior_alpha, self.prior_beta)

    def inverse_temperature(self, x: Tensor) -> Tensor:
        """s = 1/T (B,) from prompt features x (B, H), clamped to [0.01, 100]; differentiable.

        Args:
            x: (B, H) prompt features, moved to the network's device and dtype.

        Returns:
            s, (B,).
        """
        param = next(self.net.parameters())
        return F.softplus(self.net(x.to(param.device, param.dtype))).clamp(S_MIN, S_MAX)

    def temperature(self, x: Tensor) -> Tensor:
        """T (B,) from prompt features x (B, H).

        Args:
            x: (B, H) prompt features.

        Returns:
            T, (B,), without gradients.
        """
        with torch.no_grad():
            return 1.0 / self.inverse_temperature(x)

    def _prompt_features(self, hidden: Tensor, attention_mask: Tensor | None, index: Tensor | None) -> Tensor:
        """(B, H): the hidden state the temperature is read from (see the module docstring)."""
        B, T = hidden.shape[:2]
        if index is not None:
            pos = index[:, 0].to(hidden.device).long()
        elif attention_mask is not None:
            pos = attention_mask.to(hidden.device).long().sum(dim=1).sub(1).clamp(min=0)
        else:
            pos = torch.full((B,), T - 1, dtype=torch.long, device=hidden.device)
        return hidden[torch.arange(B, device=hidden.device), pos]

    def calibrate(self, logits: Tensor, hidden: Tensor | None = None, *, attention_mask: Tensor | None = None,
                  index: Tensor | None = None) -> Tensor:
        """q = z / T(prompt) for every position of a row; same shape as `logits` ((B, K, V) or (N, V)).

        The prompt's hidden state is chosen as the module docstring says.

        Args:
            logits: z, (B, K, V), or (N, V) with hidden (N, H) (each row its own prompt).
            hidden: (B, T, H) hidden states of the whole sequence, or (N, H).
            attention_mask: (B, T), 1 on real tokens; without `index`, the last real token is the prompt's.
            index: (B, K) positions of `logits` in `hidden`; `index[:, 0]` is read as the prompt's last token.

        Returns:
            q, same shape as `logits`.

        Raises:
            ATSError: if not fitted, `hidden` is None, or its shape does not match `logits`.
        """
        self._check_fitted()
        if hidden is None:
            raise ATSError("Thermometer needs the backbone's hidden states: pass hidden=(B, T, H)")
        if logits.dim() == 2:  # (N, V) with hidden (N, H): each row is its own prompt
            if hidden.dim() != 2 or hidden.shape[0] != logits.shape[0]:
                raise ATSError(f"Thermometer: logits {tuple(logits.shape)} need hidden (N, H), got "
                               f"{tuple(hidden.shape)}")
            x = hidden
        else:
            if hidden.dim() != 3 or hidden.shape[0] != logits.shape[0]:
                raise ATSError(f"Thermometer: logits {tuple(logits.shape)} need hidden (B, T, H), got "
                               f"{tuple(hidden.shape)}")
            x = self._prompt_features(hidden, attention_mask, index)
        with torch.no_grad():
            s = self.inverse_temperature(x)  # (B,)
        s = s.to(logits.device, logits.dtype)
        return logits * (s[:, None] if logits.dim() == 2 else s[:, None, None])

    @classmethod
    def for_source(cls, source: FitSource, **options) -> "Thermometer":
        """A fresh Thermometer sized for `source.hidden_size`.

        Args:
            source: the fitting data.
            **options: constructor options (`hidden_size` overrides the source's).

        Returns:
            The unfitted calibrator.
        """
        return cls(**{"hidden_size": source.hidden_size, **options})

    def fit_source(self, source: FitSource) -> "Thermometer":
        """Fit on the source's scale `summary` when it has one (`fit_summary`: no pass over the vocabulary), else on
        its `sketch` (`fit_sketch`: no pass over the logits after the sketch's), otherwise on its sequences of hidden
        states (`fit_sequences`).

        Args:
            source: the fitting data; its `store` and `logits_fn`, or `summary` / `sketch` and `sequence_ids`, are
                read.

        Returns:
            self, fitted.
        """
        summary = source_summary(source)
        if summary is not None:
            return self.fit_summary(prompt_states(source.store), summary, source.sequence_ids)
        sketch = getattr(source, "sketch", None)
        if sketch is not None:
            return self.fit_sketch(prompt_states(source.store), sketch, source.sequence_ids)
        return self.fit_sequences(source.store, source.logits_fn)

    def fit(self, chunks: LogitChunks) -> "Thermometer":
        """Not supported: Thermometer trains on whole sequences.

        Args:
            chunks: ignored.

        Raises:
            ATSError: always; use `fit_sequences` (or `fit_source`).
        """
        raise ATSError("Thermometer predicts a temperature per prompt and trains on whole sequences: use "
                       "fit_sequences(feature_store, backbone.logits)")

    def sequence_loss(self, hidden: Tensor, labels: Tensor, logits_fn: Callable[[Tensor], Tensor]
                      ) -> tuple[Tensor, float, float, int]:
        """(loss, mean NLL, mean T, sequences) for a padded batch hidden (B, T, H), labels (B, T); differentiable.

        Rows without a response label are dropped.

        Args:
            hidden: (B, T, H) hidden states.
            labels: (B, T) next-token ids on response positions, -100 elsewhere.
            logits_fn: the output layer, h (n, H) -> z (n, V).

        Returns:
            (loss: scalar tensor, the module docstring's loss; mean NLL per sequence: float; mean T: float;
            number of sequences kept: int). With no sequence kept: (a zero that keeps the graph, 0.0, 0.0, 0).
        """
        pos = prompt_positions(labels)  # (B,)
        keep = pos >= 0
        if not bool(keep.any()):
            zero = next(self.net.parameters()).sum() * 0.0
            return zero, 0.0, 0.0, 0
        hidden, labels, pos = hidden[keep], labels[keep], pos[keep]
        B = hidden.shape[0]
        x = hidden[torch.arange(B, device=hidden.device), pos]  # (B, H)
        s = self.inverse_temperature(x)  # (B,)
        select = labels != IGNORE_INDEX  # (B, T)
        row = torch.arange(B, device=hidden.device)[:, None].expand_as(labels)[select]  # (N,) sequence of each token
        scale = s.to(hidden.device)[row]  # (N,) every token of a sequence shares its scale
        ce_y = scaled_cross_entropy(hidden[select], scale, labels[select], logits_fn, self.chunk_size).ce_label
        counts = select.sum(dim=1).to(ce_y.dtype)  # (B,)
        per_seq = torch.zeros(B, dtype=ce_y.dtype, device=ce_y.device).index_add(0, row, ce_y) / counts
        temperature = 1.0 / s
        loss = per_seq.mean() + self.prior_weight * self.prior(temperature.to(per_seq.dtype)).mean()
        return loss, float(per_seq.detach().mean()), float(temperature.detach().mean()), B

    def fit_sequences(self, store, logits_fn: Callable[[Tensor], Tensor], *, device=None,
                      progress: bool = False) -> "Thermometer":
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
        return self._train(
            lambda epoch: store.batches(self.batch_size, shuffle=True, seed=self.seed * 1000 + epoch),
            lambda batch: self.sequence_loss(batch.hidden.to(device), batch.labels.to(device), logits_fn),
            math.ceil(len(store) / self.batch_size), device, progress)

    def fit_sketch(self, prompts: Tensor, sketch, sequence_ids: Tensor, *, progress: bool = False) -> "Thermometer":
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
                    progress: bool = False) -> "Thermometer":
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
                    progress: bool) -> "Thermometer":
        """`fit_sketch` / `fit_summary`: AdamW over batches of sequences, each token's CE at its prompt's 1/T from
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

        def loss_of(batch: Tensor):
            local = torch.repeat_interleave(torch.arange(len(batch)), counts[batch])  # (n,) batch row of each token
            picked = torch.cat([rows[starts[i]:starts[i] + counts[i]] for i in batch.tolist()])
            s = self.inverse_temperature(prompts[batch])  # (b,)
            nll = nll_of(picked, s[local])  # (n,)
            per_seq = torch.zeros(len(batch), dtype=nll.dtype).index_add(0, local, nll) / counts[batch]
            temperature = 1.0 / s
            loss = per_seq.mean() + self.prior_weight * self.prior(temperature.to(per_seq.dtype)).mean()
            return loss, float(per_seq.detach().mean()), float(temperature.detach().mean()), len(batch)

        return self._train(batches, loss_of, math.ceil(len(present) / self.batch_size), torch.device("cpu"),
                           progress)

    def _train(self, epoch_batches: Callable, loss_of: Callable, steps_per_epoch: int, device,
               progress: bool) -> "Thermometer":
        """AdamW over `epoch_batches(epoch)`, each step minimising `loss_of(batch)` -> (loss, nll, T, sequences);
        the per-epoch means go to `self.history`."""
        net = self.net.to(device).train()
        decay = [p for p in net.parameters() if p.dim() >= 2]
        no_decay = [p for p in net.parameters() if p.dim() < 2]
        optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": self.weight_decay},
                                       {"params": no_decay, "weight_decay": 0.0}], lr=self.lr)
        self.history = []
        bar = tqdm(total=self.epochs * steps_per_epoch, desc="fit thermometer", disable=not progress)
        for epoch in range(self.epochs):
            totals = {"loss": 0.0, "nll": 0.0, "temperature": 0.0, "sequences": 0}
            for batch in epoch_batches(epoch):
                loss, nll, temp, n = loss_of(batch)
                bar.update(1)
                if n == 0:
                    continue
                if not torch.isfinite(loss):
                    raise ATSError(f"Thermometer: non-finite loss {loss.item()} at epoch {epoch}")
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
                for key, value in (("loss", loss.item()), ("nll", nll), ("temperature", temp)):
                    totals[key] += value * n
                totals["sequences"] += n
            if totals["sequences"] == 0:
                raise ATSError("Thermometer: no sequence with response tokens to fit on")
            n = totals.pop("sequences")
            self.history.append({"epoch": epoch, "sequences": n, **{k: v / n for k, v in totals.items()}})
        bar.close()
        net.eval()
        self.fitted = True
        return self

    # --- persistence -------------------------------------------------------------------------------------------
    def _check_fitted(self) -> None:
        if not self.fitted:
            raise ATSError("Thermometer: not fitted; call fit_sequences() or from_pretrained() first")

    def check_backbone(self, backbone) -> None:
        """Refuse a backbone whose hidden size differs from the one the network reads (evaluate() calls this).

        Args:
            backbone: the backbone whose hidden states will be read.

        Raises:
            ATSError: if the hidden sizes differ.
        """
        if backbone.hidden_size != self.hidden_size:
            raise ATSError(f"Thermometer expects hidden size {self.hidden_size}, backbone "
                           f"{getattr(backbone, 'name', '?')} has {backbone.hidden_size}")

    def to(self, device) -> "Thermometer":
        """Move the network to `device` (a torch device or its name); returns self."""
        self.net.to(device)
        return self

    def config(self) -> dict:
        """The constructor options, whether it is fitted, and the training history.

        Returns:
            {option: value, "fitted": bool, "history": [per-epoch dict]}.
        """
        return {"hidden_size": self.hidden_size, "mlp_hidden": self.mlp_hidden, "epochs": self.epochs, "lr": self.lr,
                "weight_decay": self.weight_decay, "batch_size": self.batch_size, "prior_alpha": self.prior_alpha,
                "prior_beta": self.prior_beta, "prior_weight": self.prior_weight, "chunk_size": self.chunk_size,
                "seed": self.seed, "fitted": self.fitted, "history": self.history}

    def state_tensors(self) -> dict[str, Tensor]:
        """The network's weights.

        Returns:
            The network's state dict.
        """
        return dict(self.net.state_dict())

    def load_state(self, config: dict, tensors: dict[str, Tensor]) -> None:
        """Rebuild the network from the saved options and load its weights.

        Args:
            config: the saved config (without "type"); `hidden_size` is required.
            tensors: the network's state dict.

        Raises:
            ATSError: if `hidden_size` is missing, an option is invalid, or the weights do not match.
        """
        options = {k: config[k] for k in ("hidden_size", "mlp_hidden", "epochs", "lr", "weight_decay", "batch_size",
                                          "prior_alpha", "prior_beta", "prior_weight", "chunk_size", "seed")
                   if k in config}
        if "hidden_size" not in options:
            raise ATSError("thermometer config: missing field 'hidden_size'")
        self.__init__(**options)
        self.history = list(config.get("history", []))
        try:
            self.net.load_state_dict(tensors, strict=True)
        except RuntimeError as err:
            raise ATSError(f"thermometer weights do not match the config ({str(err).splitlines()[0]})") from None
        self.net.eval()
        self.fitted = bool(config.get("fitted", True))
