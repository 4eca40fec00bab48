"""Right-padding token-id lists into a batch: shared by feature extraction, online features and task scoring (pure
torch, so importing it loads nothing else)."""

from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor


def pad_batch(ids: Sequence[Sequence[int]], pad_id: int) -> tuple[Tensor, Tensor]:
    """Right-padded input_ids (B, T_max) and attention mask (B, T_max).

    Args:
        ids: B token-id lists (at least one).
        pad_id: the id placed on padding.

    Returns:
        (input_ids (B, T_max) long, attention_mask (B, T_max) long, 1 on real tokens).
    """
    t_max = max(len(x) for x in ids)
    input_ids = torch.full((len(ids), t_max), pad_id, dtype=torch.long)
    mask = torch.zeros((len(ids), t_max), dtype=torch.long)
    for row, x in enumerate(ids):
        input_ids[row, : len(x)] = torch.tensor(list(x), dtype=torch.long)
        mask[row, : len(x)] = 1
    return input_ids, mask
