"""Results as people read them: JSON-safe values and markdown tables (one writer for every table in the project)."""

from __future__ import annotations

import math
from collections.abc import Sequence

TABLE_METRICS = (("Acc", "accuracy"), ("ECE", "ece"), ("Brier", "brier"))
TASK_LABELS = {"mmlu": "MMLU", "triviaqa": "TriviaQA", "truthfulqa_mc1": "TruthfulQA MC1",
               "truthfulqa_gen": "TruthfulQA (gen)", "val_tokens": "val (token)"}


def jsonable(value):
    """JSON-safe copy: NaN / inf -> None (strict JSON), tuples -> lists, numpy scalars -> Python numbers.

    Args:
        value: a nested structure of dicts, lists, tuples and scalars.

    Returns:
        The copy.
    """
    if isinstance(value, dict):
        return {k: jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if hasattr(value, "item") and not isinstance(value, (str, bytes)):  # numpy / torch scalars
        try:
            value = value.item()
        except (TypeError, ValueError):
            return value
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[str]], *, text_columns: int = 1) -> str:
    """A markdown table; the first `text_columns` columns are left-aligned, the rest right-aligned (numbers).

    Args:
        header: the column names.
        rows: the rows' cells (converted with `str`).
        text_columns: how many leading columns are left-aligned.

    Returns:
        The table, without a trailing newline.
    """
    align = ["---"] * text_columns + ["---:"] * (len(header) - text_columns)
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(align) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def cell(metrics: dict | None, key: str, *, ci: bool = True) -> str:
    """A metric with 3 decimals ("-" when absent or not finite), with its 95% interval when present.

    Args:
        metrics: a method's metrics (with optional `<key>_ci` intervals), or None.
        key: the metric to show.
        ci: show the interval `<key>_ci` when it is present.

    Returns:
        The cell's text, e.g. "0.123 [0.101, 0.145]".
    """
    value = None if metrics is None else metrics.get(key)
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "-"
    text = f"{value:.3f}"
    interval = metrics.get(f"{key}_ci") if ci else None
    if isinstance(interval, (list, tuple)) and len(interval) == 2 and all(isinstance(v, (int, float))
                                                                          for v in interval):
        text += f" [{interval[0]:.3f}, {interval[1]:.3f}]"
    return text


def task_heading(task: str, by_method: dict) -> str:
    """The heading of a task's block: "### <label> (n = N)", without the count when the metrics have none.

    Args:
        task: the task's name.
        by_method: method -> metrics of the task (the first one's "n" is shown).

    Returns:
        The heading line.
    """
    n = next(iter(by_method.values()), {}).get("n") if by_method else None
    return f"### {TASK_LABELS.get(task, task)}" + (f" (n = {n})" if n is not None else "")


def format_table(results: dict, metrics=TABLE_METRICS) -> str:
    """One block per task: its heading, then a table with a row per method and a column per metric, 3 decimals
    (with 95% intervals when present). A terminal shows it at any number of tasks.

    Args:
        results: task -> method -> metrics.
        metrics: (column label, metric key) pairs to show.

    Returns:
        The markdown blocks, separated by blank lines.
    """
    blocks = []
    for task, by_method in results.items():
        rows = [[m] + [cell(summary, key) for _, key in metrics] for m, summary in by_method.items()]
        blocks.append(task_heading(task, by_method) + "\n\n"
                      + markdown_table(["method"] + [label for label, _ in metrics], rows))
    return "\n\n".join(blocks)


SELECTIVE_METRICS = (("AURC", "aurc"), ("excess AURC", "excess_aurc"), ("PRR", "prr"), ("error AUPRC", "error_auprc"))
SELECTIVE_TITLE = ("Answer or abstain, answering at confidence >= a threshold (lower AURC / excess AURC, higher PRR / "
                   "error AUPRC are better):")


def selective_tables(results: dict) -> str:
    """`format_table` of the risk-coverage metrics (AURC, excess AURC, PRR, error AUPRC) under a title line.

    Args:
        results: task -> method -> metrics.

    Returns:
        The title, then a block per task.
    """
    return SELECTIVE_TITLE + "\n\n" + format_table(results, SELECTIVE_METRICS)


def token_table(rows: dict[str, dict]) -> str:
    """Token-level calibration: method | Acc | ECE | Brier | NLL | mean confidence.

    Args:
        rows: method -> metrics (as `summarize` returns them); intervals are not shown.

    Returns:
        The markdown table.
    """
    body = [[name] + [cell(m, key, ci=False) for key in ("accuracy", "ece", "brier", "nll", "mean_confidence")]
            for name, m in rows.items()]
    return markdown_table(["method", "Acc", "ECE", "Brier", "NLL", "mean conf"], body)


FULL_METRICS = (("Acc", "accuracy"), ("mean conf", "mean_confidence"), ("ECE", "ece"), ("Brier", "brier"),
                ("AUROC", "auroc"))


def task_tables(results: dict, metrics=FULL_METRICS) -> str:
    """`format_table` with every metric (accuracy, mean confidence, ECE, Brier, AUROC).

    Args:
        results: task -> method -> metrics (each with "n", shown in the task's heading).
        metrics: (column label, metric key) pairs to show.

    Returns:
        The tables, each under a "### <task> (n = N)" heading, separated by blank lines.
    """
    return format_table(results, metrics)
