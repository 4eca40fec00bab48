"""Thermometer's network and where it reads: the authors' MLP (github.com/maohaos2/Thermometer), its Gamma prior
on the temperature, and the prompt's last hidden state it reads in fitting and in calibrating.

The network: three parallel branches Linear(H, m) -> ReLU -> Linear(m, 1), combined by Linear(3, 1); a softplus of
the output is the INVERSE temperature s = 1/T (> 0, so argmax q == argmax z).

Which hidden state is "the prompt's last token":
- fitting (`prompt_positions`): `labels[t]` is the id of token t+1 on response positions, so the FIRST position with
  a label != -100 is the last prompt token (it predicts the first response token); its hidden state is the input.
- calibrating (`prompt_features`): the calibrator does not know where the prompt ends, so the input is the hidden
  state at `index[:, 0]`, the first position whose logits are passed (for MMLU / TruthfulQA / multiple-choice tasks
  that is the last prompt token predicting the first answer token; for token-level evaluation it is the first
  response position, i.e. the same position as in fitting). Without `index` (K == T, e.g. a whole prompt being
  continued), the last real token of each row (per `attention_mask`) is used: the whole input is taken as the
  prompt. With 2-D logits (N, V) and hidden (N, H), each row is its own prompt.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from ..model.labels import IGNORE_INDEX

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


def prompt_features(hidden: Tensor, attention_mask: Tensor | None, index: Tensor | None) -> Tensor:
    """(B, H): the hidden state of hidden (B, T, H) the temperature is read from, at `index[:, 0]`, else at the last
    real token of each row, else at the last position (see the module docstring)."""
    B, T = hidden.shape[:2]
    if index is not None:
        pos = index[:, 0].to(hidden.device).long()
    elif attention_mask is not None:
        pos = attention_mask.to(hidden.device).long().sum(dim=1).sub(1).clamp(min=0)
    else:
        pos = torch.full((B,), T - 1, dtype=torch.long, device=hidden.device)
    return hidden[torch.arange(B, device=hidden.device), pos]

