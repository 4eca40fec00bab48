"""Training a calibration head on the backbone's own labelled answers (`ats.evaluation.answers`), and scoring any head
on them without the backbone.

The objective is a proper scoring rule on the answer confidence exactly as the tasks compute it (softmax over the
choices; the mean calibrated token probability of a free-form answer), back-propagated through the head's scale s at
the answer positions (docs/method.md, "Heads trained on answers"):

- "answer-log": -[c log p + (1 - c) log(1 - p)], p the answer's confidence, c whether the answer is right;
- "answer-brier": (p - c)^2.

The head reads every row whole (the transformer head attends over the prompt); token log-probabilities at the scored
positions, log p_y(s) = s z_y - logsumexp(s z), come from the scale summary stored with the answers
(`ats.model.scale_summary`: no vocabulary-sized work at all), or, for sets without one or with `exact=True`, from
`scaled_cross_entropy` (the logits recomputed from the cached h in chunks); both give the gradient in s.
"""

from __future__ import annotations

import logging
import math
import random
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor
from tqdm.auto import tqdm
from transformers import get_cosine_schedule_with_warmup

from ..errors import ATSError
from ..evaluation.answers import AnswerSet, answer_confidence
from ..model.heads import tau_at
from ..model.scale_summary import scaled_ce_from_summary
from ..model.scaled_ce import scaled_cross_entropy
from ..training.config import TrainingConfig
from ..training.losses import ANSWER_LOSSES

logger = logging.getLogger(__name__)

def answer_loss(confidence: Tensor, correct: Tensor, loss_type: str) -> Tensor:
    """Mean proper score of the answers' confidence (Q,) against their correctness (Q,) bool.

    Args:
        confidence: (Q,) answer confidences in (0, 1], differentiable.
        correct: (Q,) bool.
        loss_type: "answer-log" or "answer-brier".

    Returns:
        The scalar loss.

    Raises:
        ATSError: if the loss type is unknown.
    """
    c = correct.to(confidence.dtype)
    if loss_type == "answer-log":
        p = confidence.clamp(1e-7, 1 - 1e-7)
        return -(c * torch.log(p) + (1 - c) * torch.log1p(-p)).mean()
    if loss_type == "answer-brier":
        return ((confidence - c) ** 2).mean()
    raise ATSError(f"answer loss must be one of {', '.join(ANSWER_LOSSES)}, got {loss_type!r}")


def _span(sorted_ids: Tensor, first: int, last: int) -> tuple[int, int]:
    """[start, end) of the entries of a nondecreasing tensor within [first, last]."""
    lo = int(torch.searchsorted(sorted_ids, torch.tensor(first)))
    hi = int(torch.searchsorted(sorted_ids, torch.tensor(last), right=True))
    return lo, hi


def scored_confidence(calibrator, answers: AnswerSet, questions: Tensor, logits_fn, *,
                      chunk_size: int = 1024, exact: bool = False) -> tuple[Tensor, Tensor]:
    """(confidence (Q_b,), correct (Q_b,)) of a contiguous run of questions under `calibrator` (None: uncalibrated);
    differentiable w.r.t. the head's parameters when grad is enabled.

    Args:
        calibrator: an ATS-family calibrator (its head gives s per token), or None for s = 1.
        answers: the set.
        questions: (Q_b,) consecutive question indices, increasing.
        logits_fn: the backbone's output layer, h (n, H) -> z (n, V).
        chunk_size: positions per logits chunk (exact route).
        exact: recompute the logits from the stored h even when the set carries the scale summary.

    Returns:
        (confidence, correct), by the task's own rule.
    """
    t = answers.tensors
    r0, r1 = _span(t["row_question"], int(questions[0]), int(questions[-1]))
    p0, p1 = _span(t["pos_row"], r0, r1 - 1)
    positions = torch.arange(p0, p1)
    offsets = t["row_offsets"]
    pos_row, pos_in_row = t["pos_row"][p0:p1], t["pos_in_row"][p0:p1]
    if calibrator is None:
        scale = torch.ones(p1 - p0)
    else:
        param = next(calibrator.head.parameters())
        lengths = (offsets[r0 + 1:r1 + 1] - offsets[r0:r1]).tolist()
        hidden = torch.zeros(r1 - r0, max(lengths), t["hidden"].shape[1], dtype=param.dtype)  # (R_b, T, H)
        mask = torch.zeros(r1 - r0, max(lengths), dtype=torch.long)  # (R_b, T)
        for i, n in enumerate(lengths):
            hidden[i, :n] = t["hidden"][offsets[r0 + i]:offsets[r0 + i] + n]
            mask[i, :n] = 1
        local = pos_row - r0  # (P_b,) row of each position within the batch, nondecreasing
        counts = torch.bincount(local, minlength=r1 - r0)  # (R_b,)
        slot = torch.arange(p1 - p0) - (counts.cumsum(0) - counts)[local]  # (P_b,) rank within its row
        index = torch.zeros(r1 - r0, max(1, int(counts.max())), dtype=torch.long)  # (R_b, K); padding: position 0
        index[local, slot] = pos_in_row
        tau = tau_at(calibrator.head, hidden.to(param.device), mask.to(param.device), index.to(param.device))
        scale = calibrator.scale(tau.float().cpu()[local, slot])  # (P_b,)
    if answers.kind == "letters":
        log_p = torch.zeros_like(scale)
    elif "summary" in t and not exact:
        log_p = -scaled_ce_from_summary(t["summary"][p0:p1], scale).ce_label
    else:
        h = t["hidden"][offsets[pos_row] + pos_in_row].float()  # (P_b, H)
        log_p = -scaled_cross_entropy(h, scale, t["pos_target"][p0:p1], logits_fn, chunk_size).ce_label
    return answer_confidence(answers, questions, scale, log_p, positions)


