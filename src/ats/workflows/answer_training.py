"""Training a calibration head on the backbone's own labelled answers (`ats.evaluation.answers`), and scoring any head
on them without the backbone.

The objective is a proper scoring rule on the answer confidence exactly as the tasks compute it (softmax over the
choices; the mean calibrated token probability of a free-form answer), back-propagated through the head's scale s at
the answer positions (docs/method.md, "Heads trained on answers"):

- "answer-log": -[c log p + (1 - c) log(1 - p)], p the answer's confidence, c whether the answer is right;
- "answer-brier": (p - c)^2.

What is trained (`scale_module`): an ATS-family head (per-token s = exp(tau) from the whole row: the transformer head
attends over the prompt) or Thermometer (Shen et al. 2024; one s = 1/T per question from the hidden state at the
prompt's last token, i.e. the row's first scored position, with its Gamma prior on T added to the loss). Optionally
a token-level proper term on instruction data joins the answer loss (`token_weight` x top-label, the tokens'
confidence log loss), so that token calibration does not collapse. Token log-probabilities at the scored
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

from ..calibrators.fit_loop import decay_groups
from ..errors import ATSError
from ..evaluation.answers import AnswerSet, answer_confidence
from ..model.heads import tau_at
from ..model.scale_summary import scaled_ce_from_summary
from ..model.scaled_ce import scaled_cross_entropy
from ..training.config import ANSWER_LOSSES, TrainingConfig

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


def scale_module(calibrator) -> torch.nn.Module:
    """The trainable module of an answer-trained calibrator: Thermometer's network or the ATS-family head."""
    return calibrator.net if calibrator.prompt_hidden else calibrator.head


def position_scales(calibrator, t: dict, rows: tuple[int, int], positions: tuple[int, int]) -> tuple[Tensor, Tensor]:
    """(scale s (P_b,), penalty ()) at the scored positions [p0, p1) of the rows [r0, r1) of an answer set's tensors.

    None: s = 1. ATS family: the head's per-token s over each whole row. Thermometer: one s = 1/T per row, read at
    the row's first scored position (the prompt's last token: the choices of a question share it), and the penalty
    `prior_weight` x the mean Gamma prior of the rows' T (zero for the other calibrators).
    """
    (r0, r1), (p0, p1) = rows, positions
    if calibrator is None:
        return torch.ones(p1 - p0), torch.zeros(())
    offsets = t["row_offsets"]
    local = t["pos_row"][p0:p1] - r0  # (P_b,) row of each position within the batch, nondecreasing
    pos_in_row = t["pos_in_row"][p0:p1]
    counts = torch.bincount(local, minlength=r1 - r0)  # (R_b,)
    first = counts.cumsum(0) - counts  # (R_b,) index of each row's first scored position within the batch
    if calibrator.prompt_hidden:  # Thermometer: one scale per question, from the prompt's last state
        at = pos_in_row[first.clamp(max=max(p1 - p0 - 1, 0))] if p1 > p0 else torch.zeros_like(first)
        h = t["hidden"][offsets[r0:r1] + at].float()  # (R_b, H) the prompts' last tokens (unused for empty rows)
        s_row = calibrator.inverse_temperature(h).float().cpu()  # (R_b,)
        penalty = calibrator.prior_weight * calibrator.prior(1.0 / s_row[counts > 0]).mean()
        return s_row[local], penalty
    param = next(calibrator.head.parameters())
    lengths = (offsets[r0 + 1:r1 + 1] - offsets[r0:r1]).tolist()
    hidden = torch.zeros(r1 - r0, max(lengths), t["hidden"].shape[1], dtype=param.dtype)  # (R_b, T, H)
    mask = torch.zeros(r1 - r0, max(lengths), dtype=torch.long)  # (R_b, T)
    for i, n in enumerate(lengths):
        hidden[i, :n] = t["hidden"][offsets[r0 + i]:offsets[r0 + i] + n]
        mask[i, :n] = 1
    slot = torch.arange(p1 - p0) - first[local]  # (P_b,) rank within its row
    index = torch.zeros(r1 - r0, max(1, int(counts.max())), dtype=torch.long)  # (R_b, K); padding: position 0
    index[local, slot] = pos_in_row
    tau = tau_at(calibrator.head, hidden.to(param.device), mask.to(param.device), index.to(param.device))
    return calibrator.scale(tau.float().cpu()[local, slot]), torch.zeros(())


def scored_confidence(calibrator, answers: AnswerSet, questions: Tensor, logits_fn, *,
                      chunk_size: int = 1024, exact: bool = False) -> tuple[Tensor, Tensor]:
    """(confidence (Q_b,), correct (Q_b,)) of a contiguous run of questions under `calibrator` (None: uncalibrated);
    differentiable w.r.t. the head's parameters when grad is enabled.

    Args:
        calibrator: an ATS-family calibrator or Thermometer (`position_scales`), or None for s = 1.
        answers: the set.
        questions: (Q_b,) consecutive question indices, increasing.
        logits_fn: the backbone's output layer, h (n, H) -> z (n, V).
        chunk_size: positions per logits chunk (exact route).
        exact: recompute the logits from the stored h even when the set carries the scale summary.

    Returns:
        (confidence, correct), by the task's own rule.
    """
    conf, correct, _ = confidence_and_penalty(calibrator, answers, questions, logits_fn, chunk_size=chunk_size,
                                              exact=exact)
    return conf, correct


