"""Training on the model's own answers (`ats.training.answers`) through the one training loop
(`ats.training.trainer.Trainer`): the answer loss of batches of one task's questions (`ats.training.losses.answer_loss`
of the confidence as the task computes it, back-propagated through the calibrator's own `scales_at`), the calibrator's
penalty (Thermometer's prior), and optionally a token-level proper term on instruction data (`token_weight` x
top-label) so that token calibration does not collapse (docs/method.md, "Heads trained on answers").
"""

from __future__ import annotations

import random
from collections.abc import Iterator

import torch
from torch import Tensor

from ..errors import ATSError
from ..model.labels import IGNORE_INDEX
from ..model.token_ce import summary_route
from .answers import AnswerSet, confidence_and_penalty
from .config import TOKEN_MAX, TOKEN_WINDOW, TrainingConfig, training_record
from .losses import ANSWER_LOSSES, answer_loss, calibration_loss
from .trainer import Trainer, TrainResult


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
               window: int | None = None, generator: torch.Generator | None = None, summarised: bool = True) -> Tensor:
    """The top-label log loss of the head's calibrated top-1 confidence on one batch of instruction sequences
    (`ats.training.features.SequenceBatch`): the token-level proper term that keeps token calibration honest.

    The head reads the sequences' first `window` positions (None: all; a causal head's output there is exactly its
    output on the whole sequence); with `max_tokens`, the loss is the mean over a random subset of that many of
    their response tokens (unbiased, and the exact route then builds logits for those tokens only). `summarised`: the
    batch's summary rows are used (the route `summary_route` chose for the store)."""
    T = batch.hidden.shape[1] if window is None else min(window, batch.hidden.shape[1])
    select_all = batch.labels != IGNORE_INDEX  # (B, T_full)
    in_window = torch.zeros_like(select_all)
    in_window[:, :T] = True
    keep_rows = in_window[select_all]  # (N,) which summary rows (row-major response positions) lie in the window
    hidden_w = batch.hidden[:, :T]  # (B, T, H)
    device = next(calibrator.trainable.parameters()).device
    tau = calibrator.log_scale(hidden_w, batch.attention_mask[:, :T].to(device))
    select = select_all[:, :T]  # (B, T)
    hidden, scale, labels = hidden_w[select], calibrator.scale(tau.float().cpu())[select], batch.labels[:, :T][select]
    summary = batch.summary[keep_rows] if summarised and batch.summary is not None else None  # (N_w, D) or None
    if max_tokens is not None and labels.numel() > max_tokens:
        keep = torch.randperm(labels.numel(), generator=generator)[:max_tokens]  # (max_tokens,)
        hidden, scale, labels = hidden[keep], scale[keep], labels[keep]
        summary = summary[keep] if summary is not None else None
    return calibration_loss(hidden, scale, labels, logits_fn, loss_type="top-label", chunk_size=chunk_size,
                            summary=summary).loss


def cycled_batches(store, seed: int):
    """Endless single-sequence batches of an instruction feature store, reshuffled (seeded) on every pass."""
    npass = 0
    while True:
        yield from store.batches(1, shuffle=True, seed=seed * 1000 + npass)
        npass += 1


def answer_record(config: TrainingConfig, *, tasks: list[str], token_weight: float, token_max: int | None,
                  token_window: int | None, optimizer_steps: int | None = None,
                  questions: list[dict] | None = None) -> dict:
    """The training record of a calibrator trained on answers (`training_record` with the data, the tasks and the
    token term: its subset and window only when it is on): what training keeps (with the optimizer steps and, in
    `questions`, each set's task as it describes itself: sizes, seeds, offsets, what `ats certify` must leave out)
    and what a rerun compares before reusing it (without)."""
    tokens = {"token_weight": token_weight,
              **({"token_max": token_max, "token_window": token_window} if token_weight > 0 else {})}
    asked = {} if questions is None else {"questions": questions}
    return training_record(config, lr=config.learning_rate(optimizer_steps or 0), optimizer_steps=optimizer_steps,
                           data="answers", tasks=list(tasks), **tokens, **asked)


