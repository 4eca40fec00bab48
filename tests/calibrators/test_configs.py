"""Calibrators as configs (issue 23): options held once in a Config dataclass, fit_source's route chosen by the
class's capability flags, a method built on another declares it, and the shared AdamW loop."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from torch import nn

from ats.calibrators import build_calibrator, calibrator_class, names
from ats.calibrators.binning import ScalingBinning
from ats.calibrators.fit_loop import decay_groups, fit_loop
from ats.calibrators.sketch import LogitSketch
from ats.calibrators.temperature import TemperatureScaling
from ats.calibrators.thermometer import Thermometer
from ats.errors import ATSError


def make_chunks(n: int = 400, v: int = 12, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    z = torch.randn(n, v, generator=gen) * 3.0
    y = torch.multinomial(torch.softmax(z / 1.5, -1), 1, generator=gen).squeeze(1)
    return lambda: ((z[i:i + 100], y[i:i + 100]) for i in range(0, n, 100))


class Source:
    """A FitSource that records which of its views a fit reads."""

    def __init__(self, chunks, *, sketch=None, fitted=None):
        self._chunks, self._sketch, self.fitted, self.read = chunks, sketch, fitted or {}, []

    @property
    def logit_chunks(self):
        self.read.append("logit_chunks")
        return self._chunks

    @property
    def sketch(self):
        self.read.append("sketch")
        return self._sketch

    @property
    def summary(self):
        self.read.append("summary")
        return None


@pytest.mark.parametrize("name", [n for n in names() if not calibrator_class(n).trains_head])
def test_options_live_once_in_the_config(name):
    cls = calibrator_class(name)
    options = {"hidden_size": 4} if name == "thermometer" else {}
    cal = build_calibrator(name, **options)
    assert isinstance(cal.config_, cls.Config)
    for f in dataclasses.fields(cls.Config):  # every option readable as an attribute, its default from the config
        assert getattr(cal, f.name) == getattr(cal.config_, f.name)
        if f.default is not dataclasses.MISSING and f.name != "hidden_size":
            assert getattr(cal, f.name) == f.default


def test_a_bad_option_names_the_field_and_positional_options_are_refused():
    with pytest.raises(ATSError, match="tol: expected a number > 0, got 0"):
        TemperatureScaling(tol=0)
    with pytest.raises(ATSError, match="prior_beta"):
        Thermometer(hidden_size=4, prior_beta=0.0)
    with pytest.raises(TypeError):
        TemperatureScaling(20)
    with pytest.raises(ATSError, match="calibrator 'vector': bad options"):
        build_calibrator("vector", n_bins=3)


def test_fit_source_takes_the_routes_the_class_declares():
    chunks = make_chunks()
    sketch = LogitSketch.from_chunks(chunks)
    # temperature scaling: the summary first (none here), then the sketch; the chunks are never read
    source = Source(chunks, sketch=sketch)
    by_sketch = TemperatureScaling().fit_source(source)
    assert source.read == ["summary", "sketch"]
    assert by_sketch.temperature == pytest.approx(TemperatureScaling().fit_sketch(sketch).temperature, abs=0)
    # without a sketch: one pass over the chunks per Newton step
    source = Source(chunks)
    assert TemperatureScaling().fit_source(source).temperature == TemperatureScaling().fit(chunks).temperature
    assert source.read == ["summary", "sketch", "logit_chunks"]
    # vector scaling declares neither route: only the chunks are read
    source = Source(chunks, sketch=sketch)
    build_calibrator("vector", epochs=1).fit_source(source)
    assert source.read == ["logit_chunks"]
    # isotonic regression: the sketch's exact top-1 statistics, no pass
    source = Source(chunks, sketch=sketch)
    iso = build_calibrator("isotonic").fit_source(source)
    assert source.read == ["sketch"]
    grid = np.linspace(0, 1, 11)
    assert np.array_equal(iso.map_confidence(grid), build_calibrator("isotonic").fit(chunks).map_confidence(grid))


def test_scaling_binning_builds_on_the_temperature_fitted_on_the_same_source():
    assert ScalingBinning.builds_on == "temperature"
    chunks = make_chunks()
    done = TemperatureScaling().fit(chunks)
    done.temperature = 3.0  # a temperature it could not have fitted itself: proves it was reused
    for sketch in (LogitSketch.from_chunks(chunks), None):
        cal = ScalingBinning(n_bins=4).fit_source(Source(chunks, sketch=sketch, fitted={"temperature": done}))
        assert cal.temperature == 3.0
    alone = ScalingBinning(n_bins=4).fit_source(Source(chunks))
    assert alone.temperature == TemperatureScaling().fit(chunks).temperature


def test_decay_groups_decay_the_matrices_only():
    net = nn.Sequential(nn.Linear(3, 4), nn.LayerNorm(4), nn.Linear(4, 1))
    groups = decay_groups(net, 0.1)
    assert [p.shape for p in groups[0]["params"]] == [(4, 3), (1, 4)] and groups[0]["weight_decay"] == 0.1
    assert [p.shape for p in groups[1]["params"]] == [(4,), (4,), (4,), (1,)] and groups[1]["weight_decay"] == 0.0


def test_fit_loop_fits_and_records_weighted_epoch_means():
    torch.manual_seed(0)
    x = torch.randn(64, 2)
    y = x @ torch.tensor([2.0, -1.0]) + 0.5
    net = nn.Linear(2, 1)

    def step(batch):
        loss = (net(x[batch]).squeeze(1) - y[batch]).square().mean()
        return loss, {"size": float(len(batch))}, len(batch)

    batches = lambda epoch: torch.arange(64).split(24)  # 24, 24, 16  # noqa: E731
    history = fit_loop(net, batches, step, epochs=40, lr=0.1, weight_decay=0.0, steps_per_epoch=3, device="cpu",
                       what="Probe")
    assert [h["epoch"] for h in history] == list(range(40)) and all(h["sequences"] == 64 for h in history)
    assert history[0]["size"] == pytest.approx((24 * 24 + 24 * 24 + 16 * 16) / 64)
    assert history[-1]["loss"] < 0.01 * history[0]["loss"] and not net.training
    with pytest.raises(ATSError, match="Probe: non-finite loss"):
        fit_loop(net, batches, lambda b: (torch.tensor(float("nan"), requires_grad=True), {}, 1), epochs=1, lr=0.1,
                 weight_decay=0.0, steps_per_epoch=3, device="cpu", what="Probe")
    with pytest.raises(ATSError, match="Probe: no sequence"):
        fit_loop(net, batches, lambda b: (torch.zeros(()), {}, 0), epochs=1, lr=0.1, weight_decay=0.0,
                 steps_per_epoch=3, device="cpu", what="Probe")
