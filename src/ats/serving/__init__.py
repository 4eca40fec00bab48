"""An OpenAI-compatible HTTP server whose log-probabilities are calibrated (docs/serving.md).

`Engine` batches calibrated generation (no web dependency); `create_app` wraps it in FastAPI (the `serve` extra).
"""

from __future__ import annotations

from ..lazy import lazy_exports

_EXPORTS = {"Engine": ".engine", "Job": ".engine", "SamplingParams": "..generation.sampling", "create_app": ".app"}

__all__ = sorted(_EXPORTS)
__getattr__ = lazy_exports(__name__, _EXPORTS)
