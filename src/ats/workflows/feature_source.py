"""What calibrators are fitted on: one feature cache's training split (`ats.calibrators.FitSource`), with the shared
fitting aids (the scale summary, the logits kept in memory) read once by every method."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..model.backbone import Backbone
from ..model.token_ce import summary_route
from ..training.features import FeatureStore

if TYPE_CHECKING:
    from ..calibrators.base import LogitChunks

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
    """What calibrators are fitted on (`ats.calibrators.FitSource`): the training split of one feature cache."""

    backbone: Backbone
    store: FeatureStore
    fit_tokens: int | None = None  # token-level methods fit on a fixed seeded subset of this many tokens
    fitted: dict = field(default_factory=dict)  # name -> calibrator fitted on this source (reusable by others)
    exact: bool = False  # fit on the logits even when the features carry a scale summary (the reference route)
    replay: LogitReplay | None = None  # keeps the fitting logits in memory when they fit; None: every pass recomputes
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
    def summary(self):
        """(N, D) the scale summary rows of the fitting tokens, aligned with `logit_chunks`, read once from the
        features; None on the exact route (`summary_route`: `exact`, or features without a summary)."""
        if self._summary is None and summary_route(self.store.scale_summary, exact=self.exact):
            self._summary = self.store.response_summary(max_tokens=self.fit_tokens)
        return self._summary

    @property
    def sequence_ids(self):
        """(N,) the sequence of every fitting token, aligned with `logit_chunks` and `summary`."""
        return self.store.response_sequence_ids(max_tokens=self.fit_tokens)
