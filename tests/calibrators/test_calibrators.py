"""Token-level baselines: temperature fit exactness, binning maps, isotonic vs sklearn, persistence, errors."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from sklearn.isotonic import IsotonicRegression

from ats.calibrators import (
    HistogramBinning,
    IsotonicCalibration,
    ScalingBinning,
    TemperatureScaling,
    Uncalibrated,
    VectorScaling,
    build_calibrator,
    calibrator_class,
    load_calibrator,
    names,
)
from ats.calibrators._fitting import collect_top1
from ats.calibrators.base import ChunkSource
from ats.calibrators.binning import equal_mass_bins
from ats.errors import ATSError


def make_data(n: int = 2000, v: int = 30, temperature: float = 2.0, seed: int = 0):
    """Logits (n, v) and labels drawn from softmax(logits / temperature): the true temperature is known."""
    gen = torch.Generator().manual_seed(seed)
    z = torch.randn(n, v, generator=gen) * 3.0
    y = torch.multinomial(torch.softmax(z / temperature, -1), 1, generator=gen).squeeze(1)
    return z, y


def chunked(z, y, size: int = 500):
    return lambda: ((z[i:i + size], y[i:i + size]) for i in range(0, len(y), size))


def golden_min(f, lo: float, hi: float, tol: float = 1e-9) -> float:
    """Brute-force 1-D minimiser of a unimodal function (no scipy needed)."""
    g = (math.sqrt(5) - 1) / 2
    a, b = lo, hi
    while b - a > tol:
        c, d = b - g * (b - a), a + g * (b - a)
        if f(c) < f(d):
            b = d
        else:
            a = c
    return (a + b) / 2


# --- temperature scaling --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("true_t", [2.0, 0.4])
def test_temperature_matches_brute_force(true_t):
    z, y = make_data(temperature=true_t)
    fitted = TemperatureScaling().fit(chunked(z, y)).temperature
    zd = z.double()
    best = golden_min(lambda t: F.cross_entropy(zd / t, y).item(), 0.05, 20.0)
    assert fitted == pytest.approx(best, abs=1e-4)
    assert fitted == pytest.approx(true_t, rel=0.1)  # and the known temperature is recovered


def test_temperature_independent_of_chunk_size():
    z, y = make_data(n=1200)
    temps = [TemperatureScaling().fit(chunked(z, y, size)).temperature for size in (1200, 500, 77)]
    assert max(temps) - min(temps) < 1e-7


def test_temperature_calibrate_and_ignore_index():
    z, y = make_data(n=600)
    t = TemperatureScaling().fit(chunked(z, y))
    y_pad = torch.cat([y, torch.full((50,), -100)])
    z_pad = torch.cat([z, torch.randn(50, z.shape[1]) * 100])
    assert TemperatureScaling().fit(chunked(z_pad, y_pad)).temperature == pytest.approx(t.temperature, abs=1e-9)
    x = torch.randn(2, 3, z.shape[1])
    assert torch.allclose(t.calibrate(x), x / t.temperature)


def test_temperature_degenerate_data_stays_bounded():
    # Every label is the argmax: the NLL keeps falling as T -> 0; the fit stops at the bound, finite and positive.
    z = torch.randn(200, 10)
    t = TemperatureScaling().fit(chunked(z, z.argmax(1))).temperature
    assert 0.0 < t <= 0.02


def test_bad_labels():
    z, _ = make_data(n=10, v=5)
    with pytest.raises(ATSError, match="label 7"):
        TemperatureScaling().fit(chunked(z, torch.full((10,), 7)))


# --- vector scaling -------------------------------------------------------------------------------------------------
def test_vector_scaling_lowers_nll():
    gen = torch.Generator().manual_seed(1)
    z = torch.randn(3000, 12, generator=gen) * 3.0
    truth = 0.4 * z + torch.linspace(-1.0, 1.0, 12)  # over-confident and biased
    y = torch.multinomial(torch.softmax(truth, -1), 1, generator=gen).squeeze(1)
    vs = VectorScaling(epochs=8, lr=0.05, batch_size=250).fit(chunked(z[:2000], y[:2000]))
    before = F.cross_entropy(z[2000:], y[2000:]).item()
    after = F.cross_entropy(vs.calibrate(z[2000:]), y[2000:]).item()
    assert after < before - 0.3
    assert vs.scale.shape == (12,) and vs.bias.shape == (12,)


# --- binning --------------------------------------------------------------------------------------------------------
def binary_logits(conf: list[float], correct: list[int]):
    """V = 2 logits whose top-1 confidence is `conf` (class 0); label 0 when correct, 1 otherwise."""
    c = torch.tensor(conf, dtype=torch.float64)
    z = torch.stack([c.log(), (1 - c).log()], 1).float()
    y = torch.tensor([0 if k else 1 for k in correct])
    return z, y


def test_equal_mass_bins_hand():
    # Sorted confidences split 2 + 2: upper edges [0.7, 1.0]; targets (0, 1 | 1, 1) -> values [0.5, 1.0].
    upper, values = equal_mass_bins(np.array([0.9, 0.6, 0.8, 0.7]), np.array([1.0, 0.0, 1.0, 1.0]), 2)
    assert upper.tolist() == [0.7, 1.0] and values.tolist() == [0.5, 1.0]
    # All tied: a single bin holding the mean.
    upper, values = equal_mass_bins(np.full(6, 0.5), np.array([1.0, 0, 0, 1, 1, 1]), 3)
    assert upper.tolist() == [1.0] and values.tolist() == pytest.approx([4 / 6])


def test_histogram_binning_hand():
    # confidences 0.6 0.7 | 0.8 0.9 with correctness 0 1 | 1 1 -> bins map to accuracy 0.5 and 1.0.
    z, y = binary_logits([0.6, 0.7, 0.8, 0.9], [0, 1, 1, 1])
    hb = HistogramBinning(n_bins=2).fit(chunked(z, y, 3))
    out = hb.calibrate_confidence(np.array([0.1, 0.65, 0.75, 1.0]))
    assert isinstance(out, np.ndarray) and out.tolist() == [0.5, 0.5, 1.0, 1.0]
    t_out = hb.calibrate_confidence(torch.tensor([0.65, 0.95], dtype=torch.float32))
    assert isinstance(t_out, torch.Tensor) and t_out.dtype == torch.float32 and t_out.tolist() == [0.5, 1.0]
    assert torch.equal(hb.calibrate(z), z) and hb.maps_confidence


def test_scaling_binning_values():
    z, y = make_data(n=1500)
    sb = ScalingBinning(n_bins=5).fit(chunked(z, y))
    t = TemperatureScaling().fit(chunked(z, y)).temperature
    assert sb.temperature == pytest.approx(t)
    conf = torch.softmax(z / t, -1).max(-1).values.double().numpy()
    groups = np.split(np.sort(conf), 5)  # 1500 tokens, no ties: 5 groups of 300
    assert sb.values == pytest.approx([g.mean() for g in groups], abs=1e-12)
    # Every fitting token maps to the mean of its own group.
    mapped = sb.calibrate_confidence(np.sort(conf))
    assert mapped == pytest.approx(np.repeat([g.mean() for g in groups], 300), abs=1e-12)
    assert torch.allclose(sb.calibrate(z), z / t)
    # Reusing the temperature fitted on the same source (as fit_calibrators does) gives the same bins.
    reused = ScalingBinning(n_bins=5).fit(ChunkSource(chunked(z, y), fitted={"temperature": TemperatureScaling(
        ).fit(chunked(z, y))}))
    assert reused.temperature == t and reused.values == pytest.approx(sb.values, abs=1e-9)


# --- isotonic -------------------------------------------------------------------------------------------------------
def test_isotonic_matches_sklearn():
    z, y = make_data(n=800)
    iso = IsotonicCalibration().fit(chunked(z, y))
    conf, correct = collect_top1(chunked(z, y))
    ref = IsotonicRegression(out_of_bounds="clip", y_min=0, y_max=1).fit(conf, correct)
    grid = np.linspace(0.0, 1.0, 501)
    assert iso.calibrate_confidence(grid) == pytest.approx(ref.predict(grid), abs=1e-12)
    t_out = iso.calibrate_confidence(torch.tensor(grid, dtype=torch.float32))
    assert t_out.dtype == torch.float32 and t_out.shape == (501,)


# --- registry, persistence, errors ----------------------------------------------------------------------------------
FITTABLE = ["temperature", "vector", "scaling-binning", "histogram", "isotonic"]


def _fit(name: str, z, y):
    options = {"epochs": 2, "batch_size": 250} if name == "vector" else {}
    return build_calibrator(name, **options).fit(chunked(z, y))


@pytest.mark.parametrize("name", FITTABLE + ["none"])
def test_save_load_round_trip(name, tmp_path):
    z, y = make_data(n=600, v=8)
    cal = _fit(name, z, y)
    cal.save_pretrained(tmp_path / name)
    for loaded in (load_calibrator(tmp_path / name), calibrator_class(name).from_pretrained(tmp_path / name)):
        assert type(loaded) is type(cal)
        x = torch.randn(3, 4, 8)
        assert torch.equal(loaded.calibrate(x), cal.calibrate(x))
        conf = np.linspace(0, 1, 101)
        assert np.array_equal(loaded.calibrate_confidence(conf), cal.calibrate_confidence(conf))
        assert loaded.config() == cal.config()


def test_registry_names():
    # thermometer fits on sequences, ATS and its controls train heads (their own tests)
    assert set(names()) == {"none", "thermometer", *FITTABLE, "ats", "selective-temperature", "selective-linear",
                            "probe"}  # the probe: fitted on answers (tests/calibrators/test_probe.py)
    assert isinstance(build_calibrator("none"), Uncalibrated)
    with pytest.raises(ATSError, match="unknown name 'platt'.*temperature.*isotonic"):
        build_calibrator("platt")
    with pytest.raises(ATSError, match="temperature"):
        build_calibrator("temperature", n_bins=3)
    with pytest.raises(ATSError, match="n_bins"):
        build_calibrator("histogram", n_bins=0)


@pytest.mark.parametrize("name", FITTABLE)
def test_use_before_fit(name, tmp_path):
    cal = build_calibrator(name)
    with pytest.raises(ATSError, match="not fitted"):
        cal.calibrate(torch.randn(2, 8))
    with pytest.raises(ATSError, match="not fitted"):
        cal.save_pretrained(tmp_path / "x")
    assert not (tmp_path / "x").exists()
    if cal.maps_confidence:
        with pytest.raises(ATSError, match="not fitted"):
            cal.calibrate_confidence(np.array([0.5]))


def test_corrupt_safetensors(tmp_path):
    z, y = make_data(n=300, v=8)
    _fit("isotonic", z, y).save_pretrained(tmp_path / "iso")
    weights = tmp_path / "iso" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:20])
    with pytest.raises(ATSError, match="model.safetensors"):
        load_calibrator(tmp_path / "iso")
    weights.unlink()
    with pytest.raises(ATSError, match="x_thresholds"):
        load_calibrator(tmp_path / "iso")


def test_load_unknown_type(tmp_path):
    (tmp_path / "calibrator_config.json").write_text('{"type": "platt"}')
    with pytest.raises(ATSError, match="'platt'"):
        load_calibrator(tmp_path)
