"""Training the ATS head on cached features: AdamW, cosine schedule with warmup, gradient accumulation, resume.

The backbone stays frozen; only the head learns. Each step takes a batch of whole sequences of hidden states (the
transformer head needs the context), computes tau for every position, and applies the calibration loss to the
response tokens, recomputing their logits from `h` in chunks (see losses.py).

Checkpoints (head weights, optimizer and schedule state, position in the data) are written atomically each epoch and
every `save_every` optimizer steps; `resume=True` continues from the last one and ends with the same weights as an
uninterrupted run with the same seed, because the data order depends only on (seed, epoch).
"""

from __future__ import annotations

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


def _micro_batches(store: FeatureStore, config: TrainingConfig, epoch: int):
    return store.batches(config.micro_batch_size, shuffle=True, seed=config.seed * 1000 + epoch)


def _steps_per_epoch(store: FeatureStore, config: TrainingConfig) -> int:
    micro = sum(math.ceil(s["sequences"] / config.micro_batch_size) for s in store.meta["shards"])
    return math.ceil(micro / config.accumulation)


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
) -> TrainResult:
    """Train `calibrator.head` in place on `train_store`; returns the loss history and per-epoch validation ECE.

    on_step: called with the global optimizer step after each step (and its checkpoint), e.g. for logging.
    """
    from .io import write_json

    config = config or TrainingConfig()
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

    def checkpoint(epoch: int, step_in_epoch: int) -> None:
        if out_dir is None:
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
               disable=not progress)
    for epoch in range(start_epoch, config.epochs):
        head.train()
        step_in_epoch, micro, running = 0, 0, []
        optimizer.zero_grad(set_to_none=True)
        for batch in _micro_batches(train_store, config, epoch):
            if step_in_epoch < skip_steps:  # resuming: replay the data order without training
                micro += 1
                if micro % config.accumulation == 0:
                    step_in_epoch += 1
                continue
            hidden = batch.hidden.to(backbone.device)  # (b, T, H)
            mask = batch.attention_mask.to(backbone.device)  # (b, T)
            labels = batch.labels.to(backbone.device)  # (b, T)
            with autocast:
                tau = calibrator.temperature(hidden, mask)  # (b, T)
            select = labels != IGNORE_INDEX
            out = calibration_loss(hidden[select], calibrator.scale(tau.float())[select], labels[select],
                                   backbone.logits, loss_type=c.loss_type, alpha=c.alpha, weighting=c.weighting,
                                   chunk_size=config.chunk_size)
            if not torch.isfinite(out.loss):
                raise ATSError(f"non-finite loss {out.loss.item()} at epoch {epoch}, step {step_in_epoch}; the last "
                               f"good checkpoint is kept in {out_dir}")
            (out.loss / config.accumulation).backward()
            running.append(out.loss.item())
            micro += 1
            if micro % config.accumulation:
                continue
            grad_norm = torch.nn.utils.clip_grad_norm_(head.parameters(), config.max_grad_norm)
            if not torch.isfinite(grad_norm):
                raise ATSError(f"non-finite gradient at epoch {epoch}, step {step_in_epoch}; the last good "
                               f"checkpoint is kept in {out_dir}")
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            step_in_epoch += 1
            loss = sum(running) / len(running)
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
        if running:  # a last partial accumulation: apply it
            torch.nn.utils.clip_grad_norm_(head.parameters(), config.max_grad_norm)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
        skip_steps = 0
        head.eval()
        if val_store is not None:
            from .metrics import summarize

            conf = token_confidences(val_store, backbone, {"ats": calibrator}, progress=False)["ats"]
            row = {"epoch": epoch, **summarize(*conf)}
            result.epochs.append(row)
            bar.set_postfix(loss=f"{result.history[-1]['loss']:.4f}" if result.history else "-",
                            val_ece=f"{row['ece']:.4f}")
        checkpoint(epoch + 1, 0)
    bar.close()
    head.eval()
    return result
