"""The evaluation layer: metrics, reliability diagrams, tasks, token-level calibration, and the evaluation driver.

Names are imported on first use (`ats.lazy`): the task names (`tasks.KNOWN_SPECS`) load without torch.
"""

from ..lazy import lazy_exports

_EXPORTS = {**dict.fromkeys(("evaluate", "format_paired", "run_tasks", "summarize_task"), ".evaluate"),
            **dict.fromkeys(("adaptive_ece", "auroc", "brier_score", "ece", "paired_differences", "reliability_bins",
                             "summarize"), ".metrics"),
            "format_table": ".report", "token_table": ".report", "build_task": ".tasks"}

__all__ = sorted(_EXPORTS)
__getattr__ = lazy_exports(__name__, _EXPORTS)
