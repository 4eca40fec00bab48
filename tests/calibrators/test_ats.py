"""ATS calibrator: identity at init, q = z * exp(tau), save/load round trip, refusal of a mismatched backbone."""

import json
import math

import pytest
import torch

from ats.calibrators import build_calibrator, load_calibrator
from ats.calibrators.ats import ATSCalibrator
from ats.calibrators.calibrated_model import CalibratedModel
from ats.errors import ATSError


def _randomize(calibrator, seed=0):
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in calibrator.head.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen))
    return calibrator


@pytest.mark.parametrize("head_type", ["linear", "mlp", "transformer"])
def test_identity_at_init_and_argmax_kept(tiny_backbone, head_type):
    cal = ATSCalibrator.for_backbone(tiny_backbone, head_type=head_type)
    ids = torch.randint(0, len(tiny_backbone.tokenizer), (2, 9), generator=torch.Generator().manual_seed(0))
    h, _ = tiny_backbone.forward(ids)
    z = tiny_backbone.logits(h)
    assert torch.equal(cal.log_scale(h), torch.zeros(2, 9))
    assert torch.equal(cal.calibrate(z, h), z)
    _randomize(cal)
    q = cal.calibrate(z, h)
    assert not torch.equal(q, z) and torch.equal(q.argmax(-1), z.argmax(-1))  # accuracy untouched
    # index form: logits at a subset of positions, hidden of the whole sequence
    index = torch.tensor([[8], [3]])
    q_at = cal.calibrate(z.gather(1, index[..., None].expand(-1, -1, z.shape[-1])), h, index=index)
    torch.testing.assert_close(q_at[:, 0], torch.stack([q[0, 8], q[1, 3]]))


def test_a_linear_head_scales_the_logits_by_hand(tiny_backbone):
    """A linear head with hand-set weights: tau = h . w + b computed here in float64, q = z * e^tau, and the
    softmax of q is the softmax of z at temperature T = e^-tau; a tau above log(max_scale) is clamped."""
    cal = ATSCalibrator.for_backbone(tiny_backbone, head_type="linear", max_scale=10.0)
    h = torch.randn(1, 4, tiny_backbone.hidden_size, generator=torch.Generator().manual_seed(1))
    z = tiny_backbone.logits(h)
    w = torch.linspace(-0.05, 0.05, tiny_backbone.hidden_size)
    with torch.no_grad():
        cal.head.proj.weight.copy_(w[None])
        cal.head.proj.bias.fill_(math.log(2.0))
    tau = h[0].double() @ w.double() + math.log(2.0)  # (4,)
    assert cal.log_scale(h)[0].double().tolist() == pytest.approx(tau.tolist(), abs=1e-5)
    q = cal.calibrate(z, h)[0].double()
    torch.testing.assert_close(q, z[0].double() * tau.exp()[:, None], rtol=1e-5, atol=1e-5)
    temperature = (-tau).exp()
    torch.testing.assert_close(q.softmax(-1), (z[0].double() / temperature[:, None]).softmax(-1), rtol=1e-5,
                               atol=1e-7)
    with torch.no_grad():
        cal.head.proj.weight.zero_()
        cal.head.proj.bias.fill_(math.log(50.0))  # s = 50 > max_scale: clamped to 10
    torch.testing.assert_close(cal.calibrate(z, h), 10.0 * z)


def test_temperature_is_a_deprecated_name_of_log_scale(tiny_backbone):
    cal = _randomize(ATSCalibrator.for_backbone(tiny_backbone, head_type="linear"))
    h = torch.randn(1, 3, tiny_backbone.hidden_size, generator=torch.Generator().manual_seed(2))
    with pytest.warns(DeprecationWarning, match="log_scale"):
        old = cal.temperature(h)
    assert torch.equal(old, cal.log_scale(h))


def test_max_scale_clamp(tiny_backbone):
    cal = ATSCalibrator.for_backbone(tiny_backbone, head_type="linear", max_scale=2.0)
    expected = torch.tensor([1.0, 2.0, torch.exp(torch.tensor(-1.0))])
    assert torch.equal(cal.scale(torch.tensor([0.0, 5.0, -1.0])), expected)


