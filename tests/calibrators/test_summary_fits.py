"""Temperature scaling, the binning methods and Thermometer fitted from the features' scale summary against the exact
route (the logits, recomputed from the stored hidden states), on a tiny model; the fit route recorded in the
calibrators' fingerprints."""

import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from ats.calibrators import build_calibrator
from ats.calibrators._fitting import collect_top1, source_top1
from ats.calibrators.temperature import TemperatureScaling, nll_derivatives, summary_derivatives
from ats.calibrators.thermometer import Thermometer, prompt_states
from ats.errors import ATSError
from ats.fingerprint import stored_fingerprint
from ats.model.scale_summary import ScaleSummarySpec, summarize_logits
from ats.model.scaled_ce import scaled_cross_entropy
from ats.training.data import DataConfig, load_instructions, tokenize_instructions
from ats.training.features import extract_features
from ats.workflows.pipeline import FeatureSource, fit_calibrators, prepare_features


@pytest.fixture(scope="module")
def store(tiny_backbone, tokenizer, tmp_path_factory):
    examples = tokenize_instructions(tokenizer, load_instructions("alpaca_gpt4", limit=16, seed=0), max_length=64)[0]
    return extract_features(tiny_backbone, examples, tmp_path_factory.mktemp("fit-features") / "f", shard_sequences=5,
                            progress=False)


@pytest.fixture(scope="module")
def exact(store, tiny_backbone):
    """The fitting tokens' logits (N, V) and labels (N,), recomputed from the stored hidden states: the exact
    route's own inputs, in the order of the store's response tokens."""
    chunks = list(store.logit_chunks(tiny_backbone.logits)())
    return torch.cat([z for z, _ in chunks]), torch.cat([y for _, y in chunks])


def test_the_stored_summary_describes_the_exact_routes_logits(store, exact):
    z, y = exact
    rows = store.response_summary()
    assert rows.shape == (len(y), ScaleSummarySpec().width)
    torch.testing.assert_close(rows, summarize_logits(z, y, max_scale=10.0))  # the same z as the exact route
    subset = store._token_subset(30, 0)
    torch.testing.assert_close(store.response_summary(max_tokens=30), rows[subset])


def test_summary_derivatives_equal_the_exact_passes(store, exact, tiny_backbone):
    rows = store.response_summary().double()
    for s in (0.05, 0.3, 1.0, 2.5, 10.0):
        _, grad, hess, _ = nll_derivatives(store.logit_chunks(tiny_backbone.logits), s)
        g, h = summary_derivatives(rows, s)
        assert g == pytest.approx(grad, rel=1e-4, abs=1e-6) and h == pytest.approx(hess, rel=1e-4, abs=1e-6), s


@pytest.mark.parametrize("labels", ["data", "argmax-heavy"])
def test_temperature_from_the_summary_equals_the_exact_fit_to_1e_3(exact, labels):
    """Target of issue 24: the fitted temperature within 1e-3 of the exact route (here far closer); on the data's
    labels, and on labels mostly at the argmax (a sharpening optimum, T < 1)."""
    z, y = exact
    if labels == "argmax-heavy":
        y = torch.where(torch.arange(len(y)) % 5 == 0, y, z.argmax(-1))
    rows = summarize_logits(z, y, max_scale=10.0)
    reference = TemperatureScaling(tol=1e-8).fit(lambda: iter([(z, y)])).temperature
    fitted = TemperatureScaling(tol=1e-8).fit(SimpleNamespace(summary=rows, logit_chunks=None))  # no chunk read
    assert fitted.temperature == pytest.approx(reference, rel=1e-3)
    assert abs(math.log(fitted.temperature / reference)) < 1e-5, (fitted.temperature, reference)  # seen: 2e-6
    if labels == "argmax-heavy":
        assert reference < 1.0


def test_an_optimum_beyond_the_summary_is_fitted_on_the_chunks(exact):
    z, y = exact
    y = z.argmax(-1)  # every token right: the optimum is a large 1/T
    rows = summarize_logits(z, y, max_scale=1.5)
    chunks = lambda: iter([(z, y)])  # noqa: E731
    source = SimpleNamespace(summary=rows, logit_chunks=chunks)
    assert TemperatureScaling().fit(source).temperature == TemperatureScaling().fit(chunks).temperature
    assert 1.0 / TemperatureScaling().fit(chunks).temperature > 1.5
    with pytest.raises(ATSError, match="expected scale summary rows"):
        TemperatureScaling().fit(SimpleNamespace(summary=rows[:0], logit_chunks=chunks))


