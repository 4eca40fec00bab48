"""The reusable steps on the tiny model: each result is reused only for the options that made it."""

from __future__ import annotations

import json

import pytest
import torch

from ats.errors import ATSError
from ats.fingerprint import stored_fingerprint
from ats.training.config import TrainingConfig
from ats.training.data import DataConfig
from ats.workflows.pipeline import fit_calibrators, fit_head, prepare_features, train_head

from helpers import make_tiny_backbone

DATA = DataConfig(limit=10, max_length=64, val_fraction=0.3)
TRAINING = TrainingConfig(lr=1e-3, epochs=1, batch_size=2, micro_batch_size=2)


def test_features_reuse_refuse_and_overwrite(tiny_backbone, tmp_path):
    train, val = prepare_features(tiny_backbone, tmp_path / "f", DATA, progress=False)
    fp = stored_fingerprint(train.directory)
    assert fp["kind"] == "features" and fp["data"]["max_length"] == 64 and fp["split"] == "train"
    assert fp["backbone"]["base_model"] == "tiny-llama" and len(fp["data"]["checksum"]) == 16
    # a backbone with the same name and revision but other weights: the fingerprint matches, so the stored features
    # come back; recomputed, they would be this backbone's hidden states, which differ
    twin = make_tiny_backbone(tiny_backbone.tokenizer, seed=5)
    twin.name, twin.revision = tiny_backbone.name, tiny_backbone.revision
    ids = torch.arange(12)[None]
    assert not torch.allclose(twin.forward(ids)[0], tiny_backbone.forward(ids)[0])
    again, _ = prepare_features(twin, tmp_path / "f", DATA, progress=False)
    assert len(again) == len(train)
    assert all(torch.equal(a[0], b[0]) for a, b in zip(again.sequences(), train.sequences(), strict=True))
    with pytest.raises(ATSError, match=r"features made with other options: data.checksum .*data.limit 10 -> 12"):
        prepare_features(tiny_backbone, tmp_path / "f", DATA.replace(limit=12), progress=False)
    bigger, _ = prepare_features(tiny_backbone, tmp_path / "f", DATA.replace(limit=12), overwrite=True, progress=False)
    assert stored_fingerprint(bigger.directory)["data"]["limit"] == 12


def test_a_head_resumes_only_the_run_it_was(tiny_backbone, tmp_path):
    train, val = prepare_features(tiny_backbone, tmp_path / "f", DATA, progress=False)
    head, reused = fit_head(tiny_backbone, train, val, tmp_path / "head", head_type="linear", training=TRAINING,
                            progress=False)
    assert not reused and not hasattr(head, "reused") and (tmp_path / "head.work" / "fingerprint.json").is_file()
    # an interrupted run of OTHER options sits in head.work: resuming refuses to continue it
    (tmp_path / "head" / "calibrator_config.json").unlink()
    work = tmp_path / "head.work" / "fingerprint.json"
    fp = json.loads(work.read_text())
    work.write_text(json.dumps({**fp, "training": {**fp["training"], "lr": 0.5}}))
    with pytest.raises(ATSError, match=r"head.work: interrupted training made with other options: training.lr 0.5 "
                                       r"-> 0.001"):
        train_head(tiny_backbone, train, val, tmp_path / "head", head_type="linear", training=TRAINING, resume=True,
                   progress=False)
    # without --resume the stale checkpoints are cleared and the head trained afresh
    again, reused = fit_head(tiny_backbone, train, val, tmp_path / "head", head_type="linear", training=TRAINING,
                             progress=False)
    assert not reused and stored_fingerprint(tmp_path / "head.work")["training"]["lr"] == 0.001