class AnswerObjective:
    """The answer loss (`config.loss_type`: answer-log or answer-brier) of batches of one task's questions, plus the
    calibrator's penalty (Thermometer's prior) and, with `token_weight` > 0, that weight x the top-label loss of one
    instruction sequence of `token_store` per step (`token_term`); one optimizer step per batch of
    `config.batch_size` questions (`answer_batches`), on one process.

    Raises:
        ATSError: if the loss is not an answer loss, no set holds a question, or the token term is asked without a
            store or for a calibrator without a per-token head.
    """

    what = "train on answers"
    accumulation = 1

    def __init__(self, calibrator, sets: list[AnswerSet], logits_fn, config: TrainingConfig, *, token_store=None,
                 token_weight: float = 0.0, token_max: int | None = TOKEN_MAX,
                 token_window: int | None = TOKEN_WINDOW) -> None:
        if config.loss_type not in ANSWER_LOSSES:
            raise ATSError(f"answer loss must be one of {', '.join(ANSWER_LOSSES)}, got {config.loss_type!r}")
        if not sets or not any(len(s) for s in sets):
            raise ATSError("training on answers: no answers to train on")
        if not hasattr(calibrator, "trainable"):
            raise ATSError(f"calibrator {calibrator.name!r} has no trainable module: it cannot learn from answers")
        if token_weight > 0 and (token_store is None or not calibrator.token_head):
            raise ATSError("training on answers: token_weight > 0 needs an instruction feature store and an "
                           "ATS-family head")
        self.calibrator, self.sets, self.logits_fn, self.config = calibrator, sets, logits_fn, config
        self.token_weight, self.token_max, self.token_window = token_weight, token_max, token_window
        self.tokens = cycled_batches(token_store, config.seed) if token_weight > 0 else None
        self.summarised = token_weight > 0 and summary_route(
            getattr(token_store, "scale_summary", None), exact=config.exact_loss,
            max_scale=calibrator.config_.max_scale, where=f"the features in {getattr(token_store, 'directory', '?')}")
        self.generator = torch.Generator().manual_seed(config.seed)

    def steps(self, epoch: int) -> int:
        """The batches of `epoch` (one optimizer step each)."""
        return len(answer_batches(self.sets, self.config.batch_size, seed=self.config.seed, epoch=epoch))

    def micro_batches(self, epoch: int, *, rank: int, world_size: int, start: int) -> Iterator:
        """The (set index, questions) batches of `epoch` from the `start`-th on (one process only)."""
        if world_size != 1:
            raise ATSError("training on answers runs on one process")
        return iter(answer_batches(self.sets, self.config.batch_size, seed=self.config.seed, epoch=epoch)[start:])

    def loss(self, batch, model) -> tuple[Tensor, dict]:
        """The answer loss of one batch (with the penalty), plus the weighted token term; and both as statistics."""
        k, questions = batch
        conf, correct, penalty = confidence_and_penalty(self.calibrator, self.sets[k], questions, self.logits_fn,
                                                        chunk_size=self.config.chunk_size)
        loss = answer_loss(conf, correct, self.config.loss_type) + penalty
        stats = {"answer_loss": loss.item()}
        if self.tokens is not None:
            term = token_term(self.calibrator, next(self.tokens), self.logits_fn, chunk_size=self.config.chunk_size,
                              max_tokens=self.token_max, window=self.token_window, generator=self.generator,
                              summarised=self.summarised)
            stats["token_loss"] = term.item()
            loss = loss + self.token_weight * term
        return loss, stats

    def record(self, lr: float, steps: int) -> dict:
        """`answer_record` of this run."""
        return answer_record(self.config, tasks=[s.name for s in self.sets], token_weight=self.token_weight,
                             token_max=self.token_max, token_window=self.token_window, optimizer_steps=steps,
                             questions=[s.meta.get("task", {"name": s.name}) for s in self.sets])


def train_on_answers(calibrator, sets: list[AnswerSet], logits_fn, *, config: TrainingConfig, token_store=None,
                     token_weight: float = 0.0, token_max: int | None = TOKEN_MAX,
                     token_window: int | None = TOKEN_WINDOW, progress: bool = True) -> TrainResult:
    """Train `calibrator` (an ATS-family head or Thermometer) in place on the answers of `sets` through the one loop
    (`AnswerObjective`, `Trainer`): AdamW with a cosine schedule and warmup, seeded by `config.seed` without touching
    the global RNG; the calibrator keeps the training record (`answer_record`).

    Args:
        calibrator: the calibrator trained (`trainable`, `scales_at`, `record_training`).
        sets: the training tasks' answers.
        logits_fn: the backbone's output layer.
        config: the answer loss, lr (None: ANSWER_LR), epochs, batch_size (questions per step), warmup, weight
            decay, clipping, seed.
        token_store: an instruction `FeatureStore` of the same backbone; with `token_weight` > 0 every step adds
            `token_weight` x the top-label loss of one of its sequences (ATS-family heads only).
        token_weight: the weight of that token-level term.
        token_max: response tokens per step in that term (a seeded random subset of the window's; None: all).
        token_window: the instruction sequence's first positions the term reads (None: all of them).
        progress: show a progress bar.

    Returns:
        The loss history; the module is left in eval mode.

    Raises:
        ATSError: as `AnswerObjective`, or if a loss is not finite.
    """
    objective = AnswerObjective(calibrator, sets, logits_fn, config, token_store=token_store,
                                token_weight=token_weight, token_max=token_max, token_window=token_window)
    return Trainer(calibrator, objective, config, progress=progress).run()
