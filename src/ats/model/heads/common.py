"""Pieces every head shares: the init, the zero-initialised output projection, the padding rule, RMSNorm."""

from __future__ import annotations

import torch
from torch import Tensor, nn


def init_weights(module: nn.Module) -> None:
    """GPT/Llama-style init: Linear weights N(0, 0.02), biases 0 (RMSNorm weights stay 1)."""
    for m in module.modules():
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, mean=0.0, std=0.02)
            if m.bias is not None:
                nn.init.zeros_(m.bias)


def zero_linear(layer: nn.Linear) -> nn.Linear:
    """The final H -> 1 projection starts at zero so that tau == 0 exactly (identity calibration)."""
    nn.init.zeros_(layer.weight)
    nn.init.zeros_(layer.bias)
    return layer


def mask_padding(tau: Tensor, attention_mask: Tensor | None) -> Tensor:
    """tau (B, T, 1) -> (B, T) float32, 0 on padding. The mask may cover past + new positions: use its tail."""
    tau = tau.squeeze(-1).float()  # (B, T)
    if attention_mask is not None:
        new = attention_mask[:, attention_mask.shape[1] - tau.shape[1]:].bool()  # (B, T)
        tau = tau.masked_fill(~new, 0.0)
    return tau


class RMSNorm(nn.Module):
    """Llama RMSNorm: x / sqrt(mean(x^2) + eps) * weight.

    Args:
        dim: the size of the normalised (last) axis.
        eps: added to the mean square.
    """

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        """x (..., dim) normalised over its last axis (computed in float32), same shape and dtype."""
        xf = x if x.dtype == torch.float32 else x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * (xf if xf.dtype == x.dtype else xf.to(x.dtype))
