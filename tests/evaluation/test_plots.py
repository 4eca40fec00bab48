"""Reliability figures: valid PNG/PDF written atomically, one column (two panels) per method."""

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


def test_panel_count():
    fig = make_reliability_figure(_results(), n_bins=10)
    axes = fig.get_axes()
    assert len(axes) == 6  # 3 methods x (reliability + counts)
    assert [ax.get_title() for ax in axes[:3]] == ["uncalibrated", "temperature", "ats"]


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
