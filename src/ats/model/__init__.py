"""The model layer: the frozen backbone, the calibration heads, and the numerics of vocabulary-wide softmaxes.

Names are imported on first use (`ats.lazy`): the torch-free modules (`heads.config`, `labels`) load without torch.
"""

from ..lazy import lazy_exports

_EXPORTS = {"Backbone": ".backbone", "load_backbone": ".backbone", "IGNORE_INDEX": ".labels",
            "HEAD_TYPES": ".heads.config", "HeadConfig": ".heads.config", "HeadCache": ".heads.cache",
            "build_head": ".heads.registry"}

__all__ = sorted(_EXPORTS)
__getattr__ = lazy_exports(__name__, _EXPORTS)
