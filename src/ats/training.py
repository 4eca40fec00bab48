"""Training the ATS head on cached features: AdamW, cosine schedule with warmup, gradient accumulation, resume.

The backbone stays frozen; only the head learns. Each step takes a batch of whole sequences of hidden states (the
transformer head needs the context), computes tau for every position, and applies the calibration loss to the
response tokens, recomputing their logits from `h` in chunks (see losses.py).

Checkpoints (head weights, optimizer and schedule state, position in the data) are written atomically each epoch and
every `save_every` optimizer steps; `resume=True` continues from the last one and ends with the same weights as an
uninterrupted run with the same seed, because the data order depends only on (seed, epoch).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
from safetensors.torch import load_file, save_file
from tqdm.auto import tqdm
from transformers import get_cosine_schedule_with_warmup

from .ats import ATSCalibrator
from .backbone import Backbone
from .data import IGNORE_INDEX
from .distributed import SINGLE, Dist
from .errors import ATSError
from .features import FeatureStore
from .io import atomic_dir, read_json
from .losses import calibration_loss
from .token_eval import token_confidences

logger = logging.getLogger(__name__)


@dataclass
class TrainingConfig:
    """Defaults follow the paper for the transformer head: lr 5e-5, effective batch 8 sequences, 2 epochs."""

    lr: float = 5e-5
    epochs: int = 2
    batch_size: int = 8  # sequences per optimizer step (effective batch)
    micro_batch_size: int = 4  # sequences per forward; batch_size must be a multiple
    warmup_ratio: float = 0.05
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    seed: int = 0
    bf16: bool = False  # autocast the head in bfloat16 (GPU); the loss is always float32
    chunk_size: int = 1024  # tokens per logits chunk in the loss
    save_every: int = 0  # optimizer steps between checkpoints (0: once per epoch)

    def __post_init__(self) -> None:
        if self.batch_size % self.micro_batch_size:
            raise ATSError(f"batch_size {self.batch_size} must be a multiple of micro_batch_size "
                           f"{self.micro_batch_size}")
        for name in ("lr", "epochs", "batch_size", "micro_batch_size", "chunk_size"):
            if getattr(self, name) <= 0:
                raise ATSError(f"training option {name} must be positive, got {getattr(self, name)}")

    @property
    def accumulation(self) -> int:
        return self.batch_size // self.micro_batch_size


@dataclass
class TrainResult:
    history: list[dict] = field(default_factory=list)  # one row per optimizer step
    epochs: list[dict] = field(default_factory=list)  # validation metrics after each epoch


def _micro_batches(store: FeatureStore, config: TrainingConfig, epoch: int, *, rank: int = 0, world_size: int = 1,
                   start: int = 0):
    return store.batches(config.micro_batch_size, shuffle=True, seed=config.seed * 1000 + epoch, rank=rank,
                         world_size=world_size, start=start)


def _micro_per_epoch(store: FeatureStore, config: TrainingConfig) -> int:
    return sum(math.ceil(s["sequences"] / config.micro_batch_size) for s in store.meta["shards"])


def _steps_per_epoch(store: FeatureStore, config: TrainingConfig) -> int:
    return math.ceil(_micro_per_epoch(store, config) / config.accumulation)


def _save_checkpoint(path: Path, calibrator: ATSCalibrator, optimizer, scheduler, state: dict) -> None:
    """Head weights + optimizer/scheduler state as safetensors and JSON (no pickle), written atomically."""
    with atomic_dir(path) as tmp:
        calibrator.save_pretrained(tmp / "calibrator")
        opt = optimizer.state_dict()
        tensors = {}
        for pid, pstate in opt["state"].items():
            for key, value in pstate.items():
                tensors[f"{pid}.{key}"] = value if torch.is_tensor(value) else torch.tensor(value)
        save_file(tensors, str(tmp / "optimizer.safetensors"))
        trainer = {**state, "param_groups": opt["param_groups"], "scheduler": scheduler.state_dict()}
        (tmp / "trainer_state.json").write_text(__import__("json").dumps(trainer, indent=2))


def _load_checkpoint(path: Path, calibrator: ATSCalibrator, optimizer, scheduler) -> dict:
    loaded = ATSCalibrator.from_pretrained(path / "calibrator")
    calibrator.head.load_state_dict(loaded.head.state_dict())
    trainer = read_json(path / "trainer_state.json")
    tensors = load_file(str(path / "optimizer.safetensors"))
    state: dict = {}
    for key, value in tensors.items():
        pid, name = key.split(".", 1)
        state.setdefault(int(pid), {})[name] = value
    optimizer.load_state_dict({"state": state, "param_groups": trainer.pop("param_groups")})
    scheduler.load_state_dict(trainer.pop("scheduler"))
    return trainer


def latest_checkpoint(out_dir: Path) -> Path | None:
    pointer = out_dir / "checkpoints" / "latest.json"
    if not pointer.exists():
        return None
    name = read_json(pointer)["checkpoint"]
    path = out_dir / "checkpoints" / Path(name).name  # never outside the run folder
    return path if path.exists() else None


def train_ats(
    calibrator: ATSCalibrator,
    train_store: FeatureStore,
    backbone: Backbone,
    *,
    config: TrainingConfig | None = None,
    val_store: FeatureStore | None = None,
    out_dir: str | Path | None = None,
    resume: bool = False,
    progress: bool = True,
    on_step: Callable[[int], None] | None = None,
    dist: Dist | None = None,
) -> TrainResult:
    """Train `calibrator.head` in place on `train_store`; returns the loss history and per-epoch validation ECE.

    on_step: called with the global optimizer step after each step (and its checkpoint), e.g. for logging.
    train_store / val_store: a FeatureStore (cached features) or features.OnlineFeatures (backbone run per batch).
    dist: the process's place in a multi-process job (distributed.init_distributed()); default: one process.
        With W processes the global micro-batch sequence is dealt round-robin (micro-batch m goes to rank m % W),
        each rank accumulates accumulation / W micro-batches per step and DDP averages the gradients: each step
        applies the update of one process with the same batch_size (up to float rounding in the reduction). A
        last partial step of an epoch (the micro-batch count not divisible by the accumulation) is applied the
        same way as in one process (loss / accumulation per micro-batch), some ranks contributing zeros.
    """
    from .io import write_json

    dist = dist or SINGLE
    config = config or TrainingConfig()
    world, rank = dist.world_size, dist.rank
    if config.accumulation % world:
        raise ATSError(f"batch_size {config.batch_size} must be a multiple of micro_batch_size "
                       f"{config.micro_batch_size} x {world} processes")
    local_accumulation = config.accumulation // world
    train_store.check_backbone(backbone)
    calibrator.check_backbone(backbone)
    torch.manual_seed(config.seed)
    head = calibrator.head.to(backbone.device).train()
    c = calibrator.config_
    c.training = dataclasses.asdict(config)
    decay = [p for n, p in head.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in head.named_parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": config.weight_decay},
                                   {"params": no_decay, "weight_decay": 0.0}], lr=config.lr)
    micro_per_epoch = _micro_per_epoch(train_store, config)
    full_steps, remainder = divmod(micro_per_epoch, config.accumulation)
    steps_per_epoch = _steps_per_epoch(train_store, config)
    total_steps = steps_per_epoch * config.epochs
    scheduler = get_cosine_schedule_with_warmup(optimizer, round(config.warmup_ratio * total_steps), total_steps)
    out_dir = Path(out_dir) if out_dir is not None else None
    result = TrainResult()
    start_epoch, skip_steps = 0, 0
    if resume and out_dir is not None and (ckpt := latest_checkpoint(out_dir)) is not None:
        trainer = _load_checkpoint(ckpt, calibrator, optimizer, scheduler)
        start_epoch, skip_steps = trainer["epoch"], trainer["step_in_epoch"]
        result.history, result.epochs = trainer.get("history", []), trainer.get("epochs", [])
        logger.info("resuming from %s (epoch %d, step %d)", ckpt, start_epoch, skip_steps)
    if dist.distributed:  # only the head is data-parallel; the frozen backbone is never wrapped
        model, optimizer = dist.accelerator.prepare(head, optimizer)
        param = next(head.parameters())

        def temperature(hidden, mask):
            return model(hidden.to(param.device, param.dtype), mask)
    else:
        model, temperature = head, calibrator.temperature

    def checkpoint(epoch: int, step_in_epoch: int) -> None:
        if out_dir is None or not dist.is_main:  # only the main process writes
            return
        name = f"epoch{epoch}-step{step_in_epoch}"
        _save_checkpoint(out_dir / "checkpoints" / name, calibrator, optimizer, scheduler,
                         {"epoch": epoch, "step_in_epoch": step_in_epoch, "history": result.history,
                          "epochs": result.epochs})
        previous = latest_checkpoint(out_dir)
        write_json(out_dir / "checkpoints" / "latest.json", {"checkpoint": name})
        if previous is not None and previous.name != name:
            shutil.rmtree(previous, ignore_errors=True)

    autocast = torch.autocast(backbone.device.type, dtype=torch.bfloat16, enabled=config.bf16)
    bar = tqdm(total=total_steps, initial=start_epoch * steps_per_epoch + skip_steps, desc="train ATS head",
               disable=not progress or not dist.is_main)
    for epoch in range(start_epoch, config.epochs):
        head.train()
        step_in_epoch, running = skip_steps, []
        optimizer.zero_grad(set_to_none=True)
        # resuming: the first skip_steps steps' micro-batches are skipped without being read
        batches = _micro_batches(train_store, config, epoch, rank=rank, world_size=world,
                                 start=skip_steps * config.accumulation)
        for local, batch in enumerate(batches, start=skip_steps * local_accumulation):
            step = local // local_accumulation  # the optimizer step this micro-batch belongs to
            # DDP all-reduces on the backward of each rank's last micro-batch of a full step; a last partial step
            # is reduced by hand below (ranks may hold different numbers of its micro-batches)
            # (its micro-batches bypass the DDP wrapper: every DDP forward/backward must be matched on all ranks)
            ddp = dist.distributed and step < full_steps
            sync = step < full_steps and local % local_accumulation == local_accumulation - 1
            forward = temperature if ddp else calibrator.temperature
            with (model.no_sync() if ddp and not sync else contextlib.nullcontext()):
                hidden = batch.hidden.to(backbone.device)  # (b, T, H)
                mask = batch.attention_mask.to(backbone.device)  # (b, T)
                labels = batch.labels.to(backbone.device)  # (b, T)
                with autocast:
                    tau = forward(hidden, mask)  # (b, T)
                select = labels != IGNORE_INDEX
                out = calibration_loss(hidden[select], calibrator.scale(tau.float())[select], labels[select],
                                       backbone.logits, loss_type=c.loss_type, alpha=c.alpha,
                                       weighting=c.weighting, chunk_size=config.chunk_size)
                if not dist.distributed and not torch.isfinite(out.loss):  # distributed: checked over all ranks
                    raise ATSError(f"non-finite loss {out.loss.item()} at epoch {epoch}, step {step_in_epoch}; the "
                                   f"last good checkpoint is kept in {out_dir}")
                (out.loss / local_accumulation).backward()
            running.append(out.loss.item())
            if not sync:
                continue
            total, count = dist.all_sum([sum(running), len(running)])
            loss = total / count
            if not math.isfinite(loss):
                raise ATSError(f"non-finite loss {loss} at epoch {epoch}, step {step_in_epoch}; the last good "
                               f"checkpoint is kept in {out_dir}")
            grad_norm = torch.nn.utils.clip_grad_norm_(head.parameters(), config.max_grad_norm)
            if not torch.isfinite(grad_norm):
                raise ATSError(f"non-finite gradient at epoch {epoch}, step {step_in_epoch}; the last good "
                               f"checkpoint is kept in {out_dir}")
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            step_in_epoch += 1
            running = []
            result.history.append({"epoch": epoch, "step": step_in_epoch, "loss": loss,
                                   "lr": scheduler.get_last_lr()[0]})
            bar.update(1)
            bar.set_postfix(loss=f"{loss:.4f}", **({"val_ece": f"{result.epochs[-1]['ece']:.4f}"}
                                                   if result.epochs else {}))
            if config.save_every and step_in_epoch % config.save_every == 0:
                checkpoint(epoch, step_in_epoch)
            if on_step is not None:
                on_step(epoch * steps_per_epoch + step_in_epoch)
        if remainder:  # a last partial accumulation: apply it (as one process would: each loss / accumulation)
            dist.average_gradients(head.parameters())
            torch.nn.utils.clip_grad_norm_(head.parameters(), config.max_grad_norm)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
        skip_steps = 0
        head.eval()
        if val_store is not None:
            from .distributed import gathered_token_confidences
            from .metrics import summarize

            conf = gathered_token_confidences(val_store, backbone, {"ats": calibrator}, dist, progress=False)["ats"]
            row = {"epoch": epoch, **summarize(*conf)}
            result.epochs.append(row)
            bar.set_postfix(loss=f"{result.history[-1]['loss']:.4f}" if result.history else "-",
                            val_ece=f"{row['ece']:.4f}")
        checkpoint(epoch + 1, 0)
        dist.barrier()
    bar.close()
    head.eval()
    return result