def confidence_and_penalty(calibrator, answers: AnswerSet, questions: Tensor, logits_fn, *, chunk_size: int = 1024,
                           exact: bool = False) -> tuple[Tensor, Tensor, Tensor]:
    """(confidence, correct, penalty): `scored_confidence` (same arguments) and the calibrator's penalty on these
    questions (`position_scales`), which training adds to the answer loss."""
    t = answers.tensors
    r0, r1 = _span(t["row_question"], int(questions[0]), int(questions[-1]))
    p0, p1 = _span(t["pos_row"], r0, r1 - 1)
    positions = torch.arange(p0, p1)
    offsets = t["row_offsets"]
    pos_row, pos_in_row = t["pos_row"][p0:p1], t["pos_in_row"][p0:p1]
    scale, penalty = position_scales(calibrator, t, (r0, r1), (p0, p1))
    if answers.kind == "letters":
        log_p = torch.zeros_like(scale)
    elif "summary" in t and not exact:
        log_p = -scaled_ce_from_summary(t["summary"][p0:p1], scale).ce_label
    else:
        h = t["hidden"][offsets[pos_row] + pos_in_row].float()  # (P_b, H)
        log_p = -scaled_cross_entropy(h, scale, t["pos_target"][p0:p1], logits_fn, chunk_size).ce_label
    return (*answer_confidence(answers, questions, scale, log_p, positions), penalty)


@torch.no_grad()
def score_answers(calibrator, answers: AnswerSet, logits_fn, *, batch_size: int = 32,
                  exact: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """(confidence (Q,), correct (Q,)) of every question of `answers` under `calibrator` (None: uncalibrated).

    Args:
        calibrator: an ATS-family calibrator, Thermometer, or None.
        answers: the set.
        logits_fn: the backbone's output layer.
        batch_size: questions per head pass.
        exact: the exact route even when the set carries the scale summary.

    Returns:
        float64 confidences and bool correctness, in question order.
    """
    if calibrator is not None:
        scale_module(calibrator).eval()
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


def token_term(calibrator, batch, logits_fn, *, chunk_size: int, max_tokens: int | None = None,
               window: int | None = None, generator: torch.Generator | None = None) -> Tensor:
    """The top-label log loss of the head's calibrated top-1 confidence on one batch of instruction sequences
    (`ats.training.features.SequenceBatch`): the token-level proper term that keeps token calibration honest.

    The head reads the sequences' first `window` positions (None: all; a causal head's output there is exactly its
    output on the whole sequence); with `max_tokens`, the loss is the mean over a random subset of that many of
    their response tokens (unbiased, and the exact route then builds logits for those tokens only)."""
    from ..model.labels import IGNORE_INDEX
    from ..training.losses import calibration_loss

    T = batch.hidden.shape[1] if window is None else min(window, batch.hidden.shape[1])
    select_all = batch.labels != IGNORE_INDEX  # (B, T_full)
    in_window = torch.zeros_like(select_all)
    in_window[:, :T] = True
    keep_rows = in_window[select_all]  # (N,) which summary rows (row-major response positions) lie in the window
    param = next(calibrator.head.parameters())
    hidden_w = batch.hidden[:, :T]  # (B, T, H)
    tau = calibrator.head(hidden_w.to(param.device, param.dtype), batch.attention_mask[:, :T].to(param.device))
    select = select_all[:, :T]  # (B, T)
    hidden, scale, labels = hidden_w[select], calibrator.scale(tau.float().cpu())[select], batch.labels[:, :T][select]
    summary = batch.summary[keep_rows] if batch.summary is not None else None  # (N_w, D), same order, or None
    if max_tokens is not None and labels.numel() > max_tokens:
        keep = torch.randperm(labels.numel(), generator=generator)[:max_tokens]  # (max_tokens,)
        hidden, scale, labels = hidden[keep], scale[keep], labels[keep]
        summary = summary[keep] if summary is not None else None
    return calibration_loss(hidden, scale, labels, logits_fn, loss_type="top-label", chunk_size=chunk_size,
                            summary=summary).loss


def _cycled_batches(store, seed: int):
    """Endless single-sequence batches of an instruction feature store, reshuffled (seeded) on every pass."""
    npass = 0
    while True:
        yield from store.batches(1, shuffle=True, seed=seed * 1000 + npass)
        npass += 1


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
    thermometer = calibrator.prompt_hidden
    if token_weight > 0 and (token_store is None or thermometer):
        raise ATSError("train_on_answers: token_weight > 0 needs an instruction feature store and an ATS-family head")
    tokens = _cycled_batches(token_store, config.seed) if token_weight > 0 else None
    generator = torch.Generator().manual_seed(config.seed)
    module = scale_module(calibrator).train()
    steps = sum(len(answer_batches(sets, config.batch_size, seed=config.seed, epoch=e)) for e in range(config.epochs))
    optimizer = torch.optim.AdamW(decay_groups(module, config.weight_decay), lr=answer_lr(config))
    scheduler = get_cosine_schedule_with_warmup(optimizer, round(config.warmup_ratio * steps), steps)
    record = answer_record(config, loss_type, tasks=[s.name for s in sets], token_weight=token_weight,
                           token_max=token_max, token_window=token_window, optimizer_steps=steps)
    if not thermometer:
        calibrator.config_.training = record
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
    if thermometer:
        calibrator.fitted = True
        calibrator.history = [{**record, "final_loss": result.history[-1]["loss"]}]
    return result
