"""The evaluation layer: metrics, reliability diagrams, tasks, token-level calibration, and the evaluation driver."""

from .evaluate import evaluate, format_paired, run_tasks, summarize_task
from .metrics import adaptive_ece, auroc, brier_score, ece, paired_differences, reliability_bins, summarize
from .report import format_table, token_table
from .tasks import build_task

__all__ = ["adaptive_ece", "auroc", "brier_score", "build_task", "ece", "evaluate", "format_paired", "format_table",
           "paired_differences", "reliability_bins", "run_tasks", "summarize", "summarize_task", "token_table"]
