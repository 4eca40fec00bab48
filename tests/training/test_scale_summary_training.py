"""Training from the features' scale summaries: every loss equals the exact route's, a head trained both ways ends
in the same place, and the summary's settings are part of the features' fingerprint."""

import math

import pytest
import torch

from ats.calibrators.ats import ATSCalibrator
from ats.errors import ATSError
from ats.fingerprint import stored_fingerprint
from ats.model.labels import IGNORE_INDEX
from ats.model.scale_summary import ScaleSummarySpec
from ats.training.config import TrainingConfig
from ats.training.data import DataConfig, load_instructions, tokenize_instructions, train_val_split
from ats.training.features import FeatureStore, extract_features
from ats.training.losses import calibration_loss
from ats.training.trainer import train_ats
from ats.training.validation import heldout_objective
from ats.workflows.pipeline import prepare_features

SPEC = ScaleSummarySpec(intervals=24)  # fewer nodes than the default keeps the test fast; still within 1e-4 here


@pytest.fixture(scope="module")
def stores(tiny_backbone, tokenizer, tmp_path_factory):
    records = load_instructions("alpaca_gpt4", limit=16, seed=0)
    examples = tokenize_instructions(tokenizer, records, max_length=64)[0]
    train, val = train_val_split(examples, val_fraction=0.25, seed=0)
    root = tmp_path_factory.mktemp("summary-features")
    return (extract_features(tiny_backbone, train, root / "train", shard_sequences=4, progress=False, summary=SPEC),
            extract_features(tiny_backbone, val, root / "val", progress=False, summary=SPEC))


def test_batches_carry_one_summary_row_per_response_token(stores):
    train, _ = stores
    assert train.scale_summary == SPEC and train.meta["scale_summary"] == SPEC.describe()
    for batch in train.batches(3, shuffle=True, seed=1):
        assert batch.summary.shape == (int((batch.labels != IGNORE_INDEX).sum()), SPEC.width)


