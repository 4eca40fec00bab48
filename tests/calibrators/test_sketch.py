"""LogitSketch: logsumexp against the exact one over a range of temperatures, exact top-1 statistics, and the fits
that use it (temperature, scaling-binning, histogram, isotonic) against the same fits on the full logits."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from ats.calibrators import HistogramBinning, IsotonicCalibration, ScalingBinning, TemperatureScaling
from ats.calibrators._fitting import collect_top1
from ats.calibrators.sketch import LogitSketch
from ats.errors import ATSError


def lm_like_logits(n: int = 600, v: int = 5000, true_t: float = 1.6, seed: int = 0):
    """Logits shaped like an LM's (a broad bulk, a few strong candidates) and labels drawn from softmax(z / true_t)."""
    gen = torch.Generator().manual_seed(seed)
    z = torch.randn(n, v, generator=gen) * 2.0
    strong = torch.randint(0, v, (n, 5), generator=gen)
    z.scatter_add_(1, strong, 6.0 + 4.0 * torch.rand(n, 5, generator=gen))
    y = torch.multinomial(torch.softmax(z / true_t, -1), 1, generator=gen).squeeze(1)
    return z, y


def chunked(z, y, size: int = 128):
    return lambda: ((z[i:i + size], y[i:i + size]) for i in range(0, len(y), size))


@pytest.mark.parametrize("s", [0.02, 0.3, 1.0, 2.5, 20.0])
def test_logsumexp_close_to_exact(s):
    z, y = lm_like_logits()
    sketch = LogitSketch.from_chunks(chunked(z, y), top_k=16, tail_bins=32)
    exact = torch.logsumexp(s * z.double(), dim=1)
    approx = sketch.logsumexp(torch.tensor(s, dtype=torch.float64))
    assert (approx - exact).abs().max() < 2e-3
    nll_exact = exact - s * z.double().gather(1, y[:, None]).squeeze(1)
    assert torch.allclose(sketch.nll(torch.tensor(s, dtype=torch.float64)), nll_exact, atol=2e-3)


def test_exact_when_the_vocabulary_fits_in_top_k():
    z, y = lm_like_logits(n=50, v=40)
    sketch = LogitSketch.from_chunks(chunked(z, y), top_k=64)
    assert torch.allclose(sketch.logsumexp(torch.tensor(0.7, dtype=torch.float64)),
                          torch.logsumexp(0.7 * z.double(), dim=1), atol=1e-5)


def test_top1_statistics_equal_collect_top1():
    z, y = lm_like_logits()
    y[:7] = -100  # ignored positions are dropped, as by every fitter
    sketch = LogitSketch.from_chunks(chunked(z, y))
    conf, correct = collect_top1(chunked(z, y))
    assert len(sketch) == len(y) - 7
    np.testing.assert_array_equal(sketch.confidence.numpy(), conf)
    np.testing.assert_array_equal(sketch.correct.numpy(), correct)
    scaled, _ = collect_top1(chunked(z, y), transform=lambda x: x / 1.7)
    np.testing.assert_allclose(sketch.top1_confidence(1 / 1.7).numpy(), scaled, atol=1e-4)


def test_empty_chunks_refused():
    with pytest.raises(ATSError, match="no fitting tokens"):
        LogitSketch.from_chunks(lambda: iter([(torch.zeros(2, 5), torch.full((2,), -100))]))


def source(z, y, *, sketch: bool):
    chunks = chunked(z, y)
    return SimpleNamespace(logit_chunks=chunks, fitted={}, sketch=LogitSketch.from_chunks(chunks) if sketch else None)


def test_temperature_on_sketch_matches_exact_fit():
    z, y = lm_like_logits()
    exact = TemperatureScaling().fit(chunked(z, y)).temperature
    sketched = TemperatureScaling().fit_source(source(z, y, sketch=True)).temperature
    assert abs(exact - 1.6) < 0.15  # the planted temperature is found at all
    assert sketched == pytest.approx(exact, rel=1e-3)


def test_binning_on_sketch_matches_chunks():
    z, y = lm_like_logits()
    for cls in (HistogramBinning, IsotonicCalibration):
        a = cls().fit_source(source(z, y, sketch=True)).state_tensors()
        b = cls().fit_source(source(z, y, sketch=False)).state_tensors()
        for key in a:
            torch.testing.assert_close(a[key], b[key], rtol=0, atol=0)
    a = ScalingBinning().fit_source(source(z, y, sketch=True))
    b = ScalingBinning().fit_source(source(z, y, sketch=False))
    assert a.temperature == pytest.approx(b.temperature, rel=1e-3)
    np.testing.assert_allclose(a.values, b.values, atol=2e-3)