def test_save_load_round_trip(tiny_backbone, tmp_path):
    cal = _randomize(ATSCalibrator.for_backbone(tiny_backbone, head_type="transformer"))
    cal.save_pretrained(tmp_path / "head")
    config = json.loads((tmp_path / "head" / "calibrator_config.json").read_text())
    assert config["type"] == "ats" and config["base_model"] == tiny_backbone.name
    assert config["hidden_size"] == tiny_backbone.hidden_size and config["vocab_size"] == tiny_backbone.vocab_size
    assert config["head"]["head_type"] == "transformer" and config["library_version"]
    for loaded in (ATSCalibrator.from_pretrained(tmp_path / "head", backbone=tiny_backbone),
                   load_calibrator(tmp_path / "head")):
        ids = torch.randint(0, len(tiny_backbone.tokenizer), (1, 7))
        h, _ = tiny_backbone.forward(ids)
        assert torch.equal(loaded.log_scale(h), cal.log_scale(h))
    q = CalibratedModel(tiny_backbone, loaded)(ids)
    torch.testing.assert_close(q, cal.calibrate(tiny_backbone.logits(h), h))


def test_head_for_another_backbone_is_refused(tiny_backbone, tokenizer, tmp_path):
    from helpers import make_tiny_backbone

    cal = ATSCalibrator.for_backbone(tiny_backbone, head_type="linear")
    cal.save_pretrained(tmp_path / "head")
    wider = make_tiny_backbone(tokenizer, hidden_size=32, name="other")
    with pytest.raises(ATSError, match="hidden size 64"):
        ATSCalibrator.from_pretrained(tmp_path / "head", backbone=wider)
    same_size = make_tiny_backbone(tokenizer, name="other")
    with pytest.raises(ATSError, match="base model 'tiny-llama'"):
        ATSCalibrator.from_pretrained(tmp_path / "head", backbone=same_size)
    reseeded = make_tiny_backbone(tokenizer, seed=5)
    with pytest.raises(ATSError, match="revision"):
        CalibratedModel(reseeded, cal)
    # hidden states of another size given by hand (was a shape error from inside the head)
    with pytest.raises(ATSError, match=r"^hidden: shape \(1, 3, 32\), but this head reads hidden states of size 64 "
                                       r"\(those of tiny-llama\)$"):
        cal.calibrate(torch.randn(1, 3, 10), torch.randn(1, 3, 32))
    with pytest.raises(ATSError, match=r"head/calibrator_config\.json: a file, not a calibrator folder"):
        ATSCalibrator.from_pretrained(tmp_path / "head" / "calibrator_config.json")
    with pytest.raises(ATSError, match=r"^fit: expected a FitSource or a LogitChunks callable .*, got list$"):
        build_calibrator("temperature").fit([torch.randn(4, 10)])  # data, not a source of it


def test_corrupt_or_foreign_files_are_refused(tiny_backbone, tmp_path):
    cal = ATSCalibrator.for_backbone(tiny_backbone, head_type="mlp")
    cal.save_pretrained(tmp_path / "head")
    weights = tmp_path / "head" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    with pytest.raises(ATSError, match="corrupt or truncated"):
        ATSCalibrator.from_pretrained(tmp_path / "head")
    cal.save_pretrained(tmp_path / "head2")
    path = tmp_path / "head2" / "calibrator_config.json"
    config = json.loads(path.read_text())
    config["surprise"] = 1
    path.write_text(json.dumps(config))
    with pytest.raises(ATSError, match="unknown key 'surprise'"):
        ATSCalibrator.from_pretrained(tmp_path / "head2")


def test_a_head_config_without_method_and_training_loads_with_their_defaults(tiny_backbone, tmp_path):
    """`method` and the training record are optional in calibrator_config.json (a head built by hand has neither)."""
    import json

    cal = ATSCalibrator.for_backbone(tiny_backbone, head_type="linear")
    with torch.no_grad():
        cal.head.proj.weight.normal_(0, 0.1, generator=torch.Generator().manual_seed(0))
    cal.save_pretrained(tmp_path / "new")
    config = json.loads((tmp_path / "new" / "calibrator_config.json").read_text())
    old = {k: v for k, v in config.items() if k not in ("method", "training")}
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "calibrator_config.json").write_text(json.dumps(old))
    (tmp_path / "old" / "model.safetensors").write_bytes((tmp_path / "new" / "model.safetensors").read_bytes())
    loaded = ATSCalibrator.from_pretrained(tmp_path / "old", backbone=tiny_backbone)
    assert loaded.label == "ats"
    assert loaded.config_.training == {}
    z, h = torch.randn(2, 3, tiny_backbone.vocab_size), torch.randn(2, 3, tiny_backbone.hidden_size)
    torch.testing.assert_close(loaded.apply(z, h), cal.apply(z, h))
