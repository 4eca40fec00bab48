"""Thermometer (Shen et al., ICML 2024): an MLP on the prompt's last-token hidden state predicts ONE temperature per
prompt; every response token of that prompt is scaled by it, q = z / T(prompt).

The network and the hidden state it reads are in `thermometer_net`, the fitting in `thermometer_fit`. Here s = 1/T
is clamped to [0.01, 100] (T in [0.01, 100]), the range the temperature-scaling baseline uses.

The Gamma prior on T is parameterised by shape alpha0 and SCALE beta0, as in the authors' code
(`GammaLoss(Gamma_k=1.25, Gamma_theta=4.0)`, `lambda_reg=1e-2`): its mode (alpha0 - 1) * beta0 = 1, a weak prior
centred on T = 1. These are the defaults here (`prior_alpha=1.25, prior_beta=4.0, prior_weight=1e-2`), and so are the
authors' AdamW settings (lr 1e-3, weight decay 1e-4).
"""

from __future__ import annotations

from dataclasses import MISSING, dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from ..config import ConfigMixin, option
from ..errors import ATSError
from .base import Calibrator
from .saving import load_module
from .temperature import S_MAX, S_MIN
from .thermometer_fit import ThermometerFit
from .thermometer_net import ThermometerNet, gamma_neg_log_prior, prompt_features, prompt_positions, prompt_states

__all__ = ["Thermometer", "ThermometerConfig", "ThermometerNet", "gamma_neg_log_prior", "prompt_positions",
           "prompt_states"]


@dataclass
class ThermometerConfig(ConfigMixin):
    """Thermometer's options: the network's sizes, AdamW, the Gamma prior, the chunking and the seed."""

    hidden_size: int = option(MISSING, "H, the backbone's hidden size the network reads (required)", low=1)
    mlp_hidden: int = option(256, "the width of each of the network's branches", low=1)
    epochs: int = option(2, "passes over the sequences", low=1)
    lr: float = option(1e-3, "AdamW's learning rate", low=0, low_open=True)
    weight_decay: float = option(1e-4, "AdamW's weight decay (on weight matrices only)", low=0)
    batch_size: int = option(8, "sequences per step", low=1)
    prior_alpha: float = option(1.25, "the Gamma prior's shape alpha0", low=0, low_open=True)
    prior_beta: float = option(4.0, "the Gamma prior's scale beta0", low=0, low_open=True)
    prior_weight: float = option(1e-2, "lambda, the weight of the prior in the loss", low=0)
    chunk_size: int = option(1024, "tokens per chunk when computing the cross-entropy from hidden states", low=1)
    seed: int = option(0, "the seed of the initial weights and of the shuffling")


class Thermometer(ThermometerFit, Calibrator):
    """One temperature per prompt, predicted by an MLP from the prompt's last-token hidden state (Shen et al. 2024).

    Options: `ThermometerConfig`, keyword-only; `hidden_size` is required (`for_source` takes the source's).
    """

    name = "thermometer"
    Config = ThermometerConfig
    needs_hidden = True
    prompt_hidden = True
    fits_on_summary = True
    fitted_keys = ("fitted", "history")

    def __init__(self, **options) -> None:
        super().__init__(**options)
        self.fitted = False
        self.history: list[dict] = []
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.seed)
            self.net = ThermometerNet(self.hidden_size, self.mlp_hidden)

    @property
    def is_fitted(self) -> bool:
        """Whether the network was fitted (or loaded, or marked fitted by a trainer outside: `fitted = True`)."""
        return self.fitted

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

    # --- training (`ats.training`: the one loop trains `trainable` on `scales_at`, then `record_training`) -------
    @property
    def trainable(self) -> torch.nn.Module:
        """The module training updates: the network."""
        return self.net

    def scales_at(self, hidden: Tensor, attention_mask: Tensor, index: Tensor, scored: Tensor) -> tuple[Tensor, Tensor]:
        """(s (B, K), penalty ()) at positions `index` (B, K) of sequences `hidden` (B, T, H), differentiable: one
        s = 1/T per sequence, from the hidden state at `index[:, 0]` (the prompt's last token: the first scored
        position), the same at every position; the penalty is `prior_weight` x the mean Gamma prior of the T of
        the sequences with a scored position.

        Args:
            hidden: (B, T, H) hidden states.
            attention_mask: (B, T); unused (the prompt's position is `index[:, 0]`).
            index: (B, K) positions; entries where `scored` is False are padding.
            scored: (B, K) bool, the real entries of `index`.

        Returns:
            (s (B, K) float32, the penalty ()).
        """
        x = hidden[torch.arange(hidden.shape[0]), index[:, 0]]  # (B, H)
        s = self.inverse_temperature(x).float()  # (B,)
        penalty = self.prior_weight * self.prior(1.0 / s[scored.any(dim=1).to(s.device)]).mean()
        rows = torch.arange(s.shape[0], device=s.device)[:, None].expand(index.shape)  # (B, K) each position's row
        return s[rows], penalty

    def record_training(self, record: dict, final_loss: float | None = None) -> None:
        """Mark the network fitted and keep the training record, with the final loss, as its history's one entry
        (saved with it)."""
        self.fitted = True
        self.history = [{**record, **({} if final_loss is None else {"final_loss": final_loss})}]

    def temperature(self, x: Tensor) -> Tensor:
        """T (B,) from prompt features x (B, H).

        Args:
            x: (B, H) prompt features.

        Returns:
            T, (B,), without gradients.
        """
        with torch.no_grad():
            return 1.0 / self.inverse_temperature(x)

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
        self.check_fitted()
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
            x = prompt_features(hidden, attention_mask, index)
        with torch.no_grad():
            s = self.inverse_temperature(x)  # (B,)
        s = s.to(logits.device, logits.dtype)
        return logits * (s[:, None] if logits.dim() == 2 else s[:, None, None])

    # --- placement and persistence -------------------------------------------------------------------------------
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

    def state_tensors(self) -> dict[str, Tensor]:
        """The network's weights.

        Returns:
            The network's state dict.
        """
        return dict(self.net.state_dict())

    def restore(self, fitted: dict, tensors: dict[str, Tensor]) -> None:
        """Load the network's saved weights, the fitted flag and the training history.

        Raises:
            ATSError: if the weights do not match the config.
        """
        load_module(self.net, tensors)
        self.history = list(fitted.get("history", []))
        self.fitted = bool(fitted.get("fitted", True))
