"""Binning baselines on the top-1 confidence: scaling-binning (Kumar, Liang, Ma 2019) and histogram binning.

Both use equal-mass bins over the fitting tokens' top-1 confidence. Bin i holds confidences in (u_{i-1}, u_i] where
the upper edges u are quantiles of the fitting confidences (the last edge is 1.0, the first bin starts at 0).
- ScalingBinning ("Verified Uncertainty Calibration"): temperature scaling first, then each bin maps to the mean
  *scaled* confidence in it; calibrate() applies the temperature, calibrate_confidence() the bin map.
- HistogramBinning (Zadrozny & Elkan 2001): bins on the uncalibrated confidence map to the empirical accuracy in
  them; calibrate() is the identity.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from ..checks import check_positive_float, check_positive_int
from ..errors import ATSError
from ._fitting import collect_top1, source_top1, vector_pair
from .base import Calibrator, LogitChunks
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


class _Binning(Calibrator):
    """Shared state and persistence: upper edges (K,) and bin values (K,) as float64 tensors."""

    maps_confidence = True

    def __init__(self, *, n_bins: int = 15) -> None:
        self.n_bins = check_positive_int("n_bins", n_bins)
        self.upper_edges: np.ndarray | None = None
        self.values: np.ndarray | None = None

    def _check_fitted(self) -> None:
        if self.upper_edges is None or self.values is None:
            raise ATSError(f"{type(self).__name__}: not fitted; call fit() or from_pretrained() first")

    def calibrate_confidence(self, confidence):
        """Map each confidence to its bin's value (see `apply_bins`).

        Args:
            confidence: top-1 confidences, any shape, array or tensor.

        Returns:
            The bin values, same shape and kind.

        Raises:
            ATSError: if not fitted.
        """
        self._check_fitted()
        return apply_bins(confidence, self.upper_edges, self.values)

    def config(self) -> dict:
        """{"n_bins"}: the number of bins asked for; `ATSError` if not fitted."""
        self._check_fitted()
        return {"n_bins": self.n_bins}

    def state_tensors(self) -> dict[str, Tensor]:
        """The fitted bins, {"upper_edges": (K,), "values": (K,)} float64; `ATSError` if not fitted."""
        self._check_fitted()
        return {"upper_edges": torch.from_numpy(self.upper_edges.copy()),
                "values": torch.from_numpy(self.values.copy())}

    def load_state(self, config: dict, tensors: dict[str, Tensor]) -> None:
        """Restore the number of bins and the fitted bins.

        Args:
            config: the saved config (without "type").
            tensors: {"upper_edges": (K,), "values": (K,)}.

        Raises:
            ATSError: if `n_bins` is invalid or the tensors are missing or not equal-length vectors.
        """
        self.n_bins = check_positive_int("n_bins", config.get("n_bins", 15))
        self.upper_edges, self.values = vector_pair(tensors, "upper_edges", "values")


class ScalingBinning(_Binning):
    """Temperature scaling, then equal-mass bins on the scaled confidence mapped to their mean scaled confidence.

    Args:
        n_bins: the number of equal-mass bins (fewer when quantiles tie).
    """

    name = "scaling-binning"
    fits_on_sketch = True
    fits_on_summary = True  # its temperature: temperature scaling's route (the scale summary when there is one)

    def __init__(self, *, n_bins: int = 15) -> None:
        super().__init__(n_bins=n_bins)
        self.temperature: float | None = None

    def fit(self, chunks: LogitChunks, *, temperature: float | None = None) -> "ScalingBinning":
        """Fit the temperature (unless given), then the bins on the scaled confidences.

        Args:
            chunks: a `LogitChunks` callable yielding logits (N, V) and labels (N,).
            temperature: reuse an already fitted temperature (same data) instead of fitting it again.

        Returns:
            self, fitted.

        Raises:
            ATSError: if a chunk is malformed or there is no fitting token.
        """
        self.temperature = temperature if temperature is not None else TemperatureScaling().fit(chunks).temperature
        conf, _ = collect_top1(chunks, transform=lambda z: z / self.temperature)
        self.upper_edges, self.values = equal_mass_bins(conf, conf, self.n_bins)
        return self

    def fit_source(self, source) -> "ScalingBinning":
        """Reuses the temperature of a temperature-scaling fit on the same source, if there is one (else fits it
        as `TemperatureScaling.fit_source` does: from the scale summary when the source has one).

        Args:
            source: the fitting data; its `sketch` (if it has one, else its logit chunks) and
                `fitted["temperature"]` are read.

        Returns:
            self, fitted.
        """
        done = getattr(source.fitted.get("temperature"), "temperature", None)
        sketch = getattr(source, "sketch", None)
        if sketch is None:
            return self.fit(source.logit_chunks, temperature=done)
        self.temperature = done if done is not None else TemperatureScaling().fit_source(source).temperature
        conf = sketch.top1_confidence(1.0 / self.temperature).numpy()
        self.upper_edges, self.values = equal_mass_bins(conf, conf, self.n_bins)
        return self

    def calibrate(self, logits: Tensor, hidden: Tensor | None = None, *, attention_mask: Tensor | None = None,
                  index: Tensor | None = None) -> Tensor:
        """logits / T (the scaling half); the binning half is `calibrate_confidence`.

        Same arguments as `Calibrator.calibrate`; only `logits`, (B, K, V) or (N, V), is read. Returns logits / T,
        same shape and dtype; raises `ATSError` if not fitted.
        """
        self._check_fitted()
        return logits / self.temperature

    def config(self) -> dict:
        """The number of bins and the temperature.

        Returns:
            {"n_bins", "temperature"}.

        Raises:
            ATSError: if not fitted.
        """
        return {**super().config(), "temperature": self.temperature}

    def load_state(self, config: dict, tensors: dict[str, Tensor]) -> None:
        """Restore the bins and the temperature.

        Args:
            config: the saved config (without "type").
            tensors: {"upper_edges": (K,), "values": (K,)}.

        Raises:
            ATSError: if a value is missing or invalid.
        """
        super().load_state(config, tensors)
        self.temperature = check_positive_float("temperature", config.get("temperature"))


class HistogramBinning(_Binning):
    """Equal-mass bins on the uncalibrated confidence mapped to the empirical accuracy in each bin.

    Args:
        n_bins: the number of equal-mass bins (fewer when quantiles tie).
    """

    name = "histogram"
    fits_on_sketch = True

    def fit(self, chunks: LogitChunks) -> "HistogramBinning":
        """Fit the bins on the uncalibrated top-1 confidences and their correctness.

        Args:
            chunks: a `LogitChunks` callable yielding logits (N, V) and labels (N,).

        Returns:
            self, fitted.

        Raises:
            ATSError: if a chunk is malformed or there is no fitting token.
        """
        conf, correct = collect_top1(chunks)
        self.upper_edges, self.values = equal_mass_bins(conf, correct, self.n_bins)
        return self

    def fit_source(self, source) -> "HistogramBinning":
        """Fit on the source's `sketch` (its exact top-1 confidences) when it has one, else on its logit chunks.

        Args:
            source: the fitting data.

        Returns:
            self, fitted.
        """
        conf, correct = source_top1(source)
        self.upper_edges, self.values = equal_mass_bins(conf, correct, self.n_bins)
        return self

    def calibrate(self, logits: Tensor, hidden: Tensor | None = None, *, attention_mask: Tensor | None = None,
                  index: Tensor | None = None) -> Tensor:
        """`logits` unchanged (the map is `calibrate_confidence`); `ATSError` if not fitted.

        Same arguments as `Calibrator.calibrate`; only `logits` is read.
        """
        self._check_fitted()
        return logits
