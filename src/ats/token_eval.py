"""Token-level calibration on held-out instruction data: top-1 confidence vs. correctness on response tokens.

This is the metric the training loop reports (validation ECE) and the demo prints before/after calibration.
Every calibrator is applied to the same logits; logits are recomputed from cached hidden states one sequence at a
time, so `(N, V)` is never held for the whole split.
"""

from __future__ import annotations

import numpy as np
import torch
from tqdm.auto import tqdm

from .backbone import Backbone
from .calibrators.base import Calibrator, top1_confidence
from .data import IGNORE_INDEX
from .features import FeatureStore


@torch.no_grad()
def token_confidences(
    store: FeatureStore,
    backbone: Backbone,
    calibrators: dict[str, Calibrator],
    *,
    progress: bool = True,
) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Per calibrator: (top-1 confidence, correct) over all response tokens of `store`."""
    conf: dict[str, list] = {name: [] for name in calibrators}
    correct: dict[str, list] = {name: [] for name in calibrators}
    for hidden, labels in tqdm(store.sequences(), total=len(store), desc="token-level eval", disable=not progress):
        hidden = hidden.float().to(backbone.device)  # (T, H)
        positions = (labels != IGNORE_INDEX).nonzero().squeeze(-1)  # (K,)
        if positions.numel() == 0:
            continue
        z = backbone.logits(hidden[positions]).float()  # (K, V)
        target = labels[positions].to(z.device)
        for name, calibrator in calibrators.items():
            if calibrator.needs_hidden:
                q = calibrator.calibrate(z[None], hidden[None], index=positions[None].to(z.device))[0]
            else:
                q = calibrator.calibrate(z)
            c, pred = top1_confidence(q)  # vector scaling may move the argmax: correctness is per calibrator
            correct[name].append((pred == target).cpu())
            if calibrator.maps_confidence:
                c = calibrator.calibrate_confidence(c)
            conf[name].append(torch.as_tensor(c).cpu())
    return {name: (torch.cat(conf[name]).numpy(), torch.cat(correct[name]).numpy()) for name in calibrators}
