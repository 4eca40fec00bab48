"""Training a calibration head on cached (or online) features: AdamW, cosine schedule with warmup, gradient
accumulation, checkpoints, resume, several processes.

The backbone stays frozen; only the head learns. Each micro-batch holds whole sequences of hidden states (the
transformer head needs the context); the head gives tau for every position and the loss (`training.losses`) is
applied to the response tokens: from their scale summaries when the features carry them (no vocabulary-sized work),
else (`exact_loss`, online features, folders extracted without a summary) from logits recomputed from `h` in chunks.

Checkpoints are written each epoch and every `save_every` optimizer steps; `resume=True` continues from the last one
and ends with the same weights as an uninterrupted run, because the data order depends only on (seed, epoch).
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers import get_cosine_schedule_with_warmup

from ..calibrators.ats import ATSCalibrator
from ..calibrators.fit_loop import decay_groups
from ..errors import ATSError
from ..model.backbone import Backbone
from ..model.labels import IGNORE_INDEX
from .checkpoint import checkpoint_and_prune, latest_checkpoint, load_checkpoint
from .config import TrainingConfig
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
    """Whether the loss is computed from the features' scale summaries (else by the exact full-vocabulary route).

    The summary route is taken when the store carries a summary and `config.exact_loss` is off; online features
    carry none.

    Args:
        store: a FeatureStore or OnlineFeatures.
        config: the training settings.
        calibrator: the calibrator trained (its max_scale must be covered by the summary).

    Returns:
        True for the summary route.

    Raises:
        ATSError: if the head's max_scale exceeds the summary's.
    """
    spec = getattr(store, "scale_summary", None)
    if spec is None or config.exact_loss:
        return False
    if calibrator.config_.max_scale > spec.max_scale:
        raise ATSError(f"the head's max_scale {calibrator.config_.max_scale:g} exceeds the scale summary's "
                       f"{spec.max_scale:g} of the features in {getattr(store, 'directory', '?')}; train with "
                       "--exact-loss or extract the features with a larger summary max_scale")
    return True


class Trainer:
    """Trains `calibrator.head` in place; `run()` returns the loss history and per-epoch validation metrics.

    Construction builds the optimizer and schedule (the learning rate chosen is recorded in
    `calibrator.config_.training`) and, with `resume`, restores the last checkpoint. torch's global RNG is never
    seeded or drawn from: the data order comes from (seed, epoch), and each epoch runs on a forked RNG seeded from
    (seed, epoch) (`_epoch_rng`), so any randomness of a head is reproducible and leaves the caller's RNG as it was.

    Args:
        calibrator: the ATS calibrator whose head is trained.
        train_store: a FeatureStore (cached features) or OnlineFeatures (backbone run per batch).
        backbone: the frozen backbone (output layer and device).
        config: the loss and optimisation settings.
        validate: called after each epoch with the calibrator; its dict is logged (e.g. token-level ECE).
        out_dir: the run folder for checkpoints; None: no checkpoints.
        resume: continue from the last checkpoint in `out_dir`, if any.
        progress: show a progress bar (main process only).
        on_step: called with the global optimizer step after each step (and its checkpoint).
        dist: the process's place in a multi-process job (default: one process). With W processes the global
            micro-batch sequence is dealt round-robin (micro-batch m goes to rank m % W), each rank accumulates
            accumulation / W micro-batches per step and DDP averages the gradients, so each step applies the update
            of one process with the same batch_size (up to float rounding in the reduction). A last partial step of
            an epoch is applied as in one process (loss / accumulation per micro-batch), some ranks contributing
            zeros.

    Raises:
        ATSError: if the accumulation is not a multiple of W, or the features or the calibrator belong to another
            backbone.
    """

    def __init__(self, calibrator: ATSCalibrator, train_store, backbone: Backbone, config: TrainingConfig, *,
                 validate: Validator | None = None, out_dir: str | Path | None = None, resume: bool = False,
                 progress: bool = True, on_step: Callable[[int], None] | None = None, dist: Dist | None = None
                 ) -> None:
        self.calibrator, self.store, self.backbone, self.config = calibrator, train_store, backbone, config
        self.validate, self.on_step, self.dist = validate, on_step, dist or SINGLE
        self.out_dir = Path(out_dir) if out_dir is not None else None
        self.progress = progress and self.dist.is_main
        if config.accumulation % self.dist.world_size:
            raise ATSError(f"batch_size {config.batch_size} must be a multiple of micro_batch_size "
                           f"{config.micro_batch_size} x {self.dist.world_size} processes")
        self.local_accumulation = config.accumulation // self.dist.world_size
        train_store.check_backbone(backbone)
        calibrator.check_backbone(backbone)
        self.use_summary = uses_summary(train_store, config, calibrator)
        self.result = TrainResult()
        self._setup(resume)

    # --- setup ------------------------------------------------------------------------------------------------------
    def _setup(self, resume: bool) -> None:
        config = self.config
        self.head = head = self.calibrator.head.to(self.backbone.device).train()
        self.full_steps, self.remainder = divmod(micro_per_epoch(self.store, config), config.accumulation)
        self.steps_per_epoch = steps_per_epoch(self.store, config)
        total = self.steps_per_epoch * config.epochs
        self.lr = config.learning_rate(total)
        if config.lr is None:
            logger.info("learning rate %.3g, automatic for %d optimizer steps (set --lr to choose)", self.lr, total)
        self.calibrator.config_.training = {**config.to_dict(), "lr": self.lr, "lr_automatic": config.lr is None,
                                            "optimizer_steps": total}
        self.optimizer = torch.optim.AdamW(decay_groups(head, config.weight_decay), lr=self.lr)
        self.scheduler = get_cosine_schedule_with_warmup(self.optimizer, round(config.warmup_ratio * total), total)
        self.start = self._resume() if resume else (0, 0)  # (epoch, step in epoch)
        self.forward = self.calibrator.log_scale
        self.ddp_forward = self.forward
        if self.dist.distributed:  # only the head is data-parallel; the frozen backbone is never wrapped
            model, self.optimizer = self.dist.accelerator.prepare(head, self.optimizer)
            param = next(head.parameters())
            self.model = model
            self.ddp_forward = lambda hidden, mask: model(hidden.to(param.device, param.dtype), mask)

    def _resume(self) -> tuple[int, int]:
        """(epoch, step in epoch) of the last checkpoint, its state restored; (0, 0) if there is none."""
        ckpt = latest_checkpoint(self.out_dir) if self.out_dir is not None else None
        if ckpt is None:
            return 0, 0
        trainer = load_checkpoint(ckpt, self.calibrator, self.optimizer, self.scheduler)
        self.result.history, self.result.epochs = trainer.get("history", []), trainer.get("epochs", [])
        logger.info("resuming from %s (epoch %d, step %d)", ckpt, trainer["epoch"], trainer["step_in_epoch"])
        return trainer["epoch"], trainer["step_in_epoch"]

    def _checkpoint(self, epoch: int, step_in_epoch: int) -> None:
        if self.out_dir is None or not self.dist.is_main:  # only the main process writes
            return
        checkpoint_and_prune(self.out_dir, f"epoch{epoch}-step{step_in_epoch}", self.calibrator, self.optimizer,
                             self.scheduler, {"epoch": epoch, "step_in_epoch": step_in_epoch,
                                              "history": self.result.history, "epochs": self.result.epochs})

    # --- one micro-batch and one optimizer step ---------------------------------------------------------------------
    def _micro_step(self, batch, *, ddp: bool, sync: bool, where: str) -> float:
        """Forward and backward of one micro-batch (loss / local accumulation); returns its loss."""
        config, device = self.config, self.backbone.device
        forward = self.ddp_forward if ddp else self.forward
        with (self.model.no_sync() if ddp and not sync else contextlib.nullcontext()):
            hidden = batch.hidden.to(device)  # (b, T, H)
            mask = batch.attention_mask.to(device)  # (b, T)
            labels = batch.labels.to(device)  # (b, T)
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=config.bf16):
                tau = forward(hidden, mask)  # (b, T)
            select = labels != IGNORE_INDEX  # (b, T)
            n = int(select.sum())
            ignored = labels.shape[0] * (labels.shape[1] - 1) - n  # -100 positions among the shifted (b, T - 1)
            summary = batch.summary.to(device) if self.use_summary else None  # (n, D) or None
            out = calibration_loss(hidden[select], self.calibrator.scale(tau.float())[select], labels[select],
                                   self.backbone.logits, loss_type=config.loss_type, alpha=config.alpha,
                                   weighting=config.weighting, chunk_size=config.chunk_size, ignored=max(ignored, 0),
                                   summary=summary)
            if not self.dist.distributed and not torch.isfinite(out.loss):  # distributed: checked over all ranks
                raise ATSError(f"non-finite loss {out.loss.item()} at {where}; the last good checkpoint is kept in "
                               f"{self.out_dir}")
            (out.loss / self.local_accumulation).backward()
        return out.loss.item()

    def _optimizer_step(self, losses: list[float], where: str) -> float:
        """Average the logged loss over ranks, clip, step; returns the mean loss of the step."""
        total, count = self.dist.all_sum([sum(losses), len(losses)])
        loss = total / count
        if not math.isfinite(loss):
            raise ATSError(f"non-finite loss {loss} at {where}; the last good checkpoint is kept in {self.out_dir}")
        grad_norm = torch.nn.utils.clip_grad_norm_(self.head.parameters(), self.config.max_grad_norm)
        if not torch.isfinite(grad_norm):
            raise ATSError(f"non-finite gradient at {where}; the last good checkpoint is kept in {self.out_dir}")
        self._apply()
        return loss

    def _apply(self) -> None:
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)

    # --- epochs -----------------------------------------------------------------------------------------------------
    def _epoch(self, epoch: int, skip_steps: int, bar) -> None:
        """One pass over this rank's micro-batches, starting after `skip_steps` optimizer steps (resuming)."""
        config, dist = self.config, self.dist
        self.head.train()
        step_in_epoch, running = skip_steps, []
        self.optimizer.zero_grad(set_to_none=True)
        batches = self.store.batches(config.micro_batch_size, shuffle=True, seed=config.seed * 1000 + epoch,
                                     rank=dist.rank, world_size=dist.world_size,
                                     start=skip_steps * config.accumulation)  # skipped micro-batches are not read
        for local, batch in enumerate(batches, start=skip_steps * self.local_accumulation):
            step = local // self.local_accumulation  # the optimizer step this micro-batch belongs to
            # DDP all-reduces on the backward of each rank's last micro-batch of a full step; the micro-batches of a
            # last partial step bypass the DDP wrapper (ranks may hold different numbers of them) and are reduced
            # by hand below
            ddp = dist.distributed and step < self.full_steps
            sync = step < self.full_steps and local % self.local_accumulation == self.local_accumulation - 1
            where = f"epoch {epoch}, step {step_in_epoch}"
            running.append(self._micro_step(batch, ddp=ddp, sync=sync, where=where))
            if not sync:
                continue
            loss = self._optimizer_step(running, where)
            step_in_epoch += 1
            running = []
            self.result.history.append({"epoch": epoch, "step": step_in_epoch, "loss": loss,
                                        "lr": self.scheduler.get_last_lr()[0]})
            bar.update(1)
            bar.set_postfix(loss=f"{loss:.4f}", **self._val_postfix())
            if config.save_every and step_in_epoch % config.save_every == 0:
                self._checkpoint(epoch, step_in_epoch)
            if self.on_step is not None:
                self.on_step(epoch * self.steps_per_epoch + step_in_epoch)
        if self.remainder:  # a last partial accumulation: applied as one process would (each loss / accumulation)
            dist.average_gradients(self.head.parameters())
            torch.nn.utils.clip_grad_norm_(self.head.parameters(), config.max_grad_norm)
            self._apply()

    @contextlib.contextmanager
    def _epoch_rng(self, epoch: int):
        """A forked torch RNG (CPU and the head's GPU) seeded from (seed, epoch), restored afterwards."""
        device = next(self.head.parameters()).device
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            torch.manual_seed(self.config.seed * 1000 + epoch)
            yield

    def _val_postfix(self) -> dict:
        return {"val_ece": f"{self.result.epochs[-1]['ece']:.4f}"} if self.result.epochs and \
            "ece" in self.result.epochs[-1] else {}

    def run(self) -> TrainResult:
        """Train for `config.epochs` (from the last checkpoint when resuming); the head is left in eval mode.

        Returns:
            The loss history and per-epoch validation metrics (those of earlier runs included when resuming).

        Raises:
            ATSError: on a non-finite loss or gradient (the last good checkpoint is kept).
        """
        start_epoch, skip_steps = self.start
        bar = tqdm(total=self.steps_per_epoch * self.config.epochs,
                   initial=start_epoch * self.steps_per_epoch + skip_steps, desc="train head",
                   disable=not self.progress)
        for epoch in range(start_epoch, self.config.epochs):
            with self._epoch_rng(epoch):
                self._epoch(epoch, skip_steps, bar)
            skip_steps = 0
            self.head.eval()
            if self.validate is not None:
                self.result.epochs.append({"epoch": epoch, **self.validate(self.calibrator)})
                bar.set_postfix(loss=f"{self.result.history[-1]['loss']:.4f}" if self.result.history else "-",
                                **self._val_postfix())
            self._checkpoint(epoch + 1, 0)
            self.dist.barrier()
        bar.close()
        self.head.eval()
        return self.result


def train_ats(calibrator: ATSCalibrator, train_store, backbone: Backbone, *, config: TrainingConfig | None = None,
              validate: Validator | None = None, out_dir: str | Path | None = None, resume: bool = False,
              progress: bool = True, on_step: Callable[[int], None] | None = None,
              dist: Dist | None = None) -> TrainResult:
    """Train `calibrator.head` in place on `train_store` (see `Trainer`); returns the loss history and the
    per-epoch validation metrics.

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
        ATSError: as `Trainer` and `Trainer.run`.
    """
    trainer = Trainer(calibrator, train_store, backbone, config or TrainingConfig(), validate=validate,
                      out_dir=out_dir, resume=resume, progress=progress, on_step=on_step, dist=dist)
    return trainer.run()
