"""What calibrators are fitted on: one feature cache's training split (`ats.calibrators.FitSource`), with the shared
fitting aids (the sketch, the scale summary, the logits kept in memory) made once and read by every method."""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from ..calibrators.ats import ATSCalibrator
from ..calibrators.sketch import LogitSketch
from ..evaluation.token_eval import token_validator
from ..model.backbone import Backbone
from ..training.config import TrainingConfig
from ..training.distributed import SINGLE, Dist
from ..training.features import FeatureStore
from ..training.trainer import train_ats
from ..training.validation import heldout_objective

if TYPE_CHECKING:
    from ..calibrators.base import LogitChunks

logger = logging.getLogger(__name__)

REPLAY_BYTES = 6 * 2**30  # the float32 logits of the fitting tokens are kept in memory when they fit in this


class LogitReplay:
    """The fitting tokens' logits kept in memory: the first complete pass over the chunks keeps them, every later
    pass (vector scaling's epochs, another method) replays them without the output layer's matmul; the values are
    the same. Only a complete pass is kept; consumers must not modify the chunks in place."""

    def __init__(self, *, max_bytes: int = REPLAY_BYTES) -> None:
        self.max_bytes = max_bytes
        self.kept: list | None = None  # the (logits, labels) chunks of the first complete pass

    def fits(self, tokens: int, vocab_size: int) -> bool:
        """Whether `tokens` float32 rows of `vocab_size` logits fit in `max_bytes`."""
        return tokens * vocab_size * 4 <= self.max_bytes

    def wrap(self, chunks: LogitChunks) -> LogitChunks:
        """`chunks`, kept on their first complete pass and replayed from memory after it."""

        def replayed():
            if self.kept is not None:
                yield from self.kept
                return
            kept = []
            for logits, labels in chunks():
                kept.append((logits, labels))
                yield logits, labels
            self.kept = kept

        return replayed


@dataclass
class FeatureSource:
    """What calibrators are fitted on (`ats.calibrators.FitSource`): the training split of one feature cache, and
    how an ATS-family head is trained on it (the run's training config, validated on the held-out split)."""

    backbone: Backbone
    store: FeatureStore
    val_store: FeatureStore | None = None
    training: TrainingConfig | None = None
    work_dir: Path | None = None  # checkpoints of head training
    resume: bool = False
    progress: bool = True
    dist: Dist = field(default_factory=lambda: SINGLE)
    fit_tokens: int | None = None  # token-level methods fit on a fixed seeded subset of this many tokens
    fitted: dict = field(default_factory=dict)  # name -> calibrator fitted on this source (reusable by others)
    history: object = None  # the TrainResult of the last head trained
    use_sketch: bool = True  # fit the global-temperature, binning and Thermometer methods on one shared sketch
    use_summary: bool = True  # fit temperature scaling and Thermometer from the features' scale summary, if any
    replay: LogitReplay | None = None  # keeps the fitting logits in memory when they fit; None: every pass recomputes
    _sketch: LogitSketch | None = field(default=None, repr=False)
    _summary: object = field(default=None, repr=False)

    @property
    def hidden_size(self) -> int:
        """H, the backbone's hidden size."""
        return self.backbone.hidden_size

    @property
    def logits_fn(self):
        """The backbone's output layer, h (n, H) -> z (n, V)."""
        return self.backbone.logits

    @property
    def logit_chunks(self) -> LogitChunks:
        """The training split's `LogitChunks` (over `fit_tokens` seeded response tokens when set), through `replay`
        when there is one and the fitting tokens' logits fit in it."""
        chunks = self.store.logit_chunks(self.backbone.logits, max_tokens=self.fit_tokens)
        tokens = min(self.fit_tokens or math.inf, self.store.meta["response_tokens"])
        if self.replay is None or not self.replay.fits(tokens, self.backbone.vocab_size):
            return chunks
        return self.replay.wrap(chunks)

    @property
    def sketch(self) -> LogitSketch | None:
        """The `LogitSketch` of the fitting tokens, built on first use in one pass over `logit_chunks` and shared by
        every method that fits on it; None when `use_sketch` is off."""
        if self.use_sketch and self._sketch is None:
            logger.info("sketching the logits of %s response tokens (one full-vocabulary pass)",
                        self.fit_tokens or self.store.meta["response_tokens"])
            self._sketch = LogitSketch.from_chunks(self.logit_chunks)
        return self._sketch

    @property
    def summary(self):
        """(N, D) the scale summary rows of the fitting tokens, aligned with `logit_chunks`, read once from the
        features; None when `use_summary` is off or the features carry no summary."""
        if self.use_summary and self._summary is None:
            self._summary = getattr(self.store, "response_summary", lambda **_: None)(max_tokens=self.fit_tokens)
        return self._summary if self.use_summary else None

    @property
    def sequence_ids(self):
        """(N,) the sequence of every fitting token, aligned with `logit_chunks` and `sketch`."""
        return self.store.response_sequence_ids(max_tokens=self.fit_tokens)

    def train(self, calibrator: ATSCalibrator) -> None:
        """Train `calibrator.head` in place with the run's training config; the result goes to `history`.

        With a held-out split, each epoch is validated by token-level metrics and the held-out training objective.

        Args:
            calibrator: the ATS-family calibrator to train.

        Raises:
            ATSError: as `train_ats`.
        """
        training = self.training or TrainingConfig()
        validate = None
        if self.val_store is not None:
            token_metrics = token_validator(self.val_store, self.backbone, self.dist)

            def validate(cal: ATSCalibrator) -> dict:  # token-level metrics and the held-out training objective
                return {**token_metrics(cal),
                        "objective": heldout_objective(cal, self.val_store, self.backbone, training, self.dist)}

        self.history = train_ats(calibrator, self.store, self.backbone, config=training, validate=validate,
                                 out_dir=self.work_dir, resume=self.resume, progress=self.progress, dist=self.dist)
