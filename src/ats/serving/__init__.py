"""An OpenAI-compatible HTTP server whose log-probabilities are calibrated (docs/serving.md).

`Engine` batches calibrated generation (no web dependency); `create_app` wraps it in FastAPI (the `serve` extra).
"""

from __future__ import annotations

from importlib import import_module

_EXPORTS = {"Engine": ".engine", "Job": ".engine", "SamplingParams": "..generation.sampling", "create_app": ".app"}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(import_module(_EXPORTS[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
