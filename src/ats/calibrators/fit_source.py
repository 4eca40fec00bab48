"""What a calibrator is fitted on: a `FitSource`, the same response tokens offered as logit chunks (one full-vocabulary
pass each time), as the features' scale summary rows (no pass at all, when the source chose that route) and as
whole sequences of hidden states; or, for token-level methods, a bare `LogitChunks` callable (`as_source`).

The source decides once whether its summary is used (`ats.model.token_ce.summary_route`): `summary` is None on the
exact route, and every method then fits on the logits or the sequences.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Protocol

from torch import Tensor

from ..errors import ATSError

# A re-iterable source of token-level fitting data: each call yields chunks of
# logits (N, V) float32 and next-token labels (N,) int64 for response tokens only.
LogitChunks = Callable[[], Iterator[tuple[Tensor, Tensor]]]


class FitSource(Protocol):
    """What a calibrator is fitted on; the workflow layer provides it (`ats.workflows.feature_source.FeatureSource`).

    logit_chunks: token-level (logits, labels) chunks of the response tokens;
    summary: the scale summary rows (N, D) of the same tokens in the same order (`ats.model.scale_summary`), or None
    on the exact route; temperature scaling, the binning methods and Thermometer read the loss, the top-1
    confidence and the correctness from it without any pass over the vocabulary;
    sequence_ids: (N,) the sequence of each of those rows;
    store / logits_fn: the sequences of hidden states and the output layer, for methods that read hidden states;
    fitted: name -> calibrator already fitted on this source (scaling-binning reuses the temperature);
    backbone / hidden_size: what the calibrator is sized for.
    """

    logit_chunks: LogitChunks
    summary: Tensor | None
    sequence_ids: Tensor
    store: object
    logits_fn: Callable[[Tensor], Tensor]
    fitted: dict
    backbone: object
    hidden_size: int


@dataclass
class ChunkSource:
    """A `FitSource` of logit chunks only (no summary, no sequences): what `fit(chunks)` fits on."""

    logit_chunks: LogitChunks
    fitted: dict = field(default_factory=dict)
    summary: None = None

    def __getattr__(self, name: str):
        if name in ("store", "logits_fn", "sequence_ids", "backbone", "hidden_size"):
            raise ATSError(f"fitting on logit chunks alone: this method needs the source's {name} (fit it on a "
                           "FitSource, e.g. ats.workflows.feature_source.FeatureSource)")
        raise AttributeError(name)


def as_source(source) -> FitSource:
    """`source` itself, or a `ChunkSource` of a bare `LogitChunks` callable (a function, not an object with a
    `logit_chunks` view).

    Raises:
        ATSError: if `source` is None or data itself (a list, a tensor, ...), not a source of it.
    """
    if callable(source) and not hasattr(type(source), "logit_chunks"):
        return ChunkSource(source)
    if source is None or isinstance(source, (list, tuple, dict, str, Tensor)):  # data itself, not a source of it
        raise ATSError(f"fit: expected a FitSource or a LogitChunks callable (a function yielding (logits, labels) "
                       f"chunks), got {type(source).__name__}")
    return source