def test_controls_train_like_the_ats_head_and_baselines_refit_only_when_asked(tiny_backbone, tmp_path):
    train, val = prepare_features(tiny_backbone, tmp_path / "f", DATA, progress=False)
    fitted = fit_calibrators(tiny_backbone, train, tmp_path / "cal", ("temperature", "selective-linear"),
                             val_store=val, training=TRAINING, progress=False)
    control = fitted["selective-linear"]
    assert control.label == "selective-linear" and control.config_.head.head_type == "linear"
    assert control.config_.training["lr"] == TRAINING.lr and control.config_.training["loss_type"] == "selective"
    again = fit_calibrators(tiny_backbone, train, tmp_path / "cal", ("temperature", "selective-linear"),
                            val_store=val, training=TRAINING, progress=False)
    assert again["temperature"].temperature == fitted["temperature"].temperature
    head, reused = fit_head(tiny_backbone, train, val, tmp_path / "cal" / "selective-linear",
                            method="selective-linear", training=TRAINING, progress=False)
    assert reused and head.digest() == control.digest()  # the control saved by fit_calibrators, reused as it is
    reloaded = train_head(tiny_backbone, train, val, tmp_path / "cal" / "selective-linear", method="selective-linear",
                          training=TRAINING, progress=False)
    assert reloaded.digest() == control.digest()
    with pytest.raises(ATSError, match=r"selective-linear: head made with other options: .*training.lr 0.001 -> 0.002"):
        fit_calibrators(tiny_backbone, train, tmp_path / "cal", ("selective-linear",), val_store=val,
                        training=TRAINING.replace(lr=2e-3), progress=False)


def test_the_global_control_is_one_temperature_fitted_saved_and_applied(tiny_backbone, tmp_path):
    import torch

    from ats.calibrators import load_calibrator

    train, val = prepare_features(tiny_backbone, tmp_path / "f", DATA, progress=False)
    control = fit_calibrators(tiny_backbone, train, tmp_path / "cal", ("selective-temperature",), val_store=val,
                              training=TRAINING.replace(lr=1e-2), progress=False)["selective-temperature"]
    assert control.label == "selective-temperature" and control.config_.head.head_type == "constant"
    tau = control.head.gain * control.head.tau.item()
    assert tau != 0.0  # it moved (the random tiny model is over-confident: the selective loss lowers confidence)
    loaded = load_calibrator(tmp_path / "cal" / "selective-temperature", backbone=tiny_backbone)
    hidden = torch.randn(2, 5, tiny_backbone.hidden_size)
    z = torch.randn(2, 5, tiny_backbone.vocab_size)
    expected = z * min(torch.tensor(tau).exp().item(), control.config_.max_scale)
    torch.testing.assert_close(loaded.apply(z, hidden), expected)  # the same factor for every token
    assert loaded.label == "selective-temperature" and loaded.digest() == control.digest()


def test_shared_pass_fits_like_the_reference_route_and_is_fingerprinted(tiny_backbone, tmp_path):
    import numpy as np
    import torch

    from ats.workflows.pipeline import BASELINES

    train, _ = prepare_features(tiny_backbone, tmp_path / "f", DATA, progress=False)
    fits = {shared: fit_calibrators(tiny_backbone, train, tmp_path / str(shared), BASELINES, fit_tokens=200,
                                    shared_pass=shared, progress=False) for shared in (True, False)}
    new, ref = fits[True], fits[False]
    assert new["temperature"].temperature == pytest.approx(ref["temperature"].temperature, rel=1e-3)
    assert new["scaling-binning"].temperature == pytest.approx(ref["scaling-binning"].temperature, rel=1e-3)
    np.testing.assert_allclose(new["scaling-binning"].values, ref["scaling-binning"].values, atol=2e-3)
    grid = np.linspace(0, 1, 201)
    for name in ("histogram", "isotonic"):  # the summary's top-1 confidences within 5e-5 of the logits'
        np.testing.assert_allclose(new[name].map_confidence(grid), ref[name].map_confidence(grid), atol=2e-3)
    for key, value in new["vector"].state_tensors().items():  # the same logits, replayed from memory
        torch.testing.assert_close(value, ref["vector"].state_tensors()[key], rtol=0, atol=0)
    assert new["thermometer"].fitted and len(new["thermometer"].history) == new["thermometer"].epochs
    summary = stored_fingerprint(tmp_path / "True" / "temperature")["scale_summary"]
    assert stored_fingerprint(tmp_path / "True" / "histogram")["scale_summary"] == summary
    assert "scale_summary" not in stored_fingerprint(tmp_path / "False" / "temperature")
    assert "scale_summary" not in stored_fingerprint(tmp_path / "True" / "vector")  # it never reads the summary
    with pytest.raises(ATSError, match="calibrator 'temperature'.*other options"):
        fit_calibrators(tiny_backbone, train, tmp_path / "True", ("temperature",), fit_tokens=200, shared_pass=False,
                        progress=False)