def test_binning_from_the_summary_matches_the_exact_pass(exact):
    """The summary's top-1 confidence (-G(s) of its quintic) and correctness against the logits' own, at T = 1 and
    at a fitted T; the binning maps fitted on either agree to the confidences' difference."""
    z, y = exact
    rows = summarize_logits(z, y, max_scale=10.0)
    chunks = lambda: iter([(z, y)])  # noqa: E731
    for temperature in (1.0, 0.7):
        by_summary = source_top1(SimpleNamespace(summary=rows, logit_chunks=None), temperature)
        by_logits = collect_top1(chunks, transform=lambda logits: logits / temperature)
        np.testing.assert_allclose(by_summary[0], by_logits[0], rtol=0, atol=5e-5)  # seen: 2.6e-5
        np.testing.assert_array_equal(by_summary[1], by_logits[1])
    grid = np.linspace(0, 1, 201)
    for name in ("histogram", "isotonic", "scaling-binning"):
        a = build_calibrator(name).fit(SimpleNamespace(summary=rows, logit_chunks=None, fitted={}))
        b = build_calibrator(name).fit(chunks)
        np.testing.assert_allclose(a.map_confidence(grid), b.map_confidence(grid), rtol=0, atol=1e-3, err_msg=name)


def test_thermometer_from_the_summary_follows_the_exact_route(store, exact, tiny_backbone):
    """`fit` on the summary against `fit_tokens` with each token's CE computed from the full logits (the exact
    route) on the same batches, so the two fits can be compared step for step."""
    z, y = exact
    prompts, ids = prompt_states(store), store.response_sequence_ids()
    options = dict(hidden_size=tiny_backbone.hidden_size, mlp_hidden=16, epochs=4, lr=1e-2, batch_size=4)
    source = SimpleNamespace(summary=store.response_summary(), sequence_ids=ids, store=store)
    by_summary = Thermometer(**options).fit(source)
    by_exact = Thermometer(**options).fit_tokens(
        prompts, ids, lambda rows, s: scaled_cross_entropy(z[rows], s, y[rows], lambda h: h).ce_label)
    assert by_summary.beyond_summary_ == 0
    t_summary, t_exact = by_summary.temperature(prompts), by_exact.temperature(prompts)
    assert (t_exact - 1).abs().max() > 0.01  # the fit moved the temperatures
    torch.testing.assert_close(t_summary, t_exact, rtol=1e-4, atol=0)
    for a, b in zip(by_summary.history, by_exact.history):
        assert a["nll"] == pytest.approx(b["nll"], rel=1e-5)
    with pytest.raises(ATSError, match="2 summary rows but sequence_ids"):
        Thermometer(**options).fit(SimpleNamespace(summary=store.response_summary()[:2], sequence_ids=ids,
                                                   store=store))


def test_fit_takes_the_summary_and_records_the_route(tiny_backbone, tmp_path):
    data = DataConfig(limit=16, max_length=64, shard_sequences=4)
    train, _ = prepare_features(tiny_backbone, tmp_path / "f", data, progress=False)
    source = FeatureSource(tiny_backbone, train)
    assert source.summary is not None and len(source.summary) == train.meta["response_tokens"]
    assert FeatureSource(tiny_backbone, train, exact=True).summary is None
    fitted = fit_calibrators(tiny_backbone, train, tmp_path / "cal", ("temperature", "thermometer", "histogram"),
                             progress=False)
    spec = ScaleSummarySpec().describe()
    prints = {name: stored_fingerprint(tmp_path / "cal" / name) for name in fitted}
    assert prints["temperature"]["scale_summary"] == spec and prints["thermometer"]["scale_summary"] == spec
    assert prints["histogram"]["scale_summary"] == spec
    exact = fit_calibrators(tiny_backbone, train, tmp_path / "ref", ("temperature",), shared_pass=False,
                            progress=False)["temperature"]
    assert "scale_summary" not in stored_fingerprint(tmp_path / "ref" / "temperature")
    assert fitted["temperature"].temperature == pytest.approx(exact.temperature, rel=1e-3)
    with pytest.raises(ATSError, match="scale_summary"):  # a fit by the summary is not reused for the exact route
        fit_calibrators(tiny_backbone, train, tmp_path / "cal", ("temperature",), shared_pass=False, progress=False)
