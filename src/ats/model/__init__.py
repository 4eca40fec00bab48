"""The model layer: the frozen backbone, the calibration heads, and the numerics of vocabulary-wide softmaxes."""

from .backbone import IGNORE_INDEX, Backbone, load_backbone
from .heads import HEAD_TYPES, HeadCache, HeadConfig, build_head

__all__ = ["HEAD_TYPES", "IGNORE_INDEX", "Backbone", "HeadCache", "HeadConfig", "build_head", "load_backbone"]
