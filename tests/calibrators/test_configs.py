"""Calibrators as configs (issue 23): options held once in a Config dataclass, `fit` reading the view its source chose
(the scale summary, else the logits), scaling-binning reusing the temperature fitted on the same source, and the one
AdamW loop every learned calibrator trains through (issue 31)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from torch import nn

from ats.calibrators import build_calibrator, calibrator_class, names
from ats.calibrators.ats import ATSCalibrator, ATSConfig
from ats.calibrators.binning import ScalingBinning
from ats.calibrators.fit_loop import BatchObjective, FitLoop, decay_groups
from ats.calibrators.temperature import TemperatureScaling
from ats.calibrators.thermometer import Thermometer
from ats.errors import ATSError
from ats.model.heads import HeadConfig
from ats.model.scale_summary import summarize_logits


def make_chunks(n: int = 400, v: int = 12, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    z = torch.randn(n, v, generator=gen) * 3.0
    y = torch.multinomial(torch.softmax(z / 1.5, -1), 1, generator=gen).squeeze(1)
    return lambda: ((z[i:i + 100], y[i:i + 100]) for i in range(0, n, 100))


class Source:
    """A FitSource that records which of its views a fit reads."""

    def __init__(self, chunks, *, summary=None, fitted=None):
        self._chunks, self._summary, self.fitted, self.read = chunks, summary, fitted or {}, []

    @property
    def logit_chunks(self):
        self.read.append("logit_chunks")
        return self._chunks

    @property
    def summary(self):
        self.read.append("summary")
        return self._summary


def summary_of(chunks):
    z, y = (torch.cat(parts) for parts in zip(*chunks()))
    return summarize_logits(z, y, max_scale=10.0)


@pytest.mark.parametrize("name", [n for n in names() if not calibrator_class(n).token_head])
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


def test_fit_reads_the_summary_when_the_source_has_one_else_the_chunks():
    chunks = make_chunks()
    # temperature scaling: the summary first (none here), then one pass over the chunks per Newton step
    source = Source(chunks)
    exact = TemperatureScaling().fit(source).temperature
    assert source.read[:2] == ["summary", "logit_chunks"] and set(source.read) == {"summary", "logit_chunks"}
    assert exact == TemperatureScaling().fit(chunks).temperature  # a bare LogitChunks callable: the same fit
    # with the summary: no pass at all, and the same T up to the summary's interpolation
    source = Source(chunks, summary=summary_of(chunks))
    assert TemperatureScaling().fit(source).temperature == pytest.approx(exact, rel=1e-4)
    assert source.read == ["summary"]
    # vector scaling reads only the chunks
    source = Source(chunks, summary=summary_of(chunks))
    build_calibrator("vector", epochs=1).fit(source)
    assert source.read == ["logit_chunks"]
    # isotonic regression: the summary's top-1 confidences and correctness, no pass; the map is the exact one's
    source = Source(chunks, summary=summary_of(chunks))
    iso = build_calibrator("isotonic").fit(source)
    assert source.read == ["summary"]
    grid = np.linspace(0, 1, 101)
    np.testing.assert_allclose(iso.map_confidence(grid), build_calibrator("isotonic").fit(chunks).map_confidence(grid),
                               atol=1e-3)
    # an ATS head is trained, never fitted
    with pytest.raises(ATSError, match="trained, not fitted"):
        ATSCalibrator(ATSConfig(head=HeadConfig(head_type="linear", hidden_size=4), hidden_size=4)).fit(chunks)


def test_scaling_binning_builds_on_the_temperature_fitted_on_the_same_source():
    chunks = make_chunks()
    done = TemperatureScaling().fit(chunks)
    done.temperature = 3.0  # a temperature it could not have fitted itself: proves it was reused
    for summary in (summary_of(chunks), None):
        cal = ScalingBinning(n_bins=4).fit(Source(chunks, summary=summary, fitted={"temperature": done}))
        assert cal.temperature == 3.0
    alone = ScalingBinning(n_bins=4).fit(Source(chunks))
    assert alone.temperature == TemperatureScaling().fit(chunks).temperature


def test_decay_groups_decay_the_matrices_only():
    net = nn.Sequential(nn.Linear(3, 4), nn.LayerNorm(4), nn.Linear(4, 1))
    groups = decay_groups(net, 0.1)
    assert [p.shape for p in groups[0]["params"]] == [(4, 3), (1, 4)] and groups[0]["weight_decay"] == 0.1
    assert [p.shape for p in groups[1]["params"]] == [(4,), (4,), (4,), (1,)] and groups[1]["weight_decay"] == 0.0


def test_fit_loop_fits_skips_empty_steps_and_names_a_non_finite_loss():
    torch.manual_seed(0)
    x = torch.randn(64, 2)
    y = x @ torch.tensor([2.0, -1.0]) + 0.5
    net = nn.Linear(2, 1)

    def loss(batch):
        if batch is None:  # nothing to learn from: no step
            return None
        out = (net(x[batch]).squeeze(1) - y[batch]).square().mean()
        return out, {"size": float(len(batch))}

    batches = lambda epoch: [*torch.arange(64).split(24), None]  # 24, 24, 16, an empty one  # noqa: E731
    history = FitLoop(net, BatchObjective("Probe", batches, loss), lr=0.1, weight_decay=0.0, epochs=40).run()
    assert [(h["epoch"], h["step"]) for h in history] == [(e, k) for e in range(40) for k in (1, 2, 3)]
    assert [h["size"] for h in history[:3]] == [24.0, 24.0, 16.0] and all(h["lr"] == 0.1 for h in history)
    assert history[-1]["loss"] < 0.01 * history[0]["loss"] and not net.training
    with pytest.raises(ATSError, match="Probe: non-finite loss nan at epoch 0, step 0"):
        FitLoop(net, BatchObjective("Probe", batches, lambda b: (torch.tensor(float("nan"), requires_grad=True), {})),
                lr=0.1, weight_decay=0.0, epochs=1).run()


def test_fit_loop_accumulates_micro_batches_into_one_step():
    """Two micro-batches per step with each loss halved: the same update as one step on the mean of both losses."""
    x = torch.randn(8, 3, generator=torch.Generator().manual_seed(1))
    nets = [nn.Linear(3, 1) for _ in range(2)]
    nets[1].load_state_dict(nets[0].state_dict())

    class Halves(BatchObjective):
        accumulation = 2

        def steps(self, epoch):
            return 1

    halves = Halves("Probe", lambda e: [x[:4], x[4:]], lambda b: (nets[0](b).square().mean(), {}))
    FitLoop(nets[0], halves, lr=0.05, weight_decay=0.0, epochs=1).run()
    whole = BatchObjective("Probe", lambda e: [x], lambda b: (
        (nets[1](b[:4]).square().mean() + nets[1](b[4:]).square().mean()) / 2, {}))
    FitLoop(nets[1], whole, lr=0.05, weight_decay=0.0, epochs=1).run()
    for a, b in zip(nets[0].parameters(), nets[1].parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-7)
