"""How a calibration head is trained: the loss and the optimisation, in one validated config.

The defaults, the checks and the `ats train` options all come from the fields below (see `ats.config`); torch-free,
so the CLI's options load without torch (the losses themselves are in `losses.py`).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..config import ConfigMixin, option
from ..errors import ATSError

LOSS_TYPES = ("selective", "none", "full", "top-label")  # token losses (losses.py)
ANSWER_LOSSES = ("answer-log", "answer-brier")  # on answer confidence: `ats train --on answers` (docs/method.md)
DEFAULT_ANSWER_LOSS = "answer-log"  # what `ats train --on answers` trains with unless --loss says otherwise
WEIGHTINGS = ("token", "reference")  # of the selective loss (losses.py)
DEFAULT_ANSWER_METHOD = "thermometer"  # what `ats train --on answers` trains: best on both embedded models
# (benchmarks/results/answers)

TOKEN_MAX, TOKEN_WINDOW = 64, 512  # answer training's '+tokens' term: response tokens per step, positions read
ANSWER_LR = 1e-3  # the learning rate of training on answers when none is given (a few hundred steps)


@dataclass
class TrainingConfig(ConfigMixin):
    """The loss (type, smoothing weight, weighting) and the optimiser (AdamW, cosine schedule with warmup).

    Optimiser defaults follow the paper for the transformer head: lr 5e-5, effective batch 8 sequences, 2 epochs.
    """

    loss_type: str = option("selective", "training loss: selective (the paper's), none (plain NLL), full (label "
                            "smoothing on every token), top-label (log loss of the top-1 confidence); with --on "
                            "answers: answer-log / answer-brier (log loss / Brier score of the answer confidence)",
                            choices=LOSS_TYPES + ANSWER_LOSSES, flag="--loss")
    alpha: float = option(0.5, "smoothing weight of the selective / full losses", low=0.0, high=1.0)
    weighting: str = option("token", "selective loss: mean over tokens, or the reference code's group weighting "
                            "(-100 positions counted as it counts them)", choices=WEIGHTINGS)
    lr: float | None = option(None, "peak learning rate (AdamW)", unset=f"{ANSWER_LR:g} with an answer loss, else "
                              "from the number of optimizer steps", low=0, low_open=True)
    epochs: int = option(2, "passes over the training split", low=1)
    batch_size: int = option(8, "sequences per optimizer step (effective batch)", low=1)
    micro_batch_size: int = option(4, "sequences per forward pass; batch_size must be a multiple", low=1)
    warmup_ratio: float = option(0.05, "fraction of steps with linear warmup", low=0.0, high=1.0)
    weight_decay: float = option(0.0, "AdamW weight decay (matrices only)", low=0.0)
    max_grad_norm: float = option(1.0, "gradient clipping norm", low=0, low_open=True)
    seed: int = option(0, "seed of the head's initialisation and the data order")
    bf16: bool = option(False, "bf16 autocast for the head (GPU); the loss is always float32")
    chunk_size: int = option(1024, "tokens per logits chunk in the loss", low=1)
    exact_loss: bool = option(False, "compute the loss from the full-vocabulary logits even when the features carry "
                              "a scale summary (the reference route; slower by about the vocabulary size)")
    save_every: int = option(0, "checkpoint every N optimizer steps (0: once per epoch)", low=0, result=False)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.batch_size % self.micro_batch_size:
            raise ATSError(f"batch_size {self.batch_size} must be a multiple of micro_batch_size "
                           f"{self.micro_batch_size}")

    @property
    def accumulation(self) -> int:
        """Micro-batches per optimizer step."""
        return self.batch_size // self.micro_batch_size

    def learning_rate(self, total_steps: int) -> float:
        """The peak learning rate: `lr` if given, else ANSWER_LR for an answer loss, else `auto_lr(total_steps)`.

        Args:
            total_steps: the number of optimizer steps of the run.

        Returns:
            The peak learning rate.
        """
        if self.lr is not None:
            return self.lr
        return ANSWER_LR if self.loss_type in ANSWER_LOSSES else auto_lr(total_steps)


def training_record(config: TrainingConfig, *, lr: float, optimizer_steps: int | None = None, **extra) -> dict:
    """The one training record a trained calibrator keeps (`record_training`): every option, the learning rate
    used, the optimizer steps (left out when a rerun compares records before training) and what the objective adds.

    Args:
        config: the training options.
        lr: the peak learning rate used.
        optimizer_steps: the run's optimizer steps, or None.
        **extra: the objective's fields (e.g. lr_automatic; the answers' tasks and token term).

    Returns:
        The JSON-ready record.
    """
    steps = {} if optimizer_steps is None else {"optimizer_steps": optimizer_steps}
    return {**config.to_dict(), "lr": lr, **steps, **extra}


# The automatic learning rate keeps lr x steps near the paper's (5e-5 x ~13k steps = 0.65), within [5e-5, LR_MAX]:
# with the few hundred steps a CPU run affords, the paper's 5e-5 leaves the head where it started (docs/method.md).
LR_BUDGET, LR_MIN, LR_MAX = 0.65, 5e-5, 3e-3


def auto_lr(total_steps: int) -> float:
    """LR_BUDGET / steps, clipped to [LR_MIN, LR_MAX].

    Args:
        total_steps: the number of optimizer steps (values below 1 count as 1).

    Returns:
        The peak learning rate.
    """
    return min(LR_MAX, max(LR_MIN, LR_BUDGET / max(1, total_steps)))