def test_summary_packed_across_sequences_equals_each_sequence_summarised_alone(tiny_backbone, tokenizer, tmp_path,
                                                                                 monkeypatch):
    from ats.model.scale_summary import summarize_logits
    from ats.training import features

    monkeypatch.setattr(features, "SUMMARY_CHUNK", 5)  # chunks straddle the sequences of a shard
    examples = tokenize_instructions(tokenizer, load_instructions("alpaca_gpt4", limit=6, seed=2), max_length=32)[0]
    store = extract_features(tiny_backbone, examples, tmp_path / "f", shard_sequences=3, progress=False, summary=SPEC)
    assert len(store.meta["shards"]) == 2
    for k in range(len(store.meta["shards"])):
        shard = store.load_shard(k)
        bounds = shard["offsets"].tolist()
        alone = []
        for a, b in zip(bounds[:-1], bounds[1:]):  # one sequence at a time, the way a reader would
            y = shard["labels"][a:b]
            h = shard["hidden"][a:b][y != IGNORE_INDEX]
            alone.append(summarize_logits(tiny_backbone.logits(h).float(), y[y != IGNORE_INDEX],
                                          max_scale=SPEC.max_scale, intervals=SPEC.intervals, knee=SPEC.knee))
        # the same rows up to float32 rounding: a matmul of other rows may round the logits differently
        torch.testing.assert_close(shard["summary"], torch.cat(alone), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("loss_type,weighting", [("selective", "token"), ("selective", "reference"), ("none", "token"),
                                                 ("full", "token"), ("top-label", "token")])
def test_every_loss_from_the_summary_equals_the_exact_route(tiny_backbone, stores, loss_type, weighting):
    batch = next(stores[0].batches(4))
    select = batch.labels != IGNORE_INDEX
    hidden, labels = batch.hidden[select], batch.labels[select]
    g = torch.Generator().manual_seed(0)
    base = torch.exp(torch.randn(len(labels), generator=g)).clamp(0.05, 10.0).double()
    results = []
    for summary in (None, batch.summary):
        scale = base.clone().requires_grad_(True)
        out = calibration_loss(hidden.double(), scale, labels, lambda h: tiny_backbone.logits(h.float()).double(),
                               loss_type=loss_type, weighting=weighting, ignored=5, summary=summary)
        (grad,) = torch.autograd.grad(out.loss, scale)
        results.append((out.loss.item(), grad, out.n_correct))
    (exact, exact_grad, n_exact), (approx, approx_grad, n_approx) = results
    assert n_exact == n_approx
    assert approx == pytest.approx(exact, rel=1e-5)
    # top-label: a wrong token here has p_top = 1 - 2.5e-11, whose gradient (~1 / log p, kept since the clip moved to
    # 1 - 1e-12 in ats.log_loss) carries the summary's relative error on log p there, 7.7e-5: seen 1.1e-4 apart
    rtol = 2e-4 if loss_type == "top-label" else 1e-4
    assert torch.allclose(approx_grad, exact_grad, rtol=rtol, atol=1e-6 * exact_grad.abs().max().item())


def _train(tiny_backbone, store, **options):
    cal = ATSCalibrator.for_backbone(tiny_backbone, head_type="linear", seed=0)
    config = TrainingConfig(**{"lr": 3e-3, "epochs": 2, "batch_size": 4, "micro_batch_size": 2, **options})
    result = train_ats(cal, store, tiny_backbone, config=config, progress=False)
    return cal, result, config


def test_a_head_trained_from_the_summary_ends_where_the_exact_route_ends(tiny_backbone, stores):
    summary_cal, summary_run, config = _train(tiny_backbone, stores[0])
    exact_cal, exact_run, exact_config = _train(tiny_backbone, stores[0], exact_loss=True)
    losses = [row["loss"] for row in summary_run.history]
    assert losses == pytest.approx([row["loss"] for row in exact_run.history], rel=1e-4)
    for a, b in zip(summary_cal.head.parameters(), exact_cal.head.parameters()):
        assert torch.allclose(a, b, rtol=1e-3, atol=1e-5)
    val = stores[1]
    assert heldout_objective(summary_cal, val, tiny_backbone, config) == pytest.approx(
        heldout_objective(summary_cal, val, tiny_backbone, exact_config), rel=1e-5)


def test_a_head_whose_max_scale_the_summary_does_not_cover_is_refused(tiny_backbone, stores):
    cal = ATSCalibrator.for_backbone(tiny_backbone, head_type="linear", max_scale=20.0)
    with pytest.raises(ATSError, match="max_scale 20 exceeds the scale summary's 10 .*--exact-loss"):
        train_ats(cal, stores[0], tiny_backbone, config=TrainingConfig(epochs=1, batch_size=2, micro_batch_size=2),
                  progress=False)


DATA = DataConfig(limit=6, max_length=48, val_fraction=0.3)


def test_a_rerun_with_another_summary_setting_refuses_the_old_features(tiny_backbone, tmp_path):
    train, _ = prepare_features(tiny_backbone, tmp_path / "f", DATA, progress=False, summary=SPEC)
    assert stored_fingerprint(train.directory)["scale_summary"] == SPEC.describe()
    with pytest.raises(ATSError, match=r"features made with other options: scale_summary.intervals 24 -> 12"):
        prepare_features(tiny_backbone, tmp_path / "f", DATA, progress=False, summary=ScaleSummarySpec(intervals=12))
    redone, _ = prepare_features(tiny_backbone, tmp_path / "f", DATA, progress=False, overwrite=True,
                                 summary=ScaleSummarySpec(intervals=12))
    assert redone.scale_summary == ScaleSummarySpec(intervals=12)


def test_features_without_a_summary_train_by_the_exact_route_and_are_refused_when_one_is_asked(tiny_backbone,
                                                                                                  tmp_path):
    old, _ = prepare_features(tiny_backbone, tmp_path / "f", DATA, progress=False, summary=None)
    assert old.scale_summary is None and "summary" not in old.load_shard(0)
    assert FeatureStore(old.directory).scale_summary is None
    _, result, _ = _train(tiny_backbone, old, epochs=1)
    assert result.history and all(row["loss"] == row["loss"] for row in result.history)
    with pytest.raises(ATSError, match=r"features made with other options: scale_summary"):
        prepare_features(tiny_backbone, tmp_path / "f", DATA, progress=False, summary=SPEC)


def test_the_global_control_fits_the_same_temperature_both_ways(tiny_backbone, stores):
    """Issue 24's target: the control's fitted temperature (one global tau, the selective loss) within 1e-3 between
    the summary and the exact route."""
    temperatures = {}
    for exact in (False, True):
        cal = ATSCalibrator.for_backbone(tiny_backbone, head_type="constant", seed=0)
        config = TrainingConfig(lr=3e-2, epochs=3, batch_size=4, micro_batch_size=2, exact_loss=exact)
        train_ats(cal, stores[0], tiny_backbone, config=config, progress=False)
        temperatures[exact] = math.exp(-cal.head.gain * float(cal.head.tau.detach()))  # T = 1 / exp(tau)
    assert abs(temperatures[True] - 1) > 0.01, temperatures  # training moved it
    assert temperatures[False] == pytest.approx(temperatures[True], rel=1e-3)
