"""What a calibrator is fitted on (`FitSource`) and the routes by which it is fitted (`FitRoutes`).

A source offers the same response tokens several ways: logit chunks (a full-vocabulary pass each time), a shared
`LogitSketch` (one pass for every method), the features' scale summary (no pass at all), the sequences of hidden
states, the ATS trainer. A method declares which it can use (`trains_head`, `fits_on_summary`, `fits_on_sketch`) and
`FitRoutes.fit_source` takes the first the source has; the pipeline's fingerprints read the same flags.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import ClassVar, Protocol

from torch import Tensor

from ..errors import ATSError

# A re-iterable source of token-level fitting data: each call yields chunks of
# logits (N, V) float32 and next-token labels (N,) int64 for response tokens only.
LogitChunks = Callable[[], Iterator[tuple[Tensor, Tensor]]]


class FitSource(Protocol):
    """What a calibrator is fitted on; the workflow layer provides it (`ats.workflows.pipeline.FeatureSource`).

    logit_chunks: token-level (logits, labels) chunks of the response tokens;
    store / logits_fn: the sequences of hidden states and the output layer, for methods that read hidden states;
    backbone / hidden_size: what the calibrator is sized for;
    train(calibrator): train a calibrator's `trainable` module through the one training loop with the run's training
    config (loss, data, steps, schedule): the ATS family on instruction tokens, every learned calibrator on a source
    of the model's answers (`trains_calibrators`, `ats.training.answer_objective.AnswerSource`);
    sketch (optional): a `LogitSketch` of the same tokens as logit_chunks, built once; the global-temperature,
    binning and Thermometer methods fit on it instead of passing over the logits again; with it, sequence_ids (N,)
    gives the sequence of each of its rows.
    summary (optional): the scale summary rows (N, D) of the same tokens as logit_chunks, in the same order
    (`ats.model.scale_summary`, stored with the features), or None; temperature scaling and Thermometer evaluate
    F(s) = logsumexp(s z) and its derivatives from it without any pass over the vocabulary (`fits_on_summary`).
    """

    logit_chunks: LogitChunks
    fitted: dict  # name -> calibrator already fitted on this source (e.g. scaling-binning reuses the temperature)
    store: object
    logits_fn: Callable[[Tensor], Tensor]
    backbone: object
    hidden_size: int

    def train(self, calibrator) -> None:
        """Train a calibrator in place with the run's training config.

        Args:
            calibrator: the calibrator trained (`trains_head` is True, or the source `trains_calibrators`).
        """
        ...


class FitRoutes:
    """`fit_source` by route, for a calibrator class that declares its routes (mixed into `Calibrator`)."""

    name: ClassVar[str]
    trains_head: ClassVar[bool] = False  # trained by the ATS trainer with the run's TrainingConfig (ATS, controls)
    fits_on_summary: ClassVar[bool] = False  # fit_source (or the method it builds on) uses the scale summary
    fits_on_sketch: ClassVar[bool] = False  # fit_source uses the source's LogitSketch when it has one
    builds_on: ClassVar[str | None] = None  # the registry name of a method whose fit on the same source it reuses

    @classmethod
    def for_source(cls, source: FitSource, **options) -> "FitRoutes":
        """A fresh calibrator sized for the data in `source`: an option `hidden_size` of the config, when not
        given, is the source's.

        Args:
            source: the data it will be fitted on.
            **options: the class's keyword-only constructor options.

        Returns:
            The unfitted calibrator.
        """
        if "hidden_size" in cls.Config.__dataclass_fields__ and "hidden_size" not in options:
            options = {**options, "hidden_size": source.hidden_size}
        return cls(**options)

    def fit_source(self, source: FitSource) -> "FitRoutes":
        """Fit on `source` by the first route the class declares and the source has: the one training loop for a
        source that trains every learned calibrator (the model's answers: `trains_calibrators`, for a calibrator
        with a `trainable` module) and for the ATS family (`trains_head`), the scale summary (`fits_on_summary`,
        unless its route declines), the shared sketch (`fits_on_sketch`), else the data themselves
        (`fit_source_data`: the logit chunks by default). Returns self.

        Args:
            source: the fitting data.

        Returns:
            self, fitted.

        Raises:
            ATSError: if the data are malformed or empty, or the source trains and the calibrator learns nothing.
        """
        if getattr(source, "trains_calibrators", False):
            if not hasattr(self, "trainable"):
                raise ATSError(f"calibrator {self.name!r} has no trainable module: it cannot learn from answers")
            source.train(self)
            return self
        if self.trains_head:
            source.train(self)
            return self
        summary = getattr(source, "summary", None) if self.fits_on_summary else None
        if summary is not None and self.fit_source_summary(source, summary) is not None:
            return self
        sketch = getattr(source, "sketch", None) if self.fits_on_sketch else None
        if sketch is not None:
            return self.fit_source_sketch(source, sketch)
        return self.fit_source_data(source)

    def fit_source_summary(self, source: FitSource, summary: Tensor) -> "FitRoutes | None":
        """The scale-summary route, given the summary rows (N, D); None (self unchanged) declines it (the optimum
        lies beyond the summary, or the summary serves only the method this one builds on)."""
        return None

    def fit_source_sketch(self, source: FitSource, sketch) -> "FitRoutes":
        """The shared-sketch route, given the source's `LogitSketch`; classes with `fits_on_sketch` define it."""
        raise NotImplementedError(f"{type(self).__name__} declares fits_on_sketch without fit_source_sketch")

    def fit_source_data(self, source: FitSource) -> "FitRoutes":
        """The route without sketch or summary: one or more passes over the source's logit chunks."""
        return self.fit(source.logit_chunks)

    def prerequisite(self, source: FitSource) -> "FitRoutes | None":
        """The calibrator of `builds_on` already fitted on the same source (`source.fitted`), or None."""
        return getattr(source, "fitted", {}).get(self.builds_on) if self.builds_on else None

    def fit(self, chunks: LogitChunks) -> "FitRoutes":
        """Fit on token-level (logits, labels) chunks; returns self.

        Args:
            chunks: a `LogitChunks` callable yielding logits (N, V) and labels (N,).

        Returns:
            self, fitted (in subclasses fitted on chunks).

        Raises:
            ATSError: always here: a method that is not fitted on logit chunks (use `fit_source`).
        """
        raise ATSError(f"calibrator {self.name!r} is not fitted on logit chunks; use fit_source()")
