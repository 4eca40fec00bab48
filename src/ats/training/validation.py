"""The training objective on held-out data: the criterion that model selection uses (it never looks at a task)."""

from __future__ import annotations

import torch

from ..calibrators.ats import ATSCalibrator
from ..model.backbone import Backbone
from ..model.labels import IGNORE_INDEX
from .config import TrainingConfig
from .distributed import SINGLE, Dist
from .losses import calibration_loss
from .trainer import uses_summary


@torch.no_grad()
def heldout_objective(calibrator: ATSCalibrator, store, backbone: Backbone, config: TrainingConfig,
                      dist: Dist | None = None) -> float:
    """Mean of the head's training loss (config's loss type, alpha, weighting) over the held-out micro-batches,
    weighted by their response tokens; over every process's batches when distributed. The loss takes the route
    the trainer takes (`trainer.uses_summary`).

    Args:
        calibrator: the ATS calibrator whose head is evaluated (without gradients).
        store: a `FeatureStore` of the held-out sequences.
        backbone: gives the output layer and the device.
        config: the training config (loss, micro-batch size, chunk size).
        dist: the process's place in the job; default a single process.

    Returns:
        The token-weighted mean loss (0.0 when there is no response token).
    """
    dist = dist or SINGLE
    summarised = uses_summary(store, config, calibrator)
    total = tokens = 0.0
    for batch in store.batches(config.micro_batch_size, rank=dist.rank, world_size=dist.world_size):
        hidden = batch.hidden.to(backbone.device)  # (b, T, H)
        labels = batch.labels.to(backbone.device)  # (b, T)
        tau = calibrator.log_scale(hidden, batch.attention_mask.to(backbone.device))  # (b, T)
        select = labels != IGNORE_INDEX
        n = int(select.sum())
        if n == 0:
            continue
        out = calibration_loss(hidden[select], calibrator.scale(tau.float())[select], labels[select], backbone.logits,
                               loss_type=config.loss_type, alpha=config.alpha, weighting=config.weighting,
                               chunk_size=config.chunk_size, ignored=labels.shape[0] * (labels.shape[1] - 1) - n,
                               summary=batch.summary.to(backbone.device) if summarised else None)
        total += float(out.loss) * n
        tokens += n
    total, tokens = dist.all_sum([total, tokens])
    return total / max(tokens, 1.0)
