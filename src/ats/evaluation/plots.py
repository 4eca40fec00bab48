"""Every figure (matplotlib, Agg): reliability diagrams (per-bin accuracy against the diagonal, the gap shaded,
counts below), risk-coverage curves, the evidence run's token-vs-task trade-off and the ablations' ECE against alpha.

The statistics come from `metrics.reliability_bins` and `selective.risk_coverage`; this file only draws them.
Figures are built on a bare `matplotlib.figure.Figure` (no pyplot global state) and written atomically as PNG
(dpi 200) and PDF (TrueType fonts, as publication venues require).
"""

from __future__ import annotations

import contextlib
import math
import os
import tempfile
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # headless: never open a window

import numpy as np  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402

from ..errors import ATSError  # noqa: E402
from .metrics import ReliabilityStats, reliability_bins  # noqa: E402
from .report import TASK_LABELS  # noqa: E402
from .selective import oracle_aurc, risk_coverage, selective_metrics  # noqa: E402

STYLE = {"font.size": 9, "axes.titlesize": 10, "axes.labelsize": 9, "legend.fontsize": 7.5,
          "pdf.fonttype": 42, "ps.fonttype": 42}
_BAR = "#3b6ea8"
_GAP = "#d62728"


def _require_methods(results: dict) -> None:
    """A figure of methods needs at least one; else ATSError."""
    if not results:
        raise ATSError("results: empty; need at least one method's (confidence, correct)")


def plot_reliability(ax, stats: ReliabilityStats, *, title: str = "", count_ax=None) -> None:
    """Draw accuracy bars per confidence bin, the diagonal, the gap to mean confidence (red hatched) and the ECE.

    Args:
        ax: the matplotlib axes of the reliability panel.
        stats: the per-bin statistics from `reliability_bins`.
        title: the panel's title; "" for none.
        count_ax: axes below for a log-scale count histogram; None: no histogram.
    """
    left = stats.edges[:-1]  # (B,)
    width = np.diff(stats.edges)  # (B,)
    full = stats.counts > 0
    ax.bar(left[full], stats.accuracy[full], width=width[full], align="edge", color=_BAR, edgecolor="black",
           linewidth=0.5, label="Accuracy")
    lo = np.minimum(stats.accuracy[full], stats.mean_confidence[full])
    gap = np.abs(stats.accuracy[full] - stats.mean_confidence[full])
    ax.bar(left[full], gap, bottom=lo, width=width[full], align="edge", color=_GAP, alpha=0.3, edgecolor=_GAP,
           hatch="//", linewidth=0.5, label="Gap")
    ax.plot([0, 1], [0, 1], linestyle="--", color="gray", linewidth=1.0, label="Perfect")
    ax.set_xlim(0, 1)
    ax.set_ylim(0, 1)
    ax.set_ylabel("Accuracy")
    if title:
        ax.set_title(title)
    ax.text(0.97, 0.04, f"ECE = {100 * stats.ece:.2f}%\nN = {stats.n:,}", transform=ax.transAxes, ha="right",
            va="bottom", bbox={"boxstyle": "round", "facecolor": "white", "edgecolor": "0.6", "alpha": 0.9})
    ax.legend(handles=[Patch(facecolor=_BAR, edgecolor="black", label="Accuracy"),
                       Patch(facecolor=_GAP, alpha=0.3, edgecolor=_GAP, hatch="//", label="Gap"),
                       matplotlib.lines.Line2D([], [], color="gray", linestyle="--", label="Perfect")],
              loc="upper left", frameon=False)
    if count_ax is None:
        ax.set_xlabel("Confidence")
        return
    full_counts = stats.counts[full]
    count_ax.bar(left[full], full_counts, width=width[full], align="edge", color="0.55", edgecolor="black",
                 linewidth=0.5)
    count_ax.set_xlim(0, 1)
    count_ax.set_yscale("log")  # token counts span orders of magnitude across bins (most mass near 1.0)
    count_ax.set_ylim(0.7, max(10.0, 2.0 * float(full_counts.max())))
    count_ax.set_xlabel("Confidence")
    count_ax.set_ylabel("Count")


MAX_COLUMNS = 4  # methods per row of a reliability figure: ten methods read as a 4 x 3 grid, not a strip of ten


