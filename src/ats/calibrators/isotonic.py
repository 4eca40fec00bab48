"""Isotonic regression (Zadrozny & Elkan 2002) of correctness on the top-1 confidence.

Fitted with scikit-learn's IsotonicRegression (clipped to [0, 1] and out-of-range inputs clipped), but only its
thresholds are kept, as tensors, and applied with np.interp: the same piecewise-linear map, saved without pickle.
"""

from __future__ import annotations

import numpy as np
import torch
from sklearn.isotonic import IsotonicRegression
from torch import Tensor

from ..errors import ATSError
from ._fitting import collect_top1, source_top1, vector_pair
from .base import Calibrator, LogitChunks


class IsotonicCalibration(Calibrator):
    """Monotone map of the top-1 confidence to accuracy; calibrate() leaves the logits unchanged."""

    name = "isotonic"
    fits_on_sketch = True
    maps_confidence = True

    def __init__(self) -> None:
        self.x_thresholds: np.ndarray | None = None  # (K,) increasing confidences
        self.y_thresholds: np.ndarray | None = None  # (K,) non-decreasing accuracies in [0, 1]

    def fit(self, chunks: LogitChunks) -> "IsotonicCalibration":
        """Fit the monotone map of correctness on the uncalibrated top-1 confidence.

        Args:
            chunks: a `LogitChunks` callable yielding logits (N, V) and labels (N,).

        Returns:
            self, with the thresholds set.

        Raises:
            ATSError: if a chunk is malformed or there is no fitting token.
        """
        return self.fit_top1(*collect_top1(chunks))

    def fit_source(self, source) -> "IsotonicCalibration":
        """Fit on the source's `sketch` (its exact top-1 confidences) when it has one, else on its logit chunks.

        Args:
            source: the fitting data.

        Returns:
            self, fitted.
        """
        return self.fit_top1(*source_top1(source))

    def fit_top1(self, conf: np.ndarray, correct: np.ndarray) -> "IsotonicCalibration":
        """Fit the increasing map from top-1 confidence (N,) to correctness (N,) (both float64).

        Returns:
            self, with the thresholds set.
        """
        iso = IsotonicRegression(out_of_bounds="clip", y_min=0.0, y_max=1.0, increasing=True).fit(conf, correct)
        self.x_thresholds = np.asarray(iso.X_thresholds_, dtype=np.float64)
        self.y_thresholds = np.asarray(iso.y_thresholds_, dtype=np.float64)
        return self

    def _check_fitted(self) -> None:
        if self.x_thresholds is None or self.y_thresholds is None:
            raise ATSError("IsotonicCalibration: not fitted; call fit() or from_pretrained() first")

    def calibrate_confidence(self, confidence):
        """Piecewise-linear interpolation between thresholds, clipped at the ends; numpy or tensor in, same out.

        Args:
            confidence: top-1 confidences, any shape, array or tensor.

        Returns:
            The mapped confidences, same shape: float64 array, or a tensor on the same device with the same dtype
            (float32 if not floating).

        Raises:
            ATSError: if not fitted.
        """
        self._check_fitted()
        if isinstance(confidence, Tensor):
            dtype = confidence.dtype if confidence.dtype.is_floating_point else torch.float32
            out = np.interp(confidence.detach().double().cpu().numpy(), self.x_thresholds, self.y_thresholds)
            return torch.from_numpy(out).to(device=confidence.device, dtype=dtype)
        return np.interp(np.asarray(confidence, dtype=np.float64), self.x_thresholds, self.y_thresholds)

    def calibrate(self, logits: Tensor, hidden: Tensor | None = None, *, attention_mask: Tensor | None = None,
                  index: Tensor | None = None) -> Tensor:
        """`logits` unchanged (the map is `calibrate_confidence`); `ATSError` if not fitted.

        Same arguments as `Calibrator.calibrate`; only `logits` is read.
        """
        self._check_fitted()
        return logits

    def config(self) -> dict:
        """{} (no options); `ATSError` if not fitted."""
        self._check_fitted()
        return {}

    def state_tensors(self) -> dict[str, Tensor]:
        """The fitted thresholds, {"x_thresholds": (K,), "y_thresholds": (K,)} float64; `ATSError` if not fitted."""
        self._check_fitted()
        return {"x_thresholds": torch.from_numpy(self.x_thresholds.copy()),
                "y_thresholds": torch.from_numpy(self.y_thresholds.copy())}

    def load_state(self, config: dict, tensors: dict[str, Tensor]) -> None:
        """Restore the thresholds.

        Args:
            config: unused (no options).
            tensors: {"x_thresholds": (K,), "y_thresholds": (K,)}.

        Raises:
            ATSError: if a tensor is missing or the two are not equal-length non-empty vectors.
        """
        self.x_thresholds, self.y_thresholds = vector_pair(tensors, "x_thresholds", "y_thresholds")
