"""What the methods that map the top-1 confidence share (histogram and scaling-binning, isotonic regression): the
fit on (confidence, correct) pairs from the source's scale summary or one pass over the logits (`source_top1`), and
a fitted map held as two float64 vectors (bin edges and values, isotonic thresholds) saved as tensors; the logits
pass unchanged."""

from __future__ import annotations

from typing import ClassVar

import numpy as np
import torch
from torch import Tensor

from ..errors import ATSError
from ._fitting import source_top1
from .base import Calibrator


def vector_pair(tensors: dict[str, Tensor], first: str, second: str) -> tuple[np.ndarray, np.ndarray]:
    """Two saved equal-length, non-empty float64 vectors (bin edges and values, isotonic thresholds).

    Args:
        tensors: the tensors read from model.safetensors.
        first: the first vector's key.
        second: the second vector's key.

    Returns:
        (first (K,), second (K,)) as float64 arrays.

    Raises:
        ATSError: if a key is missing or the two are not equal-length, non-empty vectors.
    """
    for key in (first, second):
        if key not in tensors:
            raise ATSError(f"model.safetensors: tensor {key!r} missing")
    a, b = tensors[first].double().numpy(), tensors[second].double().numpy()
    if a.ndim != 1 or a.shape != b.shape or a.size == 0:
        raise ATSError(f"model.safetensors: tensors {first!r} {a.shape} and {second!r} {b.shape} "
                       "must be equal-length non-empty vectors")
    return a, b


class ConfidenceMap(Calibrator):
    """A map of the top-1 confidence held as two fitted vectors, named by `fitted_attributes` (also the tensors'
    names in model.safetensors); subclasses define `fit_top1` and `calibrate_confidence`."""

    maps_confidence = True
    fits_on_summary = True
    fitted_attributes: ClassVar[tuple[str, str]]

    def fit_top1(self, conf: np.ndarray, correct: np.ndarray) -> "ConfidenceMap":
        """Fit the map on top-1 confidences (N,) and their correctness (N,) (both float64); returns self."""
        raise NotImplementedError

    def _fit(self, source) -> None:
        """Fit on the uncalibrated top-1 confidences and correctness of the fitting tokens (`source_top1`)."""
        self.fit_top1(*source_top1(source))

    def calibrate(self, logits: Tensor, hidden: Tensor | None = None, *, attention_mask: Tensor | None = None,
                  index: Tensor | None = None) -> Tensor:
        """`logits` unchanged (the map is `calibrate_confidence`); `ATSError` if not fitted.

        Same arguments as `Calibrator.calibrate`; only `logits` is read.
        """
        self.check_fitted()
        return logits

    def state_tensors(self) -> dict[str, Tensor]:
        """The two fitted vectors, {name: (K,) float64}; `ATSError` if not fitted."""
        self.check_fitted()
        return {key: torch.from_numpy(getattr(self, key).copy()) for key in self.fitted_attributes}

    def restore(self, fitted: dict, tensors: dict[str, Tensor]) -> None:
        """Set the two saved vectors.

        Raises:
            ATSError: if a tensor is missing or the two are not equal-length non-empty vectors.
        """
        for key, vector in zip(self.fitted_attributes, vector_pair(tensors, *self.fitted_attributes)):
            setattr(self, key, vector)
