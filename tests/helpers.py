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


def perturbed_ats(backbone, std: float = 0.3, seed: int = 0):
    """A real ATS calibrator whose head's final projection is random (normal, `std`), so tau varies by token."""
    import torch

    from ats.calibrators.ats import ATSCalibrator

    ats = ATSCalibrator.for_backbone(backbone)
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in ats.head.proj.parameters():
            p.normal_(0, std)
    return ats
