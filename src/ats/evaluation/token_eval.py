"""Token-level calibration on held-out instruction data: top-1 confidence vs. correctness on response tokens.

This is what the training loop reports after each epoch (validation ECE) and what `ats train` prints before/after
calibration. Every calibrator is applied to the same logits; logits are recomputed from cached hidden states one
sequence at a time, so `(N, V)` is never held for the whole split. With several processes, each rank evaluates
its own shards and the results are gathered.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
from tqdm.auto import tqdm

from ..calibrators.base import Calibrator
from ..model.backbone import Backbone
from ..model.labels import IGNORE_INDEX
from ..training.distributed import Dist


@torch.no_grad()
def token_confidences(
    store,  # FeatureStore / OnlineFeatures / ShardView: anything with sequences() and len()
    backbone: Backbone,
    calibrators: dict[str, Calibrator],
    *,
    progress: bool = True,
) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Per calibrator: (top-1 confidence (N,) float64, correct (N,) bool) over all response tokens of `store`.

    Logits are recomputed one sequence at a time, only at the response positions (K, V); every calibrator is
    applied to them with the whole sequence's hidden states.

    Args:
        store: a FeatureStore, OnlineFeatures or ShardView: anything with `sequences()` and `len()`.
        backbone: gives the output layer and the device.
        calibrators: method name -> fitted calibrator.
        progress: show a progress bar.

    Returns:
        method -> (confidence (N,) float64, correct (N,) bool), N the response tokens of `store`.
    """
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
            c, pred = calibrator.top1(z[None], hidden[None], index=positions[None].to(z.device))
            correct[name].append((pred[0] == target).cpu().numpy())
            conf[name].append(c[0])
    return {name: (np.concatenate(conf[name]), np.concatenate(correct[name])) for name in calibrators}


class ShardView:
    """A feature source restricted to some shards (what one rank evaluates).

    Args:
        store: a FeatureStore or OnlineFeatures.
        shard_ids: the shards in view.
    """

    def __init__(self, store, shard_ids: list[int]) -> None:
        self.store, self.shard_ids = store, shard_ids

    def __len__(self) -> int:
        return sum(self.store.meta["shards"][k]["sequences"] for k in self.shard_ids)

    def sequences(self, shard_ids=None):
        """(hidden (T, H), labels (T,)) per sequence of the shards in view.

        Args:
            shard_ids: other shards to read instead; None: those in view.

        Returns:
            An iterator over (hidden (T, H), labels (T,)) pairs, as the store's `sequences`.
        """
        return self.store.sequences(self.shard_ids if shard_ids is None else shard_ids)


def gathered_token_confidences(store, backbone, calibrators: dict, dist: Dist | None = None, *, progress: bool = True
                               ) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """token_confidences over all ranks: rank r evaluates shards r, r+W, ... and (conf, correct) are gathered, so
    every rank gets the metrics of the whole split.

    Args:
        store: a FeatureStore or OnlineFeatures.
        backbone: gives the output layer and the device.
        calibrators: method name -> fitted calibrator.
        dist: the process's place in the job; None or a single process: plain `token_confidences`.
        progress: show a progress bar (main process only when distributed).

    Returns:
        method -> (confidence (N,) float64, correct (N,) bool) over the whole split, in rank order.
    """
    if dist is None or not dist.distributed:
        return token_confidences(store, backbone, calibrators, progress=progress)
    view = ShardView(store, dist.my_shards(store.n_shards))
    if len(view):
        mine = token_confidences(view, backbone, calibrators, progress=progress and dist.is_main)
    else:  # more ranks than shards: this rank has nothing to evaluate but still takes part in the gather
        mine = {name: (np.zeros(0), np.zeros(0, dtype=bool)) for name in calibrators}
    out = {}
    for name, (conf, correct) in mine.items():
        c = dist.gather_cat(torch.as_tensor(np.asarray(conf, dtype=np.float64))).numpy()
        k = dist.gather_cat(torch.as_tensor(np.asarray(correct, dtype=np.float64))).numpy().astype(bool)
        out[name] = (c, k)
    return out


def token_validator(store, backbone: Backbone, dist: Dist | None = None) -> Callable[[Calibrator], dict]:
    """A trainer's `validate` callback: token-level metrics (ECE, Brier, ...) of a calibrator on `store`, computed
    over every process's shards.

    Args:
        store: the held-out features.
        backbone: gives the output layer and the device.
        dist: the process's place in the job; None: one process.

    Returns:
        A function calibrator -> the `summarize` dict of its token-level confidences.
    """
    from .metrics import summarize

    def validate(calibrator: Calibrator) -> dict:
        conf, correct = gathered_token_confidences(store, backbone, {"head": calibrator}, dist, progress=False)["head"]
        return summarize(conf, correct)

    return validate
