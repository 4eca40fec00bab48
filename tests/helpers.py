"""Test doubles shared by several test files: calibrators with a known, hand-checkable effect."""

from __future__ import annotations

from ats.calibrators.base import Calibrator


class HalfTemperature(Calibrator):
    """Logits / 2: softer confidences, same argmax."""

    name = "half"

    def fit(self, chunks):
        return self

    def calibrate(self, logits, hidden=None, *, attention_mask=None, index=None):
        return logits / 2


class SquareConfidence(Calibrator):
    """A binning-style calibrator: maps a top-1 confidence c to c**2."""

    name = "square"
    maps_confidence = True

    def fit(self, chunks):
        return self

    def calibrate_confidence(self, confidence):
        return confidence ** 2
