"""The paper's released heads: a head written in the official layout loads with `load_calibrator` and gives the tau
of an independent re-implementation of the official forward pass (RMSNorm, rotary, GQA attention, SiLU MLP, linear
head without a final norm, exp(.).clip(max=10))."""

import json
import math
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import save_file

from ats.calibrators import load_calibrator
from ats.calibrators.ats import ATSCalibrator
from ats.calibrators.official import OfficialATSCalibrator
from ats.cli.main import main
from ats.errors import ATSError

H, HEADS, KV_HEADS, INTER = 32, 4, 2, 48


def official_config(**changes) -> dict:
    """config.json as the official CalibrationConfig writes it (asdict, sorted keys)."""
    config = {"attention_dropout": 0.0, "base_model_name_or_path": "tiny/llama", "calibration_type": "transformer",
              "feature_key": "hidden_states", "freeze_base_model": True, "hidden_act": "silu", "in_features": H,
              "inference_mode": False, "init_temperature": 1.0, "intermediate_size": INTER,
              "label_smoothing": 0.0, "label_smoothing_type": "topk", "layer_idx": 33, "log_auxiliary_info": False,
              "loss_type": "selective_smoothing", "max_position_embeddings": 4096, "normalize_logits": False,
              "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS, "smooth_loss_weight": 0.5,
              "smoothing_topk": 5, "task_type": "CAUSAL_LM"}
    return {**config, **changes}


def official_state(seed: int = 0, kv_heads: int = KV_HEADS) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    d = H // HEADS

    def rand(*shape, scale=0.2):
        return torch.randn(*shape, generator=g) * scale

    attn = "transformer.self_attn."
    return {attn + "q_proj.weight": rand(H, H), attn + "k_proj.weight": rand(kv_heads * d, H),
            attn + "v_proj.weight": rand(kv_heads * d, H), attn + "o_proj.weight": rand(H, H),
            "transformer.mlp.gate_proj.weight": rand(INTER, H), "transformer.mlp.up_proj.weight": rand(INTER, H),
            "transformer.mlp.down_proj.weight": rand(H, INTER),
            "transformer.input_layernorm.weight": 1 + rand(H, scale=0.1),
            "transformer.post_attention_layernorm.weight": 1 + rand(H, scale=0.1),
            "linear_head.weight": rand(1, H, scale=0.3), "linear_head.bias": torch.tensor([0.4])}


def write_official(folder, state=None, config=None):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config or official_config(), indent=2, sort_keys=True))
    save_file(state or official_state(), str(folder / "calibration_head.safetensors"), metadata={"format": "pt"})
    return folder


# --- the official forward, re-implemented from its definition in plain torch (float64) -----------------------------
def rms_norm(x, weight, eps=1e-6):
    return weight * (x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def rotary(x, positions, base=10000.0):
    """x (B, n, T, d), positions (T,): the rotate-half RoPE of the Llama code."""
    d = x.shape[-1]
    inv_freq = 1.0 / base ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    angles = positions[:, None].double() * inv_freq[None]  # (T, d/2)
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return x * cos + torch.cat([-x2, x1], -1) * sin


def official_tau(state, h, mask):
    """head(h) of the official TransformerHead: DecoderLayer (no final norm) + linear_head; h (B, T, H), mask (B, T)
    right-padded. Positions are 0..T-1 (the official code passes no position ids)."""
    s = {k: v.double() for k, v in state.items()}
    x = h.double()
    B, T, _ = x.shape
    d, rep = H // HEADS, HEADS // KV_HEADS
    a = rms_norm(x, s["transformer.input_layernorm.weight"])
    q = (a @ s["transformer.self_attn.q_proj.weight"].T).view(B, T, HEADS, d).transpose(1, 2)
    k = (a @ s["transformer.self_attn.k_proj.weight"].T).view(B, T, KV_HEADS, d).transpose(1, 2)
    v = (a @ s["transformer.self_attn.v_proj.weight"].T).view(B, T, KV_HEADS, d).transpose(1, 2)
    pos = torch.arange(T)
    q, k = rotary(q, pos), rotary(k, pos)
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)  # repeat_kv
    scores = q @ k.transpose(-1, -2) / math.sqrt(d)  # (B, n, T, T)
    allowed = torch.ones(T, T).tril().bool()[None, None] & mask.bool()[:, None, None, :]
    scores = scores.masked_fill(~allowed, torch.finfo(torch.float64).min)
    attn = torch.softmax(scores, -1) @ v
    x = x + attn.transpose(1, 2).reshape(B, T, H) @ s["transformer.self_attn.o_proj.weight"].T
    m = rms_norm(x, s["transformer.post_attention_layernorm.weight"])
    gate, up = m @ s["transformer.mlp.gate_proj.weight"].T, m @ s["transformer.mlp.up_proj.weight"].T
    x = x + (torch.nn.functional.silu(gate) * up) @ s["transformer.mlp.down_proj.weight"].T
    return (x @ s["linear_head.weight"].T + s["linear_head.bias"]).squeeze(-1)  # (B, T)


def inputs(seed=1):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(2, 7, H, generator=g) * 2
    mask = torch.ones(2, 7, dtype=torch.long)
    mask[1, 5:] = 0  # right padding
    z = torch.randn(2, 7, 11, generator=g) * 3
    return h, mask, z


