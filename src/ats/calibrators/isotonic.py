"""Isotonic regression (Zadrozny & Elkan 2002) of correctness on the top-1 confidence.

Fitted with scikit-learn's IsotonicRegression (clipped to [0, 1] and out-of-range inputs clipped), but only its
thresholds are kept, as tensors, and applied with np.interp: the same piecewise-linear map, saved without pickle.
"""

from __future__ import annotations

import numpy as np
import torch
from sklearn.isotonic import IsotonicRegression
from torch import Tensor

from .confidence_map import ConfidenceMap


class IsotonicCalibration(ConfidenceMap):
    """Monotone map of the top-1 confidence to accuracy; calibrate() leaves the logits unchanged. No options."""

    name = "isotonic"
    fitted_attributes = ("x_thresholds", "y_thresholds")
    x_thresholds: np.ndarray | None = None  # (K,) increasing confidences
    y_thresholds: np.ndarray | None = None  # (K,) non-decreasing accuracies in [0, 1]

    def fit_top1(self, conf: np.ndarray, correct: np.ndarray) -> "IsotonicCalibration":
        """Fit the increasing map from top-1 confidence (N,) to correctness (N,) (both float64).

        Returns:
            self, with the thresholds set.
        """
        iso = IsotonicRegression(out_of_bounds="clip", y_min=0.0, y_max=1.0, increasing=True).fit(conf, correct)
        self.x_thresholds = np.asarray(iso.X_thresholds_, dtype=np.float64)
        self.y_thresholds = np.asarray(iso.y_thresholds_, dtype=np.float64)
        return self

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
        self.check_fitted()
        if isinstance(confidence, Tensor):
            dtype = confidence.dtype if confidence.dtype.is_floating_point else torch.float32
            out = np.interp(confidence.detach().double().cpu().numpy(), self.x_thresholds, self.y_thresholds)
            return torch.from_numpy(out).to(device=confidence.device, dtype=dtype)
        return np.interp(np.asarray(confidence, dtype=np.float64), self.x_thresholds, self.y_thresholds)