def make_reliability_figure(results: dict[str, tuple[np.ndarray, np.ndarray]], *, title: str = "",
                            n_bins: int = 15, columns: int = MAX_COLUMNS) -> Figure:
    """Methods in a grid (at most `columns` per row), each a reliability panel over its count histogram; every
    panel shares the axes: confidence and accuracy on [0, 1], one count scale for all histograms. Y labels on the
    first column, the legend on the first panel only.

    Axes are created row by row, the row's reliability panels first, then its histograms (one row: `fig.axes` is
    [reliability of each method..., histogram of each method...]).

    Args:
        results: method -> (confidence (N,), correct (N,)).
        title: the figure's title; "" for none.
        n_bins: equal-width bins.
        columns: methods per row at most (>= 1).

    Returns:
        The figure (not saved).

    Raises:
        ATSError: if `results` is empty, `columns` < 1 or a method's inputs are invalid.
    """
    _require_methods(results)
    if columns < 1:
        raise ATSError(f"columns: expected >= 1, got {columns}")
    stats = {name: reliability_bins(conf, corr, n_bins=n_bins) for name, (conf, corr) in results.items()}
    ncols = min(len(stats), columns)
    nrows = math.ceil(len(stats) / ncols)
    names = list(stats)
    with matplotlib.rc_context(STYLE):
        fig = Figure(figsize=(2.6 * ncols + 0.4, 3.5 * nrows + (0.4 if title else 0.0)), layout="constrained")
        grid = fig.add_gridspec(2 * nrows, ncols, height_ratios=[3, 1] * nrows)
        first_panel = first_counts = None
        top_count = 10.0
        for row in range(nrows):
            cells = names[row * ncols:(row + 1) * ncols]
            panels = []
            for col, _ in enumerate(cells):
                ax = fig.add_subplot(grid[2 * row, col], sharex=first_panel, sharey=first_panel)
                first_panel = first_panel or ax
                panels.append(ax)
            for col, name in enumerate(cells):
                counts = fig.add_subplot(grid[2 * row + 1, col], sharex=first_panel, sharey=first_counts)
                first_counts = first_counts or counts
                st = stats[name]
                plot_reliability(panels[col], st, title=name, count_ax=counts)
                if st.counts.max() > 0:
                    top_count = max(top_count, 2.0 * float(st.counts.max()))
                panels[col].set_xlabel("")
                panels[col].tick_params(labelbottom=False)
                if row or col:
                    panels[col].get_legend().remove()
                if col:
                    for ax in (panels[col], counts):
                        ax.set_ylabel("")
                        ax.tick_params(labelleft=False)
                if (row + 1) * ncols + col < len(names):  # a panel below carries the label
                    counts.set_xlabel("")
        first_counts.set_ylim(0.7, top_count)  # shared: the largest bin of any method fits
        if title:
            fig.suptitle(title)
    return fig


def save_figure(fig: Figure, path_stem: str | Path) -> list[Path]:
    """Write `<stem>.png` (dpi 200) and `<stem>.pdf` atomically, in the house style; returns both paths.

    Both are rendered to temporaries first, then swapped in: a failure leaves neither a partial nor a stray file.

    Args:
        fig: the figure.
        path_stem: the path without suffix; its folder is created if missing.

    Returns:
        [the .png path, the .pdf path].
    """
    stem = Path(path_stem)
    stem.parent.mkdir(parents=True, exist_ok=True)
    paths = [stem.with_name(stem.name + ".png"), stem.with_name(stem.name + ".pdf")]
    temps: list[str] = []
    try:
        for path in paths:
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
            temps.append(tmp)
            with os.fdopen(fd, "wb") as f, matplotlib.rc_context(STYLE):
                fig.savefig(f, format=path.suffix[1:], dpi=200)
                f.flush()
                os.fsync(f.fileno())
        for tmp, path in zip(temps, paths):
            os.replace(tmp, path)
    finally:
        for tmp in temps:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
    return paths


def reliability_figure(results: dict[str, tuple[np.ndarray, np.ndarray]], path_stem: str | Path, *,
                       title: str = "", n_bins: int = 15) -> list[Path]:
    """Reliability diagrams of every method in a grid (`make_reliability_figure`), written as `<stem>.png` and
    `<stem>.pdf`.

    Args:
        results: method -> (confidence (N,), correct (N,)).
        path_stem: the path without suffix.
        title: the figure's title; "" for none.
        n_bins: equal-width bins.

    Returns:
        [the .png path, the .pdf path].

    Raises:
        ATSError: if `results` is empty or a method's inputs are invalid.
    """
    return save_figure(make_reliability_figure(results, title=title, n_bins=n_bins), path_stem)