def test_official_head_matches_the_independent_forward(tmp_path):
    state = official_state()
    calibrator = load_calibrator(write_official(tmp_path / "head", state))
    assert isinstance(calibrator, OfficialATSCalibrator) and calibrator.config_.max_scale == 10.0
    h, mask, z = inputs()
    expected_tau = official_tau(state, h, mask)
    tau = calibrator.log_scale(h, mask)
    real = mask.bool()
    torch.testing.assert_close(tau[real].double(), expected_tau[real], atol=1e-5, rtol=1e-5)
    expected_q = z.double() * torch.exp(expected_tau).clip(max=10)[..., None]
    q = calibrator.apply(z, h, attention_mask=mask)
    torch.testing.assert_close(q[real].double(), expected_q[real], atol=1e-4, rtol=1e-5)


def test_the_clip_at_10_applies_to_the_scale(tmp_path):
    state = official_state()
    state["linear_head.bias"] = torch.tensor([5.0])  # exp(tau) far above 10 on most tokens
    calibrator = load_calibrator(write_official(tmp_path / "head", state))
    h, mask, z = inputs()
    expected_tau = official_tau(state, h, mask)
    assert (expected_tau[mask.bool()] > math.log(10)).any()
    q = calibrator.apply(z, h, attention_mask=mask)
    expected_q = z.double() * torch.exp(expected_tau).clip(max=10)[..., None]
    torch.testing.assert_close(q[mask.bool()].double(), expected_q[mask.bool()], atol=1e-4, rtol=1e-5)


def test_converted_head_gives_the_same_tau(tmp_path, capsys):
    state = official_state(seed=3)
    src = write_official(tmp_path / "official", state)
    out = tmp_path / "ours"
    assert main(["-q", "convert", str(src), str(out)]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["calibrator_config.json", "model.safetensors"]
    saved = json.loads((out / "calibrator_config.json").read_text())
    assert saved["type"] == "ats-official" and saved["base_model"] == "tiny/llama" and saved["max_scale"] == 10.0
    converted = load_calibrator(out)
    assert isinstance(converted, OfficialATSCalibrator)
    for loaded in (ATSCalibrator.from_pretrained(out), ATSCalibrator.from_pretrained(src)):  # peft-style loading
        assert isinstance(loaded, OfficialATSCalibrator) and loaded.digest() == converted.digest()
    h, mask, _ = inputs(seed=5)
    torch.testing.assert_close(converted.log_scale(h, mask), load_calibrator(src).log_scale(h, mask))
    torch.testing.assert_close(converted.log_scale(h, mask)[mask.bool()].double(),
                               official_tau(state, h, mask)[mask.bool()], atol=1e-5, rtol=1e-5)
    assert main(["-q", "convert", str(src), str(out)]) == 2  # exists: refused without --overwrite
    assert "already exists" in capsys.readouterr().err


def test_hidden_size_mismatch_names_both_numbers(tmp_path):
    folder = write_official(tmp_path / "head")
    backbone = SimpleNamespace(name="tiny", hidden_size=64, vocab_size=11, revision="x")
    with pytest.raises(ATSError, match=r"hidden size \(in_features\) 32, backbone tiny has hidden size 64"):
        load_calibrator(folder, backbone=backbone)
    (folder / "calibration_head.safetensors").write_bytes(b"not read")  # refused before the weights are read
    with pytest.raises(ATSError, match=r"hidden size \(in_features\) 32, backbone tiny has hidden size 64"):
        load_calibrator(folder, backbone=backbone)
    folder = write_official(tmp_path / "head2")
    ok = SimpleNamespace(name="other/name", hidden_size=H, vocab_size=5, revision="y")
    assert load_calibrator(folder, backbone=ok).config_.hidden_size == H


def test_pickle_weights_are_refused_with_the_way_to_convert(tmp_path):
    folder = tmp_path / "head"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(official_config()))
    (folder / "calibration_head.bin").write_bytes(b"\x80\x04not unpickled")
    with pytest.raises(ATSError, match=r"calibration_head.bin: a pickle file, which ats never loads; convert"):
        load_calibrator(folder)


@pytest.mark.parametrize("change, message", [
    ({"calibration_type": "mlp"}, "calibration_type 'mlp' is not supported"),
    ({"feature_key": "hidden_states+maxlogit"}, "feature_key 'hidden_states+maxlogit' is not supported"),
    ({"normalize_logits": True}, "normalize_logits true is not supported"),
    ({"num_key_value_heads": 3}, "num_attention_heads 4 is not a multiple of num_key_value_heads 3"),
    ({"in_features": "32"}, "field 'in_features' must be a positive integer, got '32'"),
    ({"num_attention_heads": 5}, "in_features 32 / num_attention_heads 5 must be an even integer"),
])
def test_unsupported_configs_give_one_line(tmp_path, change, message):
    folder = write_official(tmp_path / "head", config=official_config(**change))
    with pytest.raises(ATSError, match=message.replace("(", r"\(").replace("+", r"\+")) as err:
        load_calibrator(folder)
    assert "\n" not in str(err.value) and "config.json" in str(err.value)


def test_wrong_tensors_are_named(tmp_path):
    state = official_state()
    del state["linear_head.bias"]
    with pytest.raises(ATSError, match="missing tensor 'linear_head.bias'"):
        load_calibrator(write_official(tmp_path / "a", state))
    state = official_state()
    state["transformer.mlp.up_proj.weight"] = torch.zeros(INTER + 1, H)
    with pytest.raises(ATSError, match=r"'transformer.mlp.up_proj.weight' has shape \(49, 32\), the config gives "
                                       r"\(48, 32\)"):
        load_calibrator(write_official(tmp_path / "b", state))
