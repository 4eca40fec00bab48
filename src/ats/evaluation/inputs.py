"""What every metric takes: top-1 confidences (N,) in [0, 1] and their correctness (N,) in {0, 1}, validated into
float64 arrays once, for the calibration metrics, the risk-coverage metrics and the certified threshold alike."""

from __future__ import annotations

import numpy as np

from ..errors import ATSError


def to_array(x, field: str) -> np.ndarray:
    """`x` (array, list or tensor) as a flat float64 array (N,); `field` names it in the error.

    Raises:
        ATSError: if `x` is not an array of numbers.
    """
    if hasattr(x, "detach"):  # torch tensor, without importing torch here
        x = x.detach().cpu().float().numpy() if x.dtype.is_floating_point else x.detach().cpu().numpy()
    try:
        arr = np.asarray(x, dtype=np.float64).reshape(-1)  # (N,)
    except (TypeError, ValueError):
        raise ATSError(f"{field}: expected an array of numbers, got {type(x).__name__}") from None
    return arr


def check_pairs(confidence, correct) -> tuple[np.ndarray, np.ndarray]:
    """Validated float64 arrays (N,), (N,) of the confidences and their correctness.

    Raises:
        ATSError: if the inputs are empty, differ in length, a confidence is outside [0, 1] (or nan), or a
            correctness value is not 0/1.
    """
    conf = to_array(confidence, "confidence")
    corr = to_array(correct, "correct")
    if conf.size == 0:
        raise ATSError("confidence: empty; need at least one example")
    if conf.shape != corr.shape:
        raise ATSError(f"correct: length {corr.size} does not match confidence length {conf.size}")
    bad = ~((conf >= 0.0) & (conf <= 1.0))  # also catches nan
    if bad.any():
        raise ATSError(f"confidence: value {float(conf[bad][0])!r} outside [0, 1]")
    bad = ~((corr == 0.0) | (corr == 1.0))
    if bad.any():
        raise ATSError(f"correct: value {float(corr[bad][0])!r} is not 0/1 (or False/True)")
    return conf, corr
