"""Calibration metrics on top-1 confidence vs correctness: ECE, adaptive ECE, Brier, NLL, accuracy, AUROC, and the
risk-coverage metrics of answering only above a confidence (AURC, excess AURC, PRR, error AUPRC: selective.py).

Every metric takes `confidence` (N,) in [0, 1] and `correct` (N,) in {0, 1} (numpy arrays, lists or torch tensors)
and returns a plain float. `reliability_bins` computes what a reliability diagram draws (plots.py only draws it),
and `summarize` bundles every metric with optional seeded percentile-bootstrap intervals.

ECE bins are equal-width: [0, 1/B), [1/B, 2/B), ..., [(B-1)/B, 1]. The top bin includes confidence 1.0; the paper's
reference code uses half-open bins throughout and silently drops tokens with confidence exactly 1.0 (a bug we fix).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ..errors import ATSError
from ..log_loss import binary_log_loss
from .inputs import check_pairs, to_array
from .selective import SELECTIVE_KEYS, selective_metrics

METRIC_KEYS = ("accuracy", "mean_confidence", "ece", "adaptive_ece", "brier", "nll", "auroc", *SELECTIVE_KEYS)
# what `paired_differences` compares by default
PAIRED_KEYS = ("ece", "brier", "auroc", "mean_confidence", "aurc", "prr", "error_auprc")


def _check_bins(n_bins: int) -> None:
    if not isinstance(n_bins, (int, np.integer)) or isinstance(n_bins, bool) or n_bins < 1:
        raise ATSError(f"n_bins: expected a positive integer, got {n_bins!r}")


def bin_index(confidence: np.ndarray, n_bins: int) -> np.ndarray:
    """Equal-width bin of each confidence: bin k is [k/B, (k+1)/B), the last bin also holds 1.0.  (N,) int.

    Args:
        confidence: (N,) confidences in [0, 1] (not checked).
        n_bins: B, the number of bins.

    Returns:
        (N,) bin indices in [0, B).
    """
    edges = np.linspace(0.0, 1.0, n_bins + 1)
    return np.clip(np.searchsorted(edges, confidence, side="right") - 1, 0, n_bins - 1)


@dataclass
class ReliabilityStats:
    """Per-bin statistics of a reliability diagram (equal-width bins); empty bins hold nan."""

    edges: np.ndarray  # (n_bins + 1,)
    counts: np.ndarray  # (n_bins,) int
    mean_confidence: np.ndarray  # (n_bins,)
    accuracy: np.ndarray  # (n_bins,)
    ece: float
    n: int


def reliability_bins(confidence, correct, *, n_bins: int = 15) -> ReliabilityStats:
    """Counts, mean confidence and accuracy per equal-width bin, and the ECE they give.

    Args:
        confidence: (N,) top-1 confidences in [0, 1] (array, list or tensor; flattened).
        correct: (N,) correctness, 0/1 or bool.
        n_bins: B, the number of equal-width bins.

    Returns:
        The per-bin statistics ((B,) arrays, nan for empty bins), the ECE and N.

    Raises:
        ATSError: if `n_bins` is not a positive integer, the inputs are empty or differ in length, a confidence is
            outside [0, 1] (or nan), or a correctness value is not 0/1.
    """
    _check_bins(n_bins)
    conf, corr = check_pairs(confidence, correct)
    idx = bin_index(conf, n_bins)
    counts = np.bincount(idx, minlength=n_bins)
    with np.errstate(invalid="ignore", divide="ignore"):
        mean_conf = np.bincount(idx, weights=conf, minlength=n_bins) / counts  # nan where empty
        acc = np.bincount(idx, weights=corr, minlength=n_bins) / counts
    full = counts > 0
    ece_value = float(np.sum(counts[full] * np.abs(acc[full] - mean_conf[full])) / conf.size)
    return ReliabilityStats(np.linspace(0.0, 1.0, n_bins + 1), counts, mean_conf, acc, ece_value, int(conf.size))


def ece(confidence, correct, *, n_bins: int = 15) -> float:
    """Expected calibration error: sum_b |B_b|/N * |acc_b - conf_b| over equal-width bins (top bin holds 1.0).

    Args:
        confidence: (N,) top-1 confidences in [0, 1] (array, list or tensor; flattened).
        correct: (N,) correctness, 0/1 or bool.
        n_bins: the number of equal-width bins.

    Returns:
        The ECE, in [0, 1].

    Raises:
        ATSError: if `n_bins` is not a positive integer, the inputs are empty or differ in length, a confidence is
            outside [0, 1] (or nan), or a correctness value is not 0/1.
    """
    return reliability_bins(confidence, correct, n_bins=n_bins).ece


def adaptive_ece(confidence, correct, *, n_bins: int = 15) -> float:
    """ECE over equal-mass bins: examples sorted by confidence, split into n_bins groups whose sizes differ by <= 1.

    Args:
        confidence: (N,) top-1 confidences in [0, 1] (array, list or tensor; flattened).
        correct: (N,) correctness, 0/1 or bool.
        n_bins: the number of equal-mass groups (empty ones, when N < n_bins, are skipped).

    Returns:
        The adaptive ECE, in [0, 1].

    Raises:
        ATSError: if `n_bins` is not a positive integer, the inputs are empty or differ in length, a confidence is
            outside [0, 1] (or nan), or a correctness value is not 0/1.
    """
    _check_bins(n_bins)
    conf, corr = check_pairs(confidence, correct)
    order = np.argsort(conf, kind="stable")
    total = 0.0
    for group in np.array_split(order, n_bins):
        if group.size:
            total += group.size * abs(corr[group].mean() - conf[group].mean())
    return float(total / conf.size)


def brier_score(confidence, correct) -> float:
    """Mean squared error of the top-1 confidence as a forecast of correctness.

    Args:
        confidence: (N,) top-1 confidences in [0, 1] (array, list or tensor; flattened).
        correct: (N,) correctness, 0/1 or bool.

    Returns:
        The Brier score, in [0, 1].

    Raises:
        ATSError: if the inputs are empty, differ in length, a confidence is outside [0, 1] (or nan), or a
            correctness value is not 0/1.
    """
    conf, corr = check_pairs(confidence, correct)
    return float(np.mean((conf - corr) ** 2))


def nll(confidence, correct) -> float:
    """Binary negative log-likelihood of correctness under the confidence (`ats.log_loss`: clipped to
    [1e-12, 1 - 1e-12]).

    Args:
        confidence: (N,) top-1 confidences in [0, 1] (array, list or tensor; flattened).
        correct: (N,) correctness, 0/1 or bool.

    Returns:
        The mean NLL in nats (at most about 27.6).

    Raises:
        ATSError: if the inputs are empty, differ in length, a confidence is outside [0, 1] (or nan), or a
            correctness value is not 0/1.
    """
    conf, corr = check_pairs(confidence, correct)
    return float(np.mean(binary_log_loss(conf, corr)))


def accuracy(correct) -> float:
    """Fraction of correct examples.

    Args:
        correct: (N,) correctness, 0/1 or bool.

    Returns:
        The accuracy, in [0, 1].

    Raises:
        ATSError: if `correct` is empty or holds a value other than 0/1.
    """
    corr = to_array(correct, "correct")
    if corr.size == 0:
        raise ATSError("correct: empty; need at least one example")
    check_pairs(np.zeros_like(corr), corr)
    return float(corr.mean())


def auroc(confidence, correct) -> float:
    """Area under the ROC curve of confidence separating correct from wrong; nan if only one class is present.

    Args:
        confidence: (N,) top-1 confidences in [0, 1] (array, list or tensor; flattened).
        correct: (N,) correctness, 0/1 or bool.

    Returns:
        The AUROC, in [0, 1], or nan.

    Raises:
        ATSError: if the inputs are empty, differ in length, a confidence is outside [0, 1] (or nan), or a
            correctness value is not 0/1.
    """
    from sklearn.metrics import roc_auc_score  # sklearn loads in seconds: only where used

    conf, corr = check_pairs(confidence, correct)
    if corr.min() == corr.max():
        return math.nan
    return float(roc_auc_score(corr, conf))


_METRICS = {
    "accuracy": lambda conf, corr, n_bins: float(corr.mean()),
    "mean_confidence": lambda conf, corr, n_bins: float(conf.mean()),
    "ece": lambda conf, corr, n_bins: ece(conf, corr, n_bins=n_bins),
    "adaptive_ece": lambda conf, corr, n_bins: adaptive_ece(conf, corr, n_bins=n_bins),
    "brier": lambda conf, corr, n_bins: brier_score(conf, corr),
    "nll": lambda conf, corr, n_bins: nll(conf, corr),
    "auroc": lambda conf, corr, n_bins: auroc(conf, corr),
}


def _all_metrics(conf: np.ndarray, corr: np.ndarray, n_bins: int, keys=METRIC_KEYS) -> dict[str, float]:
    selective = selective_metrics(conf, corr) if set(keys) & set(SELECTIVE_KEYS) else {}  # one sort for all four
    return {key: selective[key] if key in SELECTIVE_KEYS else _METRICS[key](conf, corr, n_bins) for key in keys}


def summarize(confidence, correct, *, n_bins: int = 15, bootstrap: int = 0, seed: int = 0) -> dict:
    """All metrics as a JSON-ready dict; with bootstrap > 0 also `<key>_ci: [lo, hi]` (95% percentile, seeded).

    Args:
        confidence: (N,) top-1 confidences in [0, 1] (array, list or tensor; flattened).
        correct: (N,) correctness, 0/1 or bool.
        n_bins: equal-width bins of the ECE (and equal-mass groups of the adaptive ECE).
        bootstrap: resamples of the examples for the intervals; 0: none.
        seed: the seed of the resampling.

    Returns:
        {"n": N, one float per key of `METRIC_KEYS`, and with bootstrap `<key>_ci`: [lo, hi] (nan, nan when every
        resample gave nan)}.

    Raises:
        ATSError: if `n_bins` or `bootstrap` is invalid, or the inputs are (see `ece`).
    """
    _check_bins(n_bins)
    if not isinstance(bootstrap, (int, np.integer)) or isinstance(bootstrap, bool) or bootstrap < 0:
        raise ATSError(f"bootstrap: expected a non-negative integer, got {bootstrap!r}")
    conf, corr = check_pairs(confidence, correct)
    out: dict = {"n": int(conf.size), **_all_metrics(conf, corr, n_bins)}
    if bootstrap > 0:
        rng = np.random.default_rng(seed)
        draws = {key: np.empty(bootstrap) for key in METRIC_KEYS}
        for i in range(bootstrap):
            idx = rng.integers(0, conf.size, size=conf.size)  # resample examples with replacement
            for key, value in _all_metrics(conf[idx], corr[idx], n_bins).items():
                draws[key][i] = value
        for key in METRIC_KEYS:
            values = draws[key][~np.isnan(draws[key])]
            out[f"{key}_ci"] = (
                [float(v) for v in np.percentile(values, [2.5, 97.5])] if values.size else [math.nan, math.nan]
            )
    return out


def paired_differences(a: tuple, b: tuple, *, n_bins: int = 15, bootstrap: int = 1000, seed: int = 0,
                       keys: tuple[str, ...] = PAIRED_KEYS) -> dict:
    """Metric(a) - metric(b) on the same examples, with a paired percentile-bootstrap 95% interval.

    a, b: (confidence (N,), correct (N,)) of two methods on the SAME N examples (correctness may differ when a
    method changes predictions). Each resample draws one set of example indices and scores both methods on it, so
    the interval reflects the difference, not the two methods' separate noise.

    Args:
        a: (confidence (N,), correct (N,)) of the first method.
        b: (confidence (N,), correct (N,)) of the second method, on the same N examples.
        n_bins: equal-width bins of the ECE.
        bootstrap: paired resamples (at least 1).
        seed: the seed of the resampling.
        keys: the metrics to compare (keys of `METRIC_KEYS`).

    Returns:
        key -> {"diff": metric(a) - metric(b), "ci": [lo, hi], "excludes_zero": bool}.

    Raises:
        ATSError: if `n_bins`, `bootstrap` or a key is invalid, the two differ in N, or an input is invalid.
    """
    _check_bins(n_bins)
    conf_a, corr_a = check_pairs(*a)
    conf_b, corr_b = check_pairs(*b)
    if conf_a.size != conf_b.size:
        raise ATSError(f"paired_differences: {conf_a.size} vs {conf_b.size} examples; pairs need the same examples")
    if isinstance(bootstrap, bool) or not isinstance(bootstrap, (int, np.integer)) or bootstrap < 1:
        raise ATSError(f"bootstrap: expected a positive integer, got {bootstrap!r}")
    unknown = [k for k in keys if k not in METRIC_KEYS]
    if unknown:
        raise ATSError(f"paired_differences: unknown metric {unknown[0]!r}; known: {', '.join(METRIC_KEYS)}")
    point_a, point_b = _all_metrics(conf_a, corr_a, n_bins, keys), _all_metrics(conf_b, corr_b, n_bins, keys)
    rng = np.random.default_rng(seed)
    draws = {key: np.empty(bootstrap) for key in keys}
    for i in range(bootstrap):
        idx = rng.integers(0, conf_a.size, size=conf_a.size)
        ma = _all_metrics(conf_a[idx], corr_a[idx], n_bins, keys)
        mb = _all_metrics(conf_b[idx], corr_b[idx], n_bins, keys)
        for key in keys:
            draws[key][i] = ma[key] - mb[key]
    out = {}
    for key in keys:
        values = draws[key][~np.isnan(draws[key])]
        lo, hi = (float(v) for v in np.percentile(values, [2.5, 97.5])) if values.size else (math.nan, math.nan)
        out[key] = {"diff": float(point_a[key] - point_b[key]), "ci": [lo, hi],
                    "excludes_zero": bool(values.size and (lo > 0 or hi < 0))}
    return out
