"""The small training loop of the calibrators that learn a network (Thermometer): AdamW over batches, epoch by
epoch, with the per-epoch means of the step statistics as its history.

The parameter grouping is the ATS trainer's rule (`decay_groups`: weight decay on matrices only), written here
once; the calibrators sit below the training layer, so the trainer can import it from here and not the reverse.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import Tensor, nn
from tqdm.auto import tqdm

from ..errors import ATSError

# one step: batch -> (loss to minimise, {statistic: value}, the batch's weight (sequences); 0 skips the step)
StepLoss = Callable[[object], tuple[Tensor, dict[str, float], int]]


def decay_groups(module: nn.Module, weight_decay: float) -> list[dict]:
    """AdamW parameter groups: `weight_decay` on the weight matrices (dim >= 2), none on biases and norms.

    Args:
        module: the network being trained.
        weight_decay: the decay of the matrices.

    Returns:
        Two parameter groups, matrices first.
    """
    decay = [p for p in module.parameters() if p.dim() >= 2]
    no_decay = [p for p in module.parameters() if p.dim() < 2]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def fit_loop(module: nn.Module, epoch_batches: Callable[[int], Iterable], step_loss: StepLoss, *, epochs: int,
             lr: float, weight_decay: float, steps_per_epoch: int, device, what: str,
             progress: bool = False) -> list[dict]:
    """Train `module` in place with AdamW: per epoch, one step per batch of `epoch_batches(epoch)` minimising
    `step_loss(batch)`; the module ends in eval mode.

    Args:
        module: the network; moved to `device`.
        epoch_batches: epoch -> its batches.
        step_loss: batch -> (loss, statistics, weight); a weight of 0 skips the step.
        epochs: passes over the data.
        lr: AdamW's learning rate.
        weight_decay: AdamW's decay of the weight matrices (`decay_groups`).
        steps_per_epoch: batches per epoch, for the progress bar.
        device: where the module is trained.
        what: the method's name, in errors and on the progress bar.
        progress: show a progress bar.

    Returns:
        Per epoch {"epoch", "sequences" (the summed weights), "loss", statistic: the weighted means}.

    Raises:
        ATSError: if a loss is not finite or an epoch has no weight at all.
    """
    module = module.to(device).train()
    optimizer = torch.optim.AdamW(decay_groups(module, weight_decay), lr=lr)
    history = []
    bar = tqdm(total=epochs * steps_per_epoch, desc=f"fit {what.lower()}", disable=not progress)
    for epoch in range(epochs):
        totals, seen = {}, 0
        for batch in epoch_batches(epoch):
            loss, stats, n = step_loss(batch)
            bar.update(1)
            if n == 0:
                continue
            if not torch.isfinite(loss):
                raise ATSError(f"{what}: non-finite loss {loss.item()} at epoch {epoch}")
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            for key, value in {"loss": loss.item(), **stats}.items():
                totals[key] = totals.get(key, 0.0) + value * n
            seen += n
        if seen == 0:
            raise ATSError(f"{what}: no sequence with response tokens to fit on")
        history.append({"epoch": epoch, "sequences": seen, **{k: v / seen for k, v in totals.items()}})
    bar.close()
    module.eval()
    return history
