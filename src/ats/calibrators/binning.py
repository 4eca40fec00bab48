"""Binning baselines on the top-1 confidence: scaling-binning (Kumar, Liang, Ma 2019) and histogram binning.

Both use equal-mass bins over the fitting tokens' top-1 confidence. Bin i holds confidences in (u_{i-1}, u_i] where
the upper edges u are quantiles of the fitting confidences (the last edge is 1.0, the first bin starts at 0).
- ScalingBinning ("Verified Uncertainty Calibration"): temperature scaling first, then each bin maps to the mean
  *scaled* confidence in it; calibrate() applies the temperature, calibrate_confidence() the bin map.
- HistogramBinning (Zadrozny & Elkan 2001): bins on the uncalibrated confidence map to the empirical accuracy in
  them; calibrate() is the identity.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from ..checks import check_positive_float
from ..config import ConfigMixin, option
from ._fitting import source_top1
from .confidence_map import ConfidenceMap
from .temperature import TemperatureScaling


def equal_mass_bins(confidence: np.ndarray, target: np.ndarray, n_bins: int) -> tuple[np.ndarray, np.ndarray]:
    """Upper edges (K,) and per-bin mean of `target` (K,), K <= n_bins (tied quantiles merge bins; none is empty).

    Args:
        confidence: (N,) top-1 confidences in [0, 1], N >= 1.
        target: (N,) the values averaged per bin (the confidence itself, or correctness 0/1).
        n_bins: the number of equal-mass groups asked for.

    Returns:
        (upper edges (K,) increasing, the last 1.0; mean of `target` per bin (K,)), both float64.
    """
    order = np.sort(confidence)  # (N,)
    n = order.size
    cut = [order[int(np.ceil(n * (i + 1) / n_bins)) - 1] for i in range(n_bins - 1)]  # max of each equal-mass group
    upper = np.unique(np.append(np.asarray(cut, dtype=np.float64), 1.0))  # (K,) increasing, last = 1.0
    idx = np.searchsorted(upper, confidence, side="left")  # bin i holds (u_{i-1}, u_i]
    counts = np.bincount(idx, minlength=upper.size)
    sums = np.bincount(idx, weights=target, minlength=upper.size)
    full = counts > 0  # only the last bin can be empty (every other edge is a fitting value)
    upper = upper[full]
    upper[-1] = 1.0
    return upper, sums[full] / counts[full]


def apply_bins(confidence, upper: np.ndarray, values: np.ndarray):
    """Map each confidence to its bin's value; numpy in -> numpy out, tensor in -> tensor out (same device/dtype).

    Args:
        confidence: confidences, any shape (array, tensor or array-like); values above the last edge take the last
            bin.
        upper: (K,) the bins' upper edges.
        values: (K,) the bins' values.

    Returns:
        The bin values, same shape as `confidence`: float64 array, or a tensor of its dtype (float32 if not
        floating).
    """
    if isinstance(confidence, Tensor):
        dtype = confidence.dtype if confidence.dtype.is_floating_point else torch.float32
        u = torch.as_tensor(upper, dtype=torch.float64, device=confidence.device)
        v = torch.as_tensor(values, dtype=torch.float64, device=confidence.device)
        idx = torch.searchsorted(u, confidence.double().contiguous(), right=False).clamp(max=u.numel() - 1)
        return v[idx].to(dtype)
    conf = np.asarray(confidence, dtype=np.float64)
    idx = np.minimum(np.searchsorted(upper, conf, side="left"), upper.size - 1)
    return values[idx]


@dataclass
class BinningConfig(ConfigMixin):
    """The binning methods' one option."""

    n_bins: int = option(15, "the number of equal-mass bins (fewer when quantiles tie)", low=1)


class _Binning(ConfidenceMap):
    """Bins as upper edges (K,) and bin values (K,), float64; options: `BinningConfig` (n_bins), keyword-only."""

    Config = BinningConfig
    fitted_attributes = ("upper_edges", "values")
    upper_edges: np.ndarray | None = None
    values: np.ndarray | None = None

    def calibrate_confidence(self, confidence):
        """Map each confidence to its bin's value (see `apply_bins`).

        Args:
            confidence: top-1 confidences, any shape, array or tensor.

        Returns:
            The bin values, same shape and kind.

        Raises:
            ATSError: if not fitted.
        """
        self.check_fitted()
        return apply_bins(confidence, self.upper_edges, self.values)


class ScalingBinning(_Binning):
    """Temperature scaling, then equal-mass bins on the scaled confidence mapped to their mean scaled confidence.

    Options: `BinningConfig` (n_bins). Its temperature is that of temperature scaling on the same source when one is
    fitted there (`source.fitted`), else fitted as temperature scaling fits it (from the scale summary when there is
    one).
    """

    name = "scaling-binning"
    fitted_keys = ("temperature",)
    temperature: float | None = None

    def _fit(self, source) -> None:
        """The temperature (temperature scaling's on the same source, `source.fitted`, else fitted here as it fits),
        then the bins of the scaled confidences (`source_top1` at that temperature)."""
        done = source.fitted.get("temperature")
        self.temperature = done.temperature if done is not None else TemperatureScaling().fit(source).temperature
        conf, _ = source_top1(source, self.temperature)
        self.fit_top1(conf, conf)

    def fit_top1(self, conf: np.ndarray, target: np.ndarray) -> "ScalingBinning":
        """The bins of the scaled confidences (N,), each bin's value the mean of `target` (the confidence itself)."""
        self.upper_edges, self.values = equal_mass_bins(conf, target, self.n_bins)
        return self

    def calibrate(self, logits: Tensor, hidden: Tensor | None = None, *, attention_mask: Tensor | None = None,
                  index: Tensor | None = None) -> Tensor:
        """logits / T (the scaling half); the binning half is `calibrate_confidence`.

        Same arguments as `Calibrator.calibrate`; only `logits`, (B, K, V) or (N, V), is read. Returns logits / T,
        same shape and dtype; raises `ATSError` if not fitted.
        """
        self.check_fitted()
        return logits / self.temperature

    def restore(self, fitted: dict, tensors: dict[str, Tensor]) -> None:
        """Set the saved bins and temperature.

        Raises:
            ATSError: if a value is missing or invalid.
        """
        super().restore(fitted, tensors)
        self.temperature = check_positive_float("temperature", fitted.get("temperature"))


class HistogramBinning(_Binning):
    """Equal-mass bins on the uncalibrated confidence mapped to the empirical accuracy in each bin.

    Options: `BinningConfig` (n_bins).
    """

    name = "histogram"

    def fit_top1(self, conf: np.ndarray, correct: np.ndarray) -> "HistogramBinning":
        """The bins of the uncalibrated confidences (N,), each bin's value the accuracy (mean of `correct`) in it."""
        self.upper_edges, self.values = equal_mass_bins(conf, correct, self.n_bins)
        return self
