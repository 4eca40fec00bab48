"""The context-free heads: one global temperature (the control), a linear and an MLP probe of each token."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, ClassVar

import torch
from torch import Tensor, nn

from .common import init_weights, mask_padding, zero_linear

if TYPE_CHECKING:
    from .cache import HeadCache


class ConstantHead(nn.Module):
    """tau = gain * c for every token: one global temperature, trained like any head (the "no adaptivity" control).

    Adam moves a parameter by about lr per step whatever its gradient, so a bare scalar could move tau by only
    lr x steps (0.2 in 200 steps at lr 1e-3) while a linear head's output moves by up to lr x sum_i |h_i| per step.
    The gain sqrt(hidden_size) lets the control reach its optimum within the same steps and schedule.

    Args:
        hidden_size: H (sets the gain only).
    """

    reads_context: ClassVar[bool] = False  # tau at a position reads that position's hidden state only

    def __init__(self, hidden_size: int) -> None:
        super().__init__()
        self.gain = math.sqrt(hidden_size)
        self.tau = nn.Parameter(torch.zeros(1))

    @classmethod
    def from_config(cls, config) -> ConstantHead:
        """The head for a `HeadConfig`."""
        return cls(config.hidden_size)

    def forward(self, hidden: Tensor, attention_mask: Tensor | None = None, cache: "HeadCache | None" = None) -> Tensor:
        """tau (B, T) float32, the same value at every real token (the module docstring gives the signature)."""
        tau = (self.gain * self.tau).to(hidden.device).expand(*hidden.shape[:2], 1)  # (B, T, 1)
        return mask_padding(tau, attention_mask)  # (B, T)


class LinearHead(nn.Module):
    """tau = w . h + b: one log-scale per token from a linear probe of the hidden state.

    Args:
        hidden_size: H.
    """

    reads_context: ClassVar[bool] = False  # tau at a position reads that position's hidden state only

    def __init__(self, hidden_size: int):
        super().__init__()
        self.proj = zero_linear(nn.Linear(hidden_size, 1))

    @classmethod
    def from_config(cls, config) -> LinearHead:
        """The head for a `HeadConfig`."""
        return cls(config.hidden_size)

    def forward(self, hidden: Tensor, attention_mask: Tensor | None = None, cache: "HeadCache | None" = None) -> Tensor:
        """tau (B, T) float32, 0 on padding (the module docstring gives the signature)."""
        x = hidden.to(self.proj.weight.dtype)  # (B, T, H)
        return mask_padding(self.proj(x), attention_mask)  # (B, T)


class MLPHead(nn.Module):
    """tau = w . gelu(W h + c) + b: a per-token nonlinear probe (no context).

    Args:
        hidden_size: H.
        mlp_hidden: the hidden layer's width; None: H.
    """

    reads_context: ClassVar[bool] = False  # tau at a position reads that position's hidden state only

    def __init__(self, hidden_size: int, mlp_hidden: int | None = None):
        super().__init__()
        mlp_hidden = mlp_hidden or hidden_size
        self.fc = nn.Linear(hidden_size, mlp_hidden)
        self.act = nn.GELU()
        self.proj = nn.Linear(mlp_hidden, 1)
        init_weights(self)
        zero_linear(self.proj)

    @classmethod
    def from_config(cls, config) -> MLPHead:
        """The head for a `HeadConfig`."""
        return cls(config.hidden_size, mlp_hidden=config.mlp_hidden)

    def forward(self, hidden: Tensor, attention_mask: Tensor | None = None, cache: "HeadCache | None" = None) -> Tensor:
        """tau (B, T) float32, 0 on padding (the module docstring gives the signature)."""
        x = hidden.to(self.fc.weight.dtype)  # (B, T, H)
        return mask_padding(self.proj(self.act(self.fc(x))), attention_mask)  # (B, T)

