"""Registry of calibrators: build one by name, or load a saved one by the "type" in its calibrator_config.json."""

from __future__ import annotations

from pathlib import Path

from ..errors import ATSError
from ..io import read_json
from .base import CONFIG_NAME, Calibrator, LogitChunks, Uncalibrated
from .binning import HistogramBinning, ScalingBinning
from .isotonic import IsotonicCalibration
from .temperature import TemperatureScaling
from .thermometer import Thermometer
from .vector import VectorScaling

CALIBRATORS: dict[str, type[Calibrator]] = {
    cls.name: cls
    for cls in (Uncalibrated, TemperatureScaling, VectorScaling, ScalingBinning, HistogramBinning, IsotonicCalibration,
                Thermometer)
}


def _known() -> str:
    return ", ".join([*CALIBRATORS, "ats"])


def build_calibrator(name: str, **options) -> Calibrator:
    """A fresh (unfitted) calibrator; `options` are its keyword-only constructor arguments."""
    if name == "ats":
        from ..ats import ATSCalibrator  # lazy: ats.py pulls in the heads and the backbone

        cls = ATSCalibrator
    elif name in CALIBRATORS:
        cls = CALIBRATORS[name]
    else:
        raise ATSError(f"calibrator: unknown name {name!r}; known: {_known()}")
    try:
        return cls(**options)
    except TypeError as err:  # an unknown or positional option
        raise ATSError(f"calibrator {name!r}: bad options {sorted(options)} ({err})") from None


def load_calibrator(directory: str | Path) -> Calibrator:
    """Load any saved calibrator, dispatching on the "type" field of its calibrator_config.json."""
    directory = Path(directory)
    config = read_json(directory / CONFIG_NAME)
    if not isinstance(config, dict):
        raise ATSError(f"{directory / CONFIG_NAME}: expected a JSON object, got {type(config).__name__}")
    kind = config.get("type")
    if kind == "ats":
        from ..ats import ATSCalibrator

        return ATSCalibrator.from_pretrained(directory)
    if kind not in CALIBRATORS:
        raise ATSError(f"{directory / CONFIG_NAME}: field 'type' is {kind!r}; known: {_known()}")
    return CALIBRATORS[kind].from_pretrained(directory)


__all__ = [
    "CALIBRATORS", "Calibrator", "HistogramBinning", "IsotonicCalibration", "LogitChunks", "ScalingBinning",
    "TemperatureScaling", "Uncalibrated", "VectorScaling", "build_calibrator", "load_calibrator",
]
