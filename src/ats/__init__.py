"""ats: Adaptive Temperature Scaling for causal language models (Xie et al., EMNLP 2024).

A small head reads a frozen LM's hidden states and predicts a temperature per token; calibrated logits are
`q = z * exp(tau)`, so the argmax (and accuracy) never changes and only confidence moves.
"""

from importlib import import_module

__version__ = "0.1.0"

# public name -> module that defines it (imported lazily: `import ats` stays fast and light)
_EXPORTS = {
    "ATSCalibrator": "ats.ats",
    "ATSConfig": "ats.ats",
    "CalibratedModel": "ats.ats",
    "ATSError": "ats.errors",
    "Backbone": "ats.backbone",
    "load_backbone": "ats.backbone",
    "HeadConfig": "ats.heads",
    "TrainingConfig": "ats.training",
    "train_ats": "ats.training",
    "FeatureStore": "ats.features",
    "extract_features": "ats.features",
    "load_instructions": "ats.data",
    "build_calibrator": "ats.calibrators",
    "load_calibrator": "ats.calibrators",
    "evaluate": "ats.evaluate",
}

__all__ = ["__version__", *_EXPORTS]


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'ats' has no attribute {name!r}")
