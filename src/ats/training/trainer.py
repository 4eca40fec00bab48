"""The one training loop of what `ats train` trains (ATS heads, and Thermometer on answers): AdamW, cosine schedule
with warmup, gradient accumulation and data parallelism by accelerate (`Accelerator.accumulate`), clipping,
checkpoints, resume, several processes.

What is minimised is an objective (`Objective`): its micro-batches and the loss of one. `TokenObjective` is the
paper's: whole sequences of cached (or online) instruction features, the head's tau for every position and the loss
(`training.losses`) on the response tokens, from their scale summaries when the features carry them (no
vocabulary-sized work), else (`exact_loss`, online features, folders extracted without a summary) from logits
recomputed from `h` in chunks. `ats.training.answer_objective.AnswerObjective` is the model's own answers. The
calibrator says what is trained and how (`trainable`, `scales_at`, `record_training`); the backbone stays frozen.

Checkpoints are written each epoch and every `save_every` optimizer steps; `resume=True` continues from the last one
and ends with the same weights as an uninterrupted run, because the data order depends only on (seed, epoch).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor
from transformers import get_cosine_schedule_with_warmup

from ..calibrators.ats import ATSCalibrator
from ..calibrators.fit_loop import FitLoop, Objective
from ..errors import ATSError
from ..model.backbone import Backbone
from ..model.labels import IGNORE_INDEX
from ..model.token_ce import summary_route
from .checkpoint import checkpoint_and_prune, latest_checkpoint, load_checkpoint
from .config import TrainingConfig, training_record
from .distributed import SINGLE, Dist
from .losses import calibration_loss

logger = logging.getLogger(__name__)

Validator = Callable[[ATSCalibrator], dict]  # calibrator -> metrics on held-out data (e.g. {"ece": ...})


@dataclass
class TrainResult:
    """What a training run logs: the loss per optimizer step and the validation metrics per epoch."""

    history: list[dict] = field(default_factory=list)  # one row per optimizer step
    epochs: list[dict] = field(default_factory=list)  # validation metrics after each epoch


def micro_per_epoch(store, config: TrainingConfig) -> int:
    """Micro-batches in one pass over `store`.

    Args:
        store: a FeatureStore or OnlineFeatures (its `meta["shards"]` sizes are read).
        config: gives the micro-batch size.

    Returns:
        The number of micro-batches per epoch (each shard's last one may be partial).
    """
    return sum(math.ceil(s["sequences"] / config.micro_batch_size) for s in store.meta["shards"])


def steps_per_epoch(store, config: TrainingConfig) -> int:
    """Optimizer steps in one pass (a last partial accumulation counts as a step of the schedule).

    Args:
        store: a FeatureStore or OnlineFeatures.
        config: gives the micro-batch size and the accumulation.

    Returns:
        The number of optimizer steps per epoch.
    """
    return math.ceil(micro_per_epoch(store, config) / config.accumulation)


def uses_summary(store, config: TrainingConfig, calibrator: ATSCalibrator) -> bool:
    """Whether the loss is computed from the features' scale summaries (`summary_route`: when the store carries a
    summary and `config.exact_loss` is off; online features carry none).

    Raises:
        ATSError: if the head's max_scale exceeds the summary's.
    """
    where = f"the features in {getattr(store, 'directory', '?')}"
    return summary_route(getattr(store, "scale_summary", None), exact=config.exact_loss,
                         max_scale=calibrator.config_.max_scale, where=where)


class TokenObjective:
    """The paper's objective: an ATS-family head's loss (`config`'s loss type) on the response tokens of whole
    instruction sequences (a FeatureStore, or OnlineFeatures run through the backbone per batch); the head is moved
    to the backbone's device.

    Raises:
        ATSError: if the features or the calibrator belong to another backbone, or the head's max_scale exceeds the
            features' scale summary.
    """

    what = "train head"

    def __init__(self, calibrator: ATSCalibrator, store, backbone: Backbone, config: TrainingConfig) -> None:
        store.check_backbone(backbone)
        calibrator.check_backbone(backbone)
        self.calibrator, self.store, self.backbone, self.config = calibrator, store, backbone, config
        self.use_summary = uses_summary(store, config, calibrator)
        self.accumulation = config.accumulation
        calibrator.to(backbone.device)

    def steps(self, epoch: int) -> int:
        """Optimizer steps of every epoch (`steps_per_epoch`)."""
        return steps_per_epoch(self.store, self.config)

    def micro_batches(self, epoch: int, *, rank: int, world_size: int, start: int) -> Iterator:
        """This process's micro-batches of `epoch`, in the order seeded by (seed, epoch)."""
        return self.store.batches(self.config.micro_batch_size, shuffle=True, seed=self.config.seed * 1000 + epoch,
                                  rank=rank, world_size=world_size, start=start)

    def loss(self, batch, model) -> tuple[Tensor, dict]:
        """The calibration loss of one micro-batch of sequences (the head run through `model` when data-parallel)."""
        config, device = self.config, self.backbone.device
        hidden = batch.hidden.to(device)  # (b, T, H)
        mask = batch.attention_mask.to(device)  # (b, T)
        labels = batch.labels.to(device)  # (b, T)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=config.bf16):
            if model is None:
                tau = self.calibrator.log_scale(hidden, mask)  # (b, T)
            else:
                param = next(model.parameters())
                tau = model(hidden.to(param.device, param.dtype), mask)
        select = labels != IGNORE_INDEX  # (b, T)
        n = int(select.sum())
        ignored = labels.shape[0] * (labels.shape[1] - 1) - n  # -100 positions among the shifted (b, T - 1)
        summary = batch.summary.to(device) if self.use_summary else None  # (n, D) or None
        out = calibration_loss(hidden[select], self.calibrator.scale(tau.float())[select], labels[select],
                               self.backbone.logits, loss_type=config.loss_type, alpha=config.alpha,
                               weighting=config.weighting, chunk_size=config.chunk_size, ignored=max(ignored, 0),
                               summary=summary)
        return out.loss, {}

    def record(self, lr: float, steps: int) -> dict:
        """The training record: the options, the learning rate (and whether it was automatic), the steps."""
        return training_record(self.config, lr=lr, optimizer_steps=steps, lr_automatic=self.config.lr is None)


class Trainer(FitLoop):
    """Trains `calibrator.trainable` in place on `objective` through the one loop (`FitLoop`: AdamW, accumulation,
    clipping, the cosine schedule with warmup); `run()` returns the loss history and per-epoch validation metrics.

    Construction builds the optimizer and schedule (the learning rate and the training record go to the calibrator's
    `record_training`) and, with `resume`, restores the last checkpoint. torch's global RNG is never seeded or drawn
    from: the data order comes from (seed, epoch), and each epoch runs on a forked RNG seeded from (seed, epoch)
    (`FitLoop.epoch_rng`), so any randomness is reproducible and leaves the caller's RNG as it was.

    Every optimizer step takes `objective.accumulation` micro-batches through `Accelerator.accumulate` (the loss
    divided by the accumulation, no gradient all-reduce before the step's last). With W processes the global
    micro-batch sequence is dealt round-robin, each rank accumulates accumulation / W micro-batches and DDP averages
    the gradients, so each step applies the update of one process with the same accumulation (up to float rounding
    in the reduction). A last partial step of an epoch is applied as in one process (loss / accumulation per
    micro-batch): a rank with fewer micro-batches in it joins the all-reduce with a zero-weighted one.

    Args:
        calibrator: the calibrator trained (`trainable`, `record_training`; ATS heads, Thermometer).
        objective: what is minimised (`TokenObjective`, `ats.training.answer_objective.AnswerObjective`).
        config: the optimisation settings (lr, epochs, warmup, weight decay, clipping, seed, save_every).
        validate: called after each epoch with the calibrator; its dict is logged (e.g. token-level ECE).
        out_dir: the run folder for checkpoints; None: no checkpoints.
        resume: continue from the last checkpoint in `out_dir`, if any.
        progress: show a progress bar (main process only).
        on_step: called with the global optimizer step after each step (and its checkpoint).
        dist: the process's place in a multi-process job (default: one process).

    Raises:
        ATSError: if the accumulation is not a multiple of W.
    """

    def __init__(self, calibrator, objective: Objective, config: TrainingConfig, *,
                 validate: Validator | None = None, out_dir: str | Path | None = None, resume: bool = False,
                 progress: bool = True, on_step: Callable[[int], None] | None = None, dist: Dist | None = None
                 ) -> None:
        self.calibrator, self.config = calibrator, config
        self.validate, self.on_step, self.dist = validate, on_step, dist or SINGLE
        self.out_dir = Path(out_dir) if out_dir is not None else None
        if objective.accumulation % self.dist.world_size:
            raise ATSError(f"batch_size {config.batch_size} must be a multiple of micro_batch_size "
                           f"{config.micro_batch_size} x {self.dist.world_size} processes")
        total = sum(objective.steps(epoch) for epoch in range(config.epochs))
        lr = config.learning_rate(total)
        if config.lr is None:
            logger.info("learning rate %.3g, the default for %d optimizer steps (set --lr to choose)", lr, total)
        warmup = round(config.warmup_ratio * total)
        super().__init__(calibrator.trainable, objective, lr=lr, weight_decay=config.weight_decay,
                         epochs=config.epochs, seed=config.seed, max_grad_norm=config.max_grad_norm,
                         schedule=lambda opt: get_cosine_schedule_with_warmup(opt, warmup, total),
                         progress=progress and self.dist.is_main)
        self.local_accumulation = objective.accumulation // self.dist.world_size
        self.distributed = self.dist.distributed
        self.failure_note = f"; the last good checkpoint is kept in {self.out_dir}"
        self.record = objective.record(lr, total)
        self.calibrator.record_training(self.record)
        self.result = TrainResult(history=self.history)
        if resume:
            self.start = self._resume()
        if self.dist.accelerator is not None:
            self.accelerator = self.dist.accelerator
        else:
            from accelerate import Accelerator

            self.accelerator = Accelerator(cpu=next(self.module.parameters()).device.type == "cpu")
        self.accelerator.gradient_accumulation_steps = self.local_accumulation
        self.accelerator.step = 0  # the micro-batch count of `accumulate`: a new run starts a new step
        if self.distributed:  # only the trained module is data-parallel; the frozen backbone is never wrapped
            self.model, self.optimizer = self.accelerator.prepare(self.module, self.optimizer)

    def _resume(self) -> tuple[int, int]:
        """(epoch, step in epoch) of the last checkpoint, its state restored; (0, 0) if there is none."""
        ckpt = latest_checkpoint(self.out_dir) if self.out_dir is not None else None
        if ckpt is None:  # said, so that a mistyped OUT is not taken for a resumed run
            logger.info("nothing to resume in %s (no checkpoint): training from the start", self.out_dir)
            return 0, 0
        trainer = load_checkpoint(ckpt, self.calibrator, self.optimizer, self.scheduler)
        self.history[:] = trainer.get("history", [])
        self.result.epochs = trainer.get("epochs", [])
        logger.info("resuming from %s (epoch %d, step %d)", ckpt, trainer["epoch"], trainer["step_in_epoch"])
        return trainer["epoch"], trainer["step_in_epoch"]

    def _checkpoint(self, epoch: int, step_in_epoch: int) -> None:
        if self.out_dir is None or not self.dist.is_main:  # only the main process writes
            return
        checkpoint_and_prune(self.out_dir, f"epoch{epoch}-step{step_in_epoch}", self.calibrator, self.optimizer,
                             self.scheduler, {"epoch": epoch, "step_in_epoch": step_in_epoch,
                                              "history": self.history, "epochs": self.result.epochs})

    # --- the loop's hooks -------------------------------------------------------------------------------------------
    def accumulate(self):
        """`Accelerator.accumulate`: no gradient all-reduce before a step's last micro-batch."""
        return self.accelerator.accumulate(*([self.model] if self.model is not None else []))

    def backward(self, loss: Tensor) -> None:
        """`Accelerator.backward`: the loss divided by the local accumulation."""
        self.accelerator.backward(loss)

    def idle_backward(self) -> None:
        """A rank without a micro-batch left in the step joins the gradient all-reduce with a zero-weighted one."""
        if self.model is not None and self.accelerator.sync_gradients:
            self.accelerator.backward(self.objective.loss(self._any_batch(), self.model)[0] * 0.0)

    def all_sum(self, values: list[float]) -> list[float]:
        """Sums over the processes."""
        return self.dist.all_sum(values)

    def _any_batch(self):
        """A micro-batch for a zero-weighted pass: the last this rank saw, else the epoch's first."""
        if self.last_batch is None:
            self.last_batch = next(iter(self.objective.micro_batches(0, rank=0, world_size=1, start=0)))
        return self.last_batch

    def after_step(self, epoch: int, step_in_epoch: int, step: int) -> None:
        """A checkpoint every `save_every` steps; `on_step`."""
        if self.config.save_every and step_in_epoch % self.config.save_every == 0:
            self._checkpoint(epoch, step_in_epoch)
        if self.on_step is not None:
            self.on_step(step)

    def after_epoch(self, epoch: int, bar) -> None:
        """Validation (logged in `result.epochs`), the epoch's checkpoint, a barrier."""
        if self.validate is not None:
            self.result.epochs.append({"epoch": epoch, **self.validate(self.calibrator)})
            bar.set_postfix(loss=f"{self.history[-1]['loss']:.4f}" if self.history else "-", **self.postfix())
        self._checkpoint(epoch + 1, 0)
        self.dist.barrier()

    def postfix(self) -> dict:
        """The last validation's ECE on the progress bar."""
        return {"val_ece": f"{self.result.epochs[-1]['ece']:.4f}"} if self.result.epochs and \
            "ece" in self.result.epochs[-1] else {}

    def run(self) -> TrainResult:
        """Train for `config.epochs` (from the last checkpoint when resuming); the module is left in eval mode and
        the calibrator keeps the training record (with the final loss).

        Returns:
            The loss history and per-epoch validation metrics (those of earlier runs included when resuming).

        Raises:
            ATSError: on a non-finite loss or gradient (the last good checkpoint is kept).
        """
        super().run(rank=self.dist.rank, world_size=self.dist.world_size)
        if self.history:
            self.calibrator.record_training(self.record, final_loss=self.history[-1]["loss"])
        return self.result


def train_ats(calibrator: ATSCalibrator, train_store, backbone: Backbone, *, config: TrainingConfig | None = None,
              validate: Validator | None = None, out_dir: str | Path | None = None, resume: bool = False,
              progress: bool = True, on_step: Callable[[int], None] | None = None,
              dist: Dist | None = None) -> TrainResult:
    """Train `calibrator.head` in place on the instruction tokens of `train_store` (`TokenObjective`, `Trainer`);
    returns the loss history and the per-epoch validation metrics.

    Args:
        calibrator: the ATS calibrator whose head is trained.
        train_store: a FeatureStore or OnlineFeatures.
        backbone: the frozen backbone.
        config: the training settings; default `TrainingConfig()`.
        validate: called after each epoch with the calibrator; returns metrics to log.
        out_dir: the run folder for checkpoints; None: no checkpoints.
        resume: continue from the last checkpoint in `out_dir`.
        progress: show a progress bar.
        on_step: called with the global optimizer step after each step.
        dist: the process's place in a multi-process job; default one process.

    Returns:
        The loss history and the per-epoch validation metrics.

    Raises:
        ATSError: as `TokenObjective`, `Trainer` and `Trainer.run`.
    """
    config = config or TrainingConfig()
    trainer = Trainer(calibrator, TokenObjective(calibrator, train_store, backbone, config), config,
                      validate=validate, out_dir=out_dir, resume=resume, progress=progress, on_step=on_step,
                      dist=dist)
    return trainer.run()
