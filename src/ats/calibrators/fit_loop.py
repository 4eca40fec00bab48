"""The one optimisation loop of every learned calibrator: AdamW (weight decay on matrices only) over an `Objective`'s
micro-batches, epoch by epoch, `accumulation` micro-batches per optimizer step, optional gradient clipping and
learning-rate schedule, each epoch on a torch RNG forked and seeded from (seed, epoch).

Thermometer's fit on instruction tokens and vector scaling run it as it is; `ats.training.trainer.Trainer` builds on
it (accelerate's accumulation and data parallelism, checkpoints and resume, validation, the training record) by its
hooks: `accumulate`, `backward`, `idle_backward`, `all_sum`, `after_step`, `after_epoch`. It sits below the training
layer, so the calibrators use it without importing anything above them.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterable, Iterator
from itertools import islice
from typing import Protocol

import torch
from torch import Tensor, nn
from tqdm.auto import tqdm

from ..errors import ATSError


class Objective(Protocol):
    """What the loop minimises.

    what: its name in errors and on the progress bar; accumulation: micro-batches per optimizer step; steps(epoch):
    the optimizer steps of an epoch (a last partial one counts), or None for "until the micro-batches end" (one
    process); micro_batches(epoch, rank=, world_size=, start=): this process's micro-batches of the epoch (global
    micro-batch m goes to rank m % world_size; the first `start` are skipped); loss(batch, model): (the loss,
    {statistic: value}) of one micro-batch, `model` the data-parallel module (None on one process), or None when the
    micro-batch holds nothing to learn from (no update comes of a step without any loss).
    """

    what: str
    accumulation: int

    def steps(self, epoch: int) -> int | None: ...

    def micro_batches(self, epoch: int, *, rank: int, world_size: int, start: int) -> Iterator: ...

    def loss(self, batch, model) -> tuple[Tensor, dict] | None: ...


def decay_groups(module: nn.Module, weight_decay: float) -> list[dict]:
    """AdamW parameter groups: `weight_decay` on the weight matrices (dim >= 2), none on biases, norms and vectors.

    Args:
        module: the network being trained.
        weight_decay: the decay of the matrices.

    Returns:
        Two parameter groups, matrices first.
    """
    decay = [p for p in module.parameters() if p.dim() >= 2]
    no_decay = [p for p in module.parameters() if p.dim() < 2]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


class FitLoop:
    """Trains `module` in place on `objective`; `run()` returns one history row per optimizer step
    ({"epoch", "step", statistic..., "loss", "lr"}) and leaves the module in eval mode.

    Args:
        module: the parameters trained (moved nowhere: the caller places it).
        objective: what is minimised.
        lr: AdamW's learning rate (the schedule's peak).
        weight_decay: AdamW's decay of the weight matrices (`decay_groups`).
        epochs: passes over the micro-batches.
        seed: the seed of each epoch's forked RNG (seed * 1000 + epoch).
        max_grad_norm: clip the gradient norm to this before each step; None: no clipping.
        schedule: optimizer -> a learning-rate scheduler stepped after every optimizer step; None: a constant rate.
        progress: show a progress bar.
    """

    failure_note = ""  # appended to a non-finite loss's error (the trainer names its last checkpoint)

    def __init__(self, module: nn.Module, objective: Objective, *, lr: float, weight_decay: float, epochs: int,
                 seed: int = 0, max_grad_norm: float | None = None,
                 schedule: Callable[[torch.optim.Optimizer], object] | None = None, progress: bool = False) -> None:
        self.module, self.objective, self.epochs, self.seed = module.train(), objective, epochs, seed
        self.max_grad_norm, self.progress = max_grad_norm, progress
        self.optimizer = torch.optim.AdamW(decay_groups(module, weight_decay), lr=lr)
        self.scheduler = schedule(self.optimizer) if schedule is not None else None
        self.local_accumulation = objective.accumulation
        self.model = None  # the data-parallel module (`Trainer`)
        self.distributed = False
        self.history: list[dict] = []
        self.start = (0, 0)  # (epoch, step in epoch) to begin at (`Trainer` resuming)
        self.last_batch = None

    # --- hooks (`ats.training.trainer.Trainer` overrides them) --------------------------------------------------------
    def accumulate(self):
        """The context of one micro-batch's forward and backward (accelerate's `accumulate` in the trainer)."""
        return contextlib.nullcontext()

    def backward(self, loss: Tensor) -> None:
        """Back-propagate one micro-batch's share of the step's loss."""
        (loss / self.local_accumulation).backward()

    def idle_backward(self) -> None:
        """What a process without a micro-batch left in a step does (joins the gradient all-reduce, distributed)."""

    def all_sum(self, values: list[float]) -> list[float]:
        """Sums over processes (one process: the values)."""
        return values

    def after_step(self, epoch: int, step_in_epoch: int, step: int) -> None:
        """After each optimizer step (`step` counts from the start of training; checkpoints in the trainer)."""

    def after_epoch(self, epoch: int, bar) -> None:
        """After each epoch, the module in eval mode (validation and checkpoints in the trainer)."""

    # --- the loop -----------------------------------------------------------------------------------------------------
    @property
    def lr(self) -> float:
        """The learning rate of the next step."""
        return self.scheduler.get_last_lr()[0] if self.scheduler is not None else self.optimizer.param_groups[0]["lr"]

    def _failure(self, what: str, where: str) -> ATSError:
        return ATSError(f"{self.objective.what}: {what} at {where}{self.failure_note}")

    def _step(self, batches: list, where: str) -> tuple[float, dict] | None:
        """One optimizer step on this process's micro-batches of it (at most the local accumulation; the rest join
        idle): forward and backward of each, then the mean loss over processes, clipping and the update. Returns
        (mean loss, mean statistics), or None (no update) when no micro-batch had anything to learn from."""
        losses, stats = [], {}
        for k in range(self.local_accumulation):
            batch = batches[k] if k < len(batches) else None
            with self.accumulate():
                if batch is None:
                    self.idle_backward()
                    continue
                out = self.objective.loss(batch, self.model)
                if out is None:
                    continue
                loss, extra = out
                if not self.distributed and not torch.isfinite(loss):  # distributed: checked over all processes
                    raise self._failure(f"non-finite loss {loss.item()}", where)
                self.backward(loss)
                losses.append(loss.item())
                for key, value in extra.items():
                    stats[key] = stats.get(key, 0.0) + value / len(batches)
                self.last_batch = batch
        total, count = self.all_sum([sum(losses), len(losses)])
        if count == 0:
            self.optimizer.zero_grad(set_to_none=True)
            return None
        loss = total / count
        if not math.isfinite(loss):
            raise self._failure(f"non-finite loss {loss}", where)
        if self.max_grad_norm is not None:
            grad_norm = torch.nn.utils.clip_grad_norm_(self.module.parameters(), self.max_grad_norm)
            if not torch.isfinite(grad_norm):
                raise self._failure("non-finite gradient", where)
        self.optimizer.step()
        if self.scheduler is not None:
            self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss, stats

    def _epoch(self, epoch: int, skip_steps: int, done: int, bar, rank: int = 0, world_size: int = 1) -> int:
        """One pass over this process's micro-batches, starting after `skip_steps` optimizer steps (resuming);
        returns the steps taken (those skipped included)."""
        self.module.train()
        self.optimizer.zero_grad(set_to_none=True)
        steps = self.objective.steps(epoch)
        batches = iter(self.objective.micro_batches(epoch, rank=rank, world_size=world_size,
                                                    start=skip_steps * self.objective.accumulation))
        step_in_epoch = skip_steps
        while steps is None or step_in_epoch < steps:
            group = list(islice(batches, self.local_accumulation))
            if steps is None and not group:
                break
            out = self._step(group, f"epoch {epoch}, step {step_in_epoch}")
            step_in_epoch += 1
            bar.update(1)
            if out is not None:
                loss, stats = out
                self.history.append({"epoch": epoch, "step": step_in_epoch, **stats, "loss": loss, "lr": self.lr})
                bar.set_postfix(loss=f"{loss:.4f}", **self.postfix())
            self.after_step(epoch, step_in_epoch, done + step_in_epoch)
        return step_in_epoch

    def postfix(self) -> dict:
        """More for the progress bar (the trainer's validation ECE)."""
        return {}

    @contextlib.contextmanager
    def epoch_rng(self, epoch: int):
        """A forked torch RNG (CPU and the module's GPU) seeded from (seed, epoch), restored afterwards: any
        randomness of an epoch is reproducible and the caller's RNG is left as it was."""
        device = next(self.module.parameters()).device
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            torch.manual_seed(self.seed * 1000 + epoch)
            yield

    def total_steps(self) -> int | None:
        """Optimizer steps of the whole run, None when an epoch's are unknown."""
        steps = [self.objective.steps(epoch) for epoch in range(self.epochs)]
        return None if None in steps else sum(steps)

    def run(self, rank: int = 0, world_size: int = 1) -> list[dict]:
        """Train for `epochs` (from `start` when resuming); the module ends in eval mode.

        Returns:
            The history: one row per optimizer step (those of earlier runs included when resuming).

        Raises:
            ATSError: on a non-finite loss or gradient.
        """
        start_epoch, skip_steps = self.start
        done = sum(self.objective.steps(epoch) or 0 for epoch in range(start_epoch))
        bar = tqdm(total=self.total_steps(), initial=done + skip_steps, desc=self.objective.what,
                   disable=not self.progress)
        for epoch in range(start_epoch, self.epochs):
            with self.epoch_rng(epoch):
                done += self._epoch(epoch, skip_steps, done, bar, rank, world_size)
            skip_steps = 0
            self.module.eval()
            self.after_epoch(epoch, bar)
        bar.close()
        self.module.eval()
        return self.history


class BatchObjective:
    """An `Objective` of one process and one micro-batch per step, from two functions: `batches(epoch)` -> the
    epoch's batches (called once per epoch, in order), `loss_of(batch)` -> (loss, statistics) or None (nothing to
    learn from: no step); `steps_per_epoch` for the progress bar (None: unknown)."""

    accumulation = 1

    def __init__(self, what: str, batches: Callable[[int], Iterable], loss_of: Callable[[object], tuple | None],
                 steps_per_epoch: int | None = None) -> None:
        self.what, self.batches, self.loss_of, self.steps_per_epoch = what, batches, loss_of, steps_per_epoch

    def steps(self, epoch: int) -> int | None:
        """The steps of every epoch, or None."""
        return self.steps_per_epoch

    def micro_batches(self, epoch: int, *, rank: int, world_size: int, start: int) -> Iterator:
        """The epoch's batches from the `start`-th on (one process only)."""
        if world_size != 1:
            raise ATSError(f"{self.what}: fitted on one process")
        return islice(iter(self.batches(epoch)), start, None)

    def loss(self, batch, model) -> tuple[Tensor, dict] | None:
        """`loss_of(batch)`."""
        return self.loss_of(batch)
