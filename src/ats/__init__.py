"""ats: Adaptive Temperature Scaling for causal language models (Xie et al., EMNLP 2024).

A small head reads a frozen LM's hidden states and predicts a temperature per token; calibrated logits are
`q = z * exp(tau)`, so the argmax (and accuracy) never changes and only confidence moves.

Layers, each importing only the ones below it: model -> calibrators -> training -> evaluation -> generation ->
workflows -> cli (see docs/architecture.md).
"""

from .lazy import lazy_exports

__version__ = "0.2.0"

# public name -> module that defines it (imported lazily: `import ats` stays fast and light)
_EXPORTS = {
    "ATSError": "ats.errors",
    "Backbone": "ats.model.backbone",
    "load_backbone": "ats.model.backbone",
    "HeadConfig": "ats.model.heads",
    "ATSCalibrator": "ats.calibrators.ats",
    "ATSConfig": "ats.calibrators.ats",
    "CalibratedModel": "ats.calibrators.calibrated_model",
    "Calibrator": "ats.calibrators.base",
    "build_calibrator": "ats.calibrators",
    "load_calibrator": "ats.calibrators",
    "DataConfig": "ats.training.data",
    "load_instructions": "ats.training.data",
    "TrainingConfig": "ats.training.config",
    "train_ats": "ats.training.trainer",
    "FeatureStore": "ats.training.features",
    "extract_features": "ats.training.features",
    "evaluate": "ats.evaluation.evaluate",
    "summarize": "ats.evaluation.metrics",
    "paired_differences": "ats.evaluation.metrics",
    "generate_calibrated": "ats.generation.api",
}

__all__ = ["__version__", *_EXPORTS]
__getattr__ = lazy_exports(__name__, _EXPORTS)
