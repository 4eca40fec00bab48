"""Reliability figures: valid PNG/PDF written atomically; the drawn bars and ECE are the hand-computed bins."""

from __future__ import annotations

import numpy as np
import pytest
from matplotlib.figure import Figure

from ats.errors import ATSError
from ats.evaluation.metrics import reliability_bins
from ats.evaluation.plots import make_reliability_figure, plot_reliability, reliability_figure


def _results() -> dict[str, tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(0)
    conf = rng.uniform(0.3, 1.0, size=300)
    conf[:20] = 1.0
    correct = rng.uniform(size=300) < conf ** 2
    return {"uncalibrated": (conf, correct), "temperature": (conf ** 1.5, correct), "ats": (conf ** 2, correct)}


def test_figure_files_written(tmp_path):
    paths = reliability_figure(_results(), tmp_path / "fig" / "mmlu.test", title="MMLU")
    assert [p.name for p in paths] == ["mmlu.test.png", "mmlu.test.pdf"]
    assert paths[0].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert paths[1].read_bytes()[:5] == b"%PDF-"
    assert sorted(p.name for p in (tmp_path / "fig").iterdir()) == ["mmlu.test.pdf", "mmlu.test.png"]  # no temps


def test_drawn_bars_are_the_hand_computed_bins():
    """Six confidences in 5 bins, by hand: [0, .2) holds 0.1, 0.15 (1 of 2 right, mean conf 0.125), [.4, .6) holds
    0.55 (right), the closed top bin [.8, 1] holds 0.9, 0.95, 1.0 (2 of 3 right, mean conf 0.95); ECE =
    (2 * 0.375 + 1 * 0.45 + 3 * (0.95 - 2/3)) / 6 = 2.05 / 6."""
    conf = np.array([0.1, 0.15, 0.55, 0.9, 0.95, 1.0])
    correct = np.array([False, True, True, True, False, True])
    fig = make_reliability_figure({"a": (conf, correct), "b": (np.full(6, 0.5), correct)}, n_bins=5)
    top, counts = fig.axes[0], fig.axes[2]  # column "a": reliability panel, then (row 2) its count histogram
    assert [ax.get_title() for ax in fig.axes[:2]] == ["a", "b"] and len(fig.axes) == 4
    bars = [(p.get_x(), p.get_height(), p.get_y()) for p in top.patches]
    accuracy, gap = bars[:3], bars[3:]
    assert [x for x, _, _ in accuracy] == pytest.approx([0.0, 0.4, 0.8])
    assert [h for _, h, _ in accuracy] == pytest.approx([0.5, 1.0, 2 / 3])
    assert [h for _, h, _ in gap] == pytest.approx([0.375, 0.45, 0.95 - 2 / 3])  # |accuracy - mean confidence|
    assert [y for _, _, y in gap] == pytest.approx([0.125, 0.55, 2 / 3])  # drawn from the lower of the two
    assert [p.get_height() for p in counts.patches] == [2, 1, 3]
    text = next(t.get_text() for t in top.texts if t.get_text().startswith("ECE"))
    assert text == f"ECE = {100 * 2.05 / 6:.2f}%\nN = 6"


def test_many_methods_make_a_grid_with_shared_axes():
    """Ten methods: a 4 x 3 grid (not a strip of ten), every reliability panel on the same [0, 1] axes, one count
    scale that fits the largest bin of any method, y labels on the first column, x labels under each column's last
    panel."""
    rng = np.random.default_rng(1)
    results = {f"m{i}": (rng.uniform(size=50 + 40 * i), rng.uniform(size=50 + 40 * i) < 0.5) for i in range(10)}
    fig = make_reliability_figure(results, n_bins=5)
    assert len(fig.axes) == 20
    width, height = fig.get_size_inches()
    assert width == pytest.approx(2.6 * 4 + 0.4) and height == pytest.approx(3.5 * 3)
    panels = [ax for ax in fig.axes if ax.get_title()]
    counts = [ax for ax in fig.axes if not ax.get_title()]
    assert [ax.get_title() for ax in panels] == list(results)
    columns = sorted({round(ax.get_position().x0, 3) for ax in panels})
    rows = sorted({round(ax.get_position().y0, 3) for ax in panels})
    assert len(columns) == 4 and len(rows) == 3
    assert all(ax.get_xlim() == (0, 1) and ax.get_ylim() == (0, 1) for ax in panels)
    largest = max(int(reliability_bins(c, k, n_bins=5).counts.max()) for c, k in results.values())
    assert all(ax.get_ylim() == pytest.approx((0.7, 2.0 * largest)) for ax in counts)
    assert [bool(ax.get_ylabel()) for ax in panels] == [i % 4 == 0 for i in range(10)]
    assert [ax.get_xlabel() for ax in counts] == ["", "", "", "", "", "", "Confidence", "Confidence",
                                                  "Confidence", "Confidence"]
    assert sum(ax.get_legend() is not None for ax in panels) == 1
    one = make_reliability_figure({"ats": results["m0"]})
    assert len(one.axes) == 2 and one.axes[0].get_title() == "ats"


def test_single_panel_without_counts():
    fig = Figure()
    ax = fig.add_subplot()
    plot_reliability(ax, reliability_bins([0.5, 1.0], [1, 0], n_bins=5), title="x")
    assert ax.get_xlabel() == "Confidence" and len(fig.get_axes()) == 1


def test_failure_leaves_nothing(tmp_path, monkeypatch):
    original = Figure.savefig

    def failing(self, fname, *args, format=None, **kwargs):
        if format == "pdf":
            raise OSError("disk full")
        return original(self, fname, *args, format=format, **kwargs)

    monkeypatch.setattr(Figure, "savefig", failing)
    with pytest.raises(OSError):
        reliability_figure(_results(), tmp_path / "rel")
    assert list(tmp_path.iterdir()) == []


def test_empty_results():
    with pytest.raises(ATSError, match="results"):
        make_reliability_figure({})


def _capture(monkeypatch) -> list:
    """Figures handed to save_figure, kept instead of written."""
    import ats.evaluation.plots as plots

    figures = []
    monkeypatch.setattr(plots, "save_figure", lambda fig, stem: figures.append(fig) or [])
    return figures


def test_tradeoff_points_are_token_ece_against_task_ece(monkeypatch):
    from ats.evaluation.plots import tradeoff_figure

    figures = _capture(monkeypatch)
    token = {"uncalibrated": {"ece": 0.2}, "ats": {"ece": 0.05}, "nll": {"ece": 0.1}}
    tasks = {"mmlu": {"uncalibrated": {"ece": 0.3}, "ats": {"ece": 0.12}, "nll": {"ece": 0.2}},
             "triviaqa": {"uncalibrated": {"ece": 0.25}, "ats": {"ece": 0.07}}}  # nll missing there: skipped
    tradeoff_figure(token, tasks, ["ats", "nll", "absent"], "unused")
    axes = figures[0].axes
    assert [ax.get_title() for ax in axes] == ["MMLU", "TriviaQA"]
    for ax, task in zip(axes, tasks):
        names = [t.get_text() for t in ax.texts]
        assert names == [n for n in ("uncalibrated", "ats", "nll") if n in tasks[task]]
        points = np.array([c.get_offsets()[0] for c in ax.collections], dtype=float)  # (n, 2)
        expected = np.array([(token[n]["ece"], tasks[task][n]["ece"]) for n in names])  # (n, 2)
        np.testing.assert_allclose(points, expected, rtol=1e-12)


def test_alpha_lines_are_the_ece_per_alpha_with_the_reference_dashed(monkeypatch):
    from ats.evaluation.plots import alpha_figure

    figures = _capture(monkeypatch)
    rows = [("0.1", "a1"), ("0.5", "a5"), ("0.9", "a9")]
    results = {"mmlu": {"uncalibrated": {"ece": 0.3}, "a1": {"ece": 0.2}, "a5": {"ece": 0.1}},  # a9 missing
               "val_tokens": {"uncalibrated": {"ece": float("nan")}, "a1": {"ece": 0.05}, "a5": {"ece": 0.04},
                              "a9": {"ece": 0.03}}}
    alpha_figure(rows, results, "unused", tasks=["mmlu", "val_tokens"])
    ax = figures[0].axes[0]
    solid = [line for line in ax.lines if line.get_linestyle() == "-"]
    dashed = [line for line in ax.lines if line.get_linestyle() == "--"]
    assert [list(line.get_xdata()) for line in solid] == [[0.1, 0.5, 0.9]] * 2
    assert list(solid[0].get_ydata())[:2] == [0.2, 0.1] and np.isnan(solid[0].get_ydata()[2])
    assert list(solid[1].get_ydata()) == [0.05, 0.04, 0.03]
    assert [list(line.get_ydata()) for line in dashed] == [[0.3, 0.3]]  # a NaN reference draws no line
    assert dashed[0].get_color() == solid[0].get_color()
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["MMLU", "val (token)"]