@torch.no_grad()
def score_answers(calibrator, answers: AnswerSet, logits_fn, *, batch_size: int = 32,
                  exact: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """(confidence (Q,), correct (Q,)) of every question of `answers` under `calibrator` (None: uncalibrated).

    Args:
        calibrator: an ATS-family calibrator or None.
        answers: the set.
        logits_fn: the backbone's output layer.
        batch_size: questions per head pass.
        exact: the exact route even when the set carries the scale summary.

    Returns:
        float64 confidences and bool correctness, in question order.
    """
    if calibrator is not None:
        calibrator.head.eval()
    conf, correct = [], []
    for start in range(0, len(answers), batch_size):
        q = torch.arange(start, min(start + batch_size, len(answers)))
        c, ok = scored_confidence(calibrator, answers, q, logits_fn, exact=exact)
        conf.append(c.double().numpy())
        correct.append(ok.numpy())
    return np.concatenate(conf), np.concatenate(correct)


@dataclass
class AnswerTrainResult:
    """The loss per optimizer step."""

    history: list[dict] = field(default_factory=list)


def answer_batches(sets: list[AnswerSet], batch_size: int, *, seed: int, epoch: int) -> list[tuple[int, Tensor]]:
    """The seeded order of (set index, consecutive questions) batches of one epoch: each set cut into runs of
    `batch_size` questions at a seeded offset, all runs shuffled together."""
    rng = random.Random(seed * 1000 + epoch)
    out = []
    for k, answers in enumerate(sets):
        n = len(answers)
        shift = rng.randrange(batch_size) if n > batch_size else 0
        cuts = [0] + list(range(shift or batch_size, n, batch_size)) + [n]
        out.extend((k, torch.arange(a, b)) for a, b in zip(cuts, cuts[1:]) if b > a)
    rng.shuffle(out)
    return out


def train_on_answers(calibrator, sets: list[AnswerSet], logits_fn, *, config: TrainingConfig, loss_type: str,
                     progress: bool = True) -> AnswerTrainResult:
    """Train `calibrator.head` in place on the answers of `sets` (one optimizer step per `config.batch_size`
    questions of one task), AdamW with a cosine schedule and warmup, seeded by `config.seed` without touching the
    global RNG.

    Args:
        calibrator: an ATS-family calibrator (transformer, linear or constant head).
        sets: the training tasks' answers.
        logits_fn: the backbone's output layer.
        config: lr (None: 1e-3), epochs, batch_size (questions per step), warmup, weight decay, clipping, seed.
        loss_type: one of `ANSWER_LOSSES`.
        progress: show a progress bar.

    Returns:
        The loss history; the head is left in eval mode.

    Raises:
        ATSError: if the loss type is unknown, no set holds a question, or a loss is not finite.
    """
    if loss_type not in ANSWER_LOSSES:
        raise ATSError(f"answer loss must be one of {', '.join(ANSWER_LOSSES)}, got {loss_type!r}")
    if not sets or not any(len(s) for s in sets):
        raise ATSError("train_on_answers: no answers to train on")
    head = calibrator.head.train()
    steps = sum(len(answer_batches(sets, config.batch_size, seed=config.seed, epoch=e)) for e in range(config.epochs))
    lr = config.lr if config.lr is not None else 1e-3
    decay = [p for p in head.parameters() if p.dim() >= 2]
    no_decay = [p for p in head.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": config.weight_decay},
                                   {"params": no_decay, "weight_decay": 0.0}], lr=lr)
    scheduler = get_cosine_schedule_with_warmup(optimizer, round(config.warmup_ratio * steps), steps)
    calibrator.config_.training = {**config.to_dict(), "loss_type": loss_type, "lr": lr, "optimizer_steps": steps,
                                   "data": "answers", "tasks": [s.name for s in sets]}
    result = AnswerTrainResult()
    bar = tqdm(total=steps, desc="train head on answers", disable=not progress)
    for epoch in range(config.epochs):
        for k, questions in answer_batches(sets, config.batch_size, seed=config.seed, epoch=epoch):
            conf, correct = scored_confidence(calibrator, sets[k], questions, logits_fn, chunk_size=config.chunk_size)
            loss = answer_loss(conf, correct, loss_type)
            if not torch.isfinite(loss):
                raise ATSError(f"non-finite answer loss at epoch {epoch} on {sets[k].name}")
            loss.backward()
            torch.nn.utils.clip_grad_norm_(head.parameters(), config.max_grad_norm)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            result.history.append({"epoch": epoch, "task": sets[k].name, "loss": loss.item()})
            bar.update(1)
            bar.set_postfix(loss=f"{result.history[-1]['loss']:.4f}")
    bar.close()
    head.eval()
    if not math.isfinite(result.history[-1]["loss"]):
        raise ATSError("training on answers ended with a non-finite loss")
    return result
