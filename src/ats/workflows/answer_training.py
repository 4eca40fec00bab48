"""Training a calibrator on the backbone's own labelled answers (`ats.training.answers`): the answer loss
(`ats.training.losses.answer_loss`) of the confidence exactly as the tasks compute it, back-propagated through the
calibrator's scale at the answer positions (its own `scales_at`: an ATS-family head's per-token s, or Thermometer's one
s per question with its Gamma prior as a penalty), optionally with a token-level proper term on instruction data
(`token_weight` x top-label) so that token calibration does not collapse (docs/method.md, "Heads trained on answers").
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field

import torch
from tqdm.auto import tqdm
from transformers import get_cosine_schedule_with_warmup

from ..calibrators.fit_loop import decay_groups
from ..errors import ATSError
from ..training.answers import AnswerSet, answer_batches, confidence_and_penalty, cycled_batches, token_term
from ..training.config import TrainingConfig
from ..training.losses import ANSWER_LOSSES, answer_loss

logger = logging.getLogger(__name__)


@dataclass
class AnswerTrainResult:
    """The loss per optimizer step."""

    history: list[dict] = field(default_factory=list)


DEFAULT_ANSWER_LR = 1e-3  # the learning rate of answer training when the config leaves it unset


def answer_lr(config: TrainingConfig) -> float:
    """The learning rate answer training uses: `config.lr`, or DEFAULT_ANSWER_LR when unset."""
    return config.lr if config.lr is not None else DEFAULT_ANSWER_LR


def token_record(token_weight: float, token_max: int | None, token_window: int | None) -> dict:
    """The token-term fields of a training record (the subset and window only when the term is on)."""
    return {"token_weight": token_weight,
            **({"token_max": token_max, "token_window": token_window} if token_weight > 0 else {})}


def answer_record(config: TrainingConfig, loss_type: str, *, tasks: list[str], token_weight: float,
                  token_max: int | None, token_window: int | None, optimizer_steps: int | None = None) -> dict:
    """The training record of a calibrator trained on answers: what `train_on_answers` writes with it (with the
    optimizer steps) and what a rerun compares before reusing it (without)."""
    steps = {} if optimizer_steps is None else {"optimizer_steps": optimizer_steps}
    return {**config.to_dict(), "loss_type": loss_type, "lr": answer_lr(config), **steps, "data": "answers",
            "tasks": list(tasks), **token_record(token_weight, token_max, token_window)}


def train_on_answers(calibrator, sets: list[AnswerSet], logits_fn, *, config: TrainingConfig, loss_type: str,
                     token_store=None, token_weight: float = 0.0, token_max: int | None = 256,
                     token_window: int | None = 512, progress: bool = True) -> AnswerTrainResult:
    """Train `calibrator` in place on the answers of `sets` (one optimizer step per `config.batch_size` questions of
    one task), AdamW with a cosine schedule and warmup, seeded by `config.seed` without touching the global RNG.

    Args:
        calibrator: an ATS-family calibrator (transformer, linear or constant head) or a Thermometer (its Gamma prior
            joins the loss; it is marked fitted at the end).
        sets: the training tasks' answers.
        logits_fn: the backbone's output layer.
        config: lr (None: DEFAULT_ANSWER_LR), epochs, batch_size (questions per step), warmup, weight decay,
            clipping, seed.
        loss_type: one of `ANSWER_LOSSES`.
        token_store: an instruction `FeatureStore` of the same backbone; with `token_weight` > 0 every step adds
            `token_weight` x the top-label loss of one of its sequences (ATS-family heads only).
        token_weight: the weight of that token-level term.
        token_max: response tokens per step in that term (a seeded random subset of the window's; None: all).
        token_window: the instruction sequence's first positions the term reads (None: all of them).
        progress: show a progress bar.

    Returns:
        The loss history; the module is left in eval mode.

    Raises:
        ATSError: if the loss type is unknown, no set holds a question, the token term is asked without a store or
            for a Thermometer, or a loss is not finite.
    """
    if loss_type not in ANSWER_LOSSES:
        raise ATSError(f"answer loss must be one of {', '.join(ANSWER_LOSSES)}, got {loss_type!r}")
    if not sets or not any(len(s) for s in sets):
        raise ATSError("train_on_answers: no answers to train on")
    if token_weight > 0 and (token_store is None or not calibrator.token_head):
        raise ATSError("train_on_answers: token_weight > 0 needs an instruction feature store and an ATS-family head")
    tokens = cycled_batches(token_store, config.seed) if token_weight > 0 else None
    generator = torch.Generator().manual_seed(config.seed)
    module = calibrator.trainable.train()
    steps = sum(len(answer_batches(sets, config.batch_size, seed=config.seed, epoch=e)) for e in range(config.epochs))
    optimizer = torch.optim.AdamW(decay_groups(module, config.weight_decay), lr=answer_lr(config))
    scheduler = get_cosine_schedule_with_warmup(optimizer, round(config.warmup_ratio * steps), steps)
    record = answer_record(config, loss_type, tasks=[s.name for s in sets], token_weight=token_weight,
                           token_max=token_max, token_window=token_window, optimizer_steps=steps)
    result = AnswerTrainResult()
    bar = tqdm(total=steps, desc="train on answers", disable=not progress)
    for epoch in range(config.epochs):
        for k, questions in answer_batches(sets, config.batch_size, seed=config.seed, epoch=epoch):
            conf, correct, penalty = confidence_and_penalty(calibrator, sets[k], questions, logits_fn,
                                                            chunk_size=config.chunk_size)
            loss = answer_loss(conf, correct, loss_type) + penalty
            entry = {"epoch": epoch, "task": sets[k].name, "answer_loss": loss.item()}
            if tokens is not None:
                term = token_term(calibrator, next(tokens), logits_fn, chunk_size=config.chunk_size,
                                  max_tokens=token_max, window=token_window, generator=generator)
                entry["token_loss"] = term.item()
                loss = loss + token_weight * term
            if not torch.isfinite(loss):
                raise ATSError(f"non-finite answer loss at epoch {epoch} on {sets[k].name}")
            loss.backward()
            torch.nn.utils.clip_grad_norm_(module.parameters(), config.max_grad_norm)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            result.history.append({**entry, "loss": loss.item()})
            bar.update(1)
            bar.set_postfix(loss=f"{result.history[-1]['loss']:.4f}")
    bar.close()
    module.eval()
    if not math.isfinite(result.history[-1]["loss"]):
        raise ATSError("training on answers ended with a non-finite loss")
    calibrator.record_training(record, final_loss=result.history[-1]["loss"])
    return result