def make_risk_coverage_figure(results: dict[str, tuple[np.ndarray, np.ndarray]], *, title: str = "") -> Figure:
    """Risk (error rate among the answered) against coverage (fraction answered), one step curve per method whose
    area is its AURC (ties answered together: one step per distinct confidence); when every method has the same
    answers, the oracle ordering (dashed) and random abstention (dotted, the error rate) too.

    Args:
        results: method -> (confidence (N,), correct (N,)).
        title: the axes' title; "" for none.

    Returns:
        The figure (not saved).

    Raises:
        ATSError: if `results` is empty or a method's inputs are invalid.
    """
    _require_methods(results)
    curves = {name: risk_coverage(conf, corr) for name, (conf, corr) in results.items()}
    aurcs = {name: selective_metrics(conf, corr)["aurc"] for name, (conf, corr) in results.items()}
    first = next(iter(curves.values()))
    answers = [np.asarray(corr, dtype=np.float64).reshape(-1) for _, corr in results.values()]  # each (N,)
    shared = all(a.shape == answers[0].shape and np.array_equal(a, answers[0]) for a in answers)
    with matplotlib.rc_context(STYLE):
        fig = Figure(figsize=(4.2, 3.2), layout="constrained")
        ax = fig.add_subplot()
        for name, curve in curves.items():
            ax.step(np.r_[0.0, curve.coverage], np.r_[curve.risk[0], curve.risk], where="pre", linewidth=1.2,
                    label=f"{name} (AURC {aurcs[name]:.3f})")
        if shared:
            n, wrong = first.n, int(first.errors[-1])
            i = np.arange(1, n + 1)  # (N,) answered, right answers first
            best = np.maximum(0, i - (n - wrong)) / i  # (N,)
            ax.step(np.r_[0.0, i / n], np.r_[best[0], best], where="pre", color="gray", linestyle="--",
                    linewidth=1.0, label=f"oracle (AURC {oracle_aurc(n, wrong):.3f})")
            ax.axhline(wrong / n, color="gray", linestyle=":", linewidth=1.0, label=f"random ({wrong / n:.3f})")
        ax.set_xlim(0, 1)
        ax.set_ylim(bottom=0)
        ax.set_xlabel("Coverage (fraction answered)")
        ax.set_ylabel("Risk (error rate of the answered)")
        ax.grid(alpha=0.3)
        ax.legend(loc="lower right", frameon=False)  # the curves rise from the left: the lower right is free
        if title:
            ax.set_title(title)
    return fig


def risk_coverage_figure(results: dict[str, tuple[np.ndarray, np.ndarray]], path_stem: str | Path, *,
                         title: str = "") -> list[Path]:
    """Risk-coverage curves of every method in one panel, written as `<stem>.png` and `<stem>.pdf`.

    Args:
        results: method -> (confidence (N,), correct (N,)).
        path_stem: the path without suffix.
        title: the figure's title; "" for none.

    Returns:
        [the .png path, the .pdf path].

    Raises:
        ATSError: if `results` is empty or a method's inputs are invalid.
    """
    return save_figure(make_risk_coverage_figure(results, title=title), path_stem)


def tradeoff_figure(token_level: dict, tasks: dict, points: list[str], stem: str | Path) -> list[Path]:
    """Token-level ECE (held-out instruction tokens) against task ECE, one panel per task, one point per
    objective / alpha; the uncalibrated model as a reference.

    Args:
        token_level: method -> token-level metrics.
        tasks: task -> method -> metrics.
        points: the methods to plot (those missing from either side are skipped).
        stem: the figure's path without suffix.

    Returns:
        [the .png path, the .pdf path].
    """
    task_names = list(tasks)
    with matplotlib.rc_context(STYLE):
        fig = Figure(figsize=(3.0 * len(task_names) + 0.4, 3.0), layout="constrained")
        axes = fig.subplots(1, len(task_names), squeeze=False)[0]
        for ax, task in zip(axes, task_names):
            for name in ["uncalibrated", *points]:
                if name not in token_level or name not in tasks[task]:
                    continue
                x, y = token_level[name]["ece"], tasks[task][name]["ece"]
                marker = "s" if name == "uncalibrated" else "*" if name == "ats-top-label" else "o"
                ax.scatter([x], [y], marker=marker, s=30)
                ax.annotate(name, (x, y), fontsize=6, xytext=(3, 3), textcoords="offset points")
            ax.set_title(TASK_LABELS.get(task, task))
            ax.set_xlabel("held-out token ECE")
            ax.set_ylabel("task ECE")
            ax.set_xlim(left=0)
            ax.set_ylim(bottom=0)
            ax.grid(alpha=0.3)
    return save_figure(fig, stem)


def alpha_figure(rows: list[tuple[str, str]], results: dict, stem: str | Path, *, tasks: list[str],
                 reference: str = "uncalibrated") -> list[Path]:
    """ECE against alpha, one line per task (dashed, same colour: the `reference` method); PNG + PDF.

    Args:
        rows: (alpha as text, method name) pairs.
        results: task -> method -> metrics.
        stem: the figure's path without suffix.
        tasks: the tasks to draw, in order.
        reference: the method drawn dashed.

    Returns:
        [the .png path, the .pdf path].
    """
    alphas = [float(label) for label, _ in rows]
    with matplotlib.rc_context(STYLE):
        fig = Figure(figsize=(4.2, 3.0), layout="constrained")
        ax = fig.add_subplot()
        colours = matplotlib.rcParams["axes.prop_cycle"].by_key()["color"]
        for i, task in enumerate(tasks):
            colour = colours[i % len(colours)]
            ys = [results[task].get(method, {}).get("ece") for _, method in rows]
            ax.plot(alphas, [math.nan if y is None else y for y in ys], marker="o", color=colour,
                    label=TASK_LABELS.get(task, task))
            ref = results[task].get(reference, {}).get("ece")
            if ref is not None and math.isfinite(ref):
                ax.axhline(ref, color=colour, linestyle="--", linewidth=0.8, alpha=0.7)
        ax.set_xlabel(r"smoothing weight $\alpha$ (selective loss)")
        ax.set_ylabel("ECE")
        ax.set_xticks(alphas)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend(title=f"dashed: {reference}", title_fontsize=7, frameon=False)
    return save_figure(fig, stem)
