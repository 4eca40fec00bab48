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
