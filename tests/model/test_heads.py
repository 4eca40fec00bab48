"""Calibration heads: identity at init, causality, padding, KV cache, config, and that training lowers the loss."""

from __future__ import annotations

import json

import pytest
import torch

from ats.errors import ATSError
from ats.model.heads import (
    HeadCache,
    HeadConfig,
    LinearHead,
    MLPHead,
    TransformerHead,
    build_head,
    default_intermediate_size,
    default_num_heads,
)
from ats.training.losses import calibration_loss

H = 32


def make_heads() -> dict[str, torch.nn.Module]:
    torch.manual_seed(0)
    return {
        "linear": LinearHead(H),
        "mlp": MLPHead(H, mlp_hidden=16),
        "transformer": TransformerHead(H, num_heads=4, intermediate_size=48),
    }


def randomised(head: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """A head away from its identity init (tau == 0 everywhere would make every comparison trivial)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in head.parameters():
            p.copy_(p + 0.3 * torch.randn(p.shape, generator=g))
    return head


def transformer(seed: int = 0) -> TransformerHead:
    torch.manual_seed(seed)
    return randomised(TransformerHead(H, num_heads=4, intermediate_size=48, rope_theta=100.0), seed).eval()


@pytest.mark.parametrize("name", ["linear", "mlp", "transformer"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_identity_at_init(name, dtype):
    head = make_heads()[name]
    hidden = (5 * torch.randn(2, 7, H)).to(dtype)
    mask = torch.tensor([[1] * 7, [0, 0, 1, 1, 1, 1, 1]])
    for m in (None, mask):
        tau = head(hidden, m)
        assert tau.shape == (2, 7) and tau.dtype == torch.float32
        assert torch.equal(tau, torch.zeros(2, 7))
    assert torch.equal(head.proj.weight, torch.zeros_like(head.proj.weight))


def test_transformer_head_is_causal():
    head = transformer()
    hidden = torch.randn(2, 9, H)
    tau = head(hidden)
    assert tau.abs().min() > 0  # not trivially zero
    for t in range(9):
        changed = hidden.clone()
        changed[:, t + 1:] = torch.randn_like(changed[:, t + 1:])
        tau2 = head(changed)
        torch.testing.assert_close(tau2[:, : t + 1], tau[:, : t + 1], rtol=0, atol=1e-6)
        if t < 8:
            assert not torch.allclose(tau2[:, t + 1:], tau[:, t + 1:])


def test_right_padding_does_not_affect_real_positions():
    head = transformer(1)
    hidden = torch.randn(2, 8, H)
    mask = torch.tensor([[1] * 8, [1] * 5 + [0] * 3])
    tau = head(hidden, mask)
    changed = hidden.clone()
    changed[1, 5:] = 100 * torch.randn(3, H)  # garbage in the padding
    tau2 = head(changed, mask)
    torch.testing.assert_close(tau2, tau, rtol=0, atol=1e-6)
    assert torch.equal(tau[1, 5:], torch.zeros(3))  # padding gets tau == 0
    # the padded row equals the same sequence alone
    alone = head(hidden[1:2, :5])
    torch.testing.assert_close(tau[1, :5], alone[0], rtol=1e-5, atol=1e-6)


def test_left_padding_uses_mask_positions_and_makes_no_nan():
    head = transformer(2)
    seq = torch.randn(1, 5, H)
    hidden = torch.cat([100 * torch.randn(1, 3, H), seq], dim=1)  # 3 left pads, then the sequence
    mask = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1]])
    tau = head(hidden, mask)
    assert torch.isfinite(tau).all()
    assert torch.equal(tau[0, :3], torch.zeros(3))
    torch.testing.assert_close(tau[:, 3:], head(seq), rtol=1e-5, atol=1e-6)
    # an all-padding row is finite too
    tau_empty = head(hidden, torch.zeros(1, 8, dtype=torch.long))
    assert torch.equal(tau_empty, torch.zeros(1, 8))


@pytest.mark.parametrize("prefix", [1, 4])
def test_cached_decoding_equals_full_forward_with_left_padding(prefix):
    head = transformer(3)
    T = 9
    hidden = torch.randn(2, T, H)
    mask = torch.ones(2, T, dtype=torch.long)
    mask[1, :3] = 0  # second row left-padded by 3
    with torch.no_grad():
        full = head(hidden, mask)
        cache = HeadCache()
        steps = [head(hidden[:, :prefix], mask[:, :prefix], cache=cache)]
        assert cache.length == prefix and cache.keys.shape == (2, 4, prefix, H // 4)
        for t in range(prefix, T):
            steps.append(head(hidden[:, t: t + 1], mask[:, : t + 1], cache=cache))
        assert cache.length == T
    cached = torch.cat(steps, dim=1)
    assert cached.shape == (2, T)
    torch.testing.assert_close(cached, full, rtol=0, atol=1e-5)
    assert full[1, 3:].abs().min() > 0


@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("chunks", [(4, 3, 1, 1, 2), (1, 2, 3, 5), (11,)])
def test_cached_chunks_equal_full_forward(padded, chunks):
    """Any split of a sequence into cached calls (a prompt, then several positions at a time or one) gives the
    full forward pass's tau: causality inside a chunk, RoPE positions and padding keys carried by the cache."""
    head = transformer(7)
    T = sum(chunks)
    hidden = torch.randn(3, T, H)
    mask = torch.ones(3, T, dtype=torch.long)
    if padded:
        mask[1, :2] = 0  # left padding
        mask[2, 6:] = 0  # right padding (padding queries get tau 0 and are never seen)
    with torch.no_grad():
        full = head(hidden, mask)
        cache, steps, start = HeadCache(), [], 0
        for n in chunks:
            steps.append(head(hidden[:, start: start + n], mask[:, : start + n], cache=cache))
            start += n
    assert cache.has_padding == padded
    assert torch.equal(cache.positions, mask.sum(1))  # real tokens seen per row = RoPE position of the next
    torch.testing.assert_close(torch.cat(steps, 1), full, rtol=0, atol=1e-5)
    assert torch.equal(full[mask == 0], torch.zeros(int((mask == 0).sum())))


def test_cache_rows_padded_joined_and_trimmed_decode_as_alone():
    """A server joins sequences of different lengths into one cache (pad_left + concat), drops finished rows
    (select) and padding columns (trim_left): each row's next tau equals decoding it alone."""
    head = transformer(5)
    a, b = torch.randn(1, 7, H), torch.randn(1, 3, H)
    step = torch.randn(2, 1, H)
    with torch.no_grad():
        alone = [head(torch.cat([x, s[None]], 1))[:, -1] for x, s in ((a, step[0]), (b, step[1]))]
        ca, cb = HeadCache(), HeadCache()
        head(a, cache=ca)
        head(b, cache=cb)
        cb.pad_left(4)
        joined = HeadCache.concat([ca, cb])
        mask = torch.tensor([[1] * 8, [0] * 4 + [1] * 4])
        assert joined.length == 7 and joined.has_padding and torch.equal(joined.positions, torch.tensor([7, 3]))
        tau = head(step, mask, cache=joined)[:, -1]
        torch.testing.assert_close(tau, torch.cat(alone), rtol=0, atol=1e-5)
        joined.select(torch.tensor([1]))  # the long row finished: columns 0-3 are padding in every row left
        with pytest.raises(ATSError, match="not all padding"):
            joined.trim_left(5)
        joined.trim_left(4)
        assert joined.length == 4 and not joined.has_padding
        nxt = torch.randn(1, 1, H)
        expected = head(torch.cat([b, step[1:2], nxt], 1))[:, -1]
        torch.testing.assert_close(head(nxt, cache=joined)[:, -1], expected, rtol=0, atol=1e-5)
    with pytest.raises(ATSError, match="different lengths"):
        HeadCache.concat([ca, HeadCache()])


def test_cache_mask_shape_is_checked_and_other_heads_accept_cache():
    head = transformer()
    cache = HeadCache()
    head(torch.randn(1, 3, H), cache=cache)
    with pytest.raises(ATSError, match="attention_mask"):
        head(torch.randn(1, 1, H), torch.ones(1, 1), cache=cache)  # must cover past + new = 4
    for name in ("linear", "mlp"):
        h = randomised(make_heads()[name])
        x = torch.randn(2, 4, H)
        c = HeadCache()
        torch.testing.assert_close(h(x[:, 3:], torch.ones(2, 4), cache=c), h(x)[:, 3:])


def test_head_config_defaults_round_trip_and_errors():
    cfg = HeadConfig(head_type="transformer", hidden_size=576)
    assert cfg.num_heads == 9 and cfg.intermediate_size == 1536 and cfg.mlp_hidden == 576  # SmolLM2's own sizes
    assert default_num_heads(4096) == 64 and default_intermediate_size(4096) == 11008  # Llama-2-7B's
    # not a multiple of 64: the divisor whose even head dim is closest to 64 (96 -> 2 heads of 48)
    assert default_num_heads(32) == 1 and default_num_heads(96) == 2 and default_num_heads(192) == 3
    d = json.loads(json.dumps(cfg.to_dict()))
    assert HeadConfig.from_dict(d) == cfg
    head = build_head(HeadConfig.from_dict(d))
    assert isinstance(head, TransformerHead) and head.attn.n_heads == 9
    assert isinstance(build_head(HeadConfig("linear", 64)), LinearHead)
    mlp = build_head(HeadConfig("mlp", 64, mlp_hidden=10))
    assert isinstance(mlp, MLPHead) and mlp.fc.out_features == 10
    # the saved state is plain tensors; rope frequencies are derived, not saved
    assert not any("inv_freq" in k for k in head.state_dict())

    with pytest.raises(ATSError, match="'num_layers'"):
        HeadConfig.from_dict({**d, "num_layers": 2})
    with pytest.raises(ATSError, match="'conv'"):
        HeadConfig(head_type="conv", hidden_size=64)
    with pytest.raises(ATSError, match="100.*3|3.*100"):
        HeadConfig(head_type="transformer", hidden_size=100, num_heads=3)
    with pytest.raises(ATSError, match="hidden_size.*-4"):
        HeadConfig(head_type="linear", hidden_size=-4)
    with pytest.raises(ATSError, match="even"):
        HeadConfig(head_type="transformer", hidden_size=36, num_heads=4)  # head dim 9


@pytest.mark.parametrize("name", ["linear", "mlp", "transformer"])
def test_training_steps_lower_selective_loss(name):
    torch.manual_seed(0)
    V, B, T = 50, 4, 12
    W = 2 * torch.randn(V, H) / H**0.5  # output layer
    hidden = torch.randn(B, T, H)
    z = hidden @ W.T
    wrong = torch.rand(B, T) < 0.5
    labels = torch.where(wrong, torch.randint(0, V, (B, T)), z.argmax(-1))  # right about half the time
    mask = torch.ones(B, T, dtype=torch.long)
    mask[0, 9:] = 0  # right padding
    keep = mask.bool()

    head = make_heads()[name]
    opt = torch.optim.Adam(head.parameters(), lr=1e-2)

    def loss_fn():
        tau = head(hidden, mask)  # (B, T)
        scale = tau.exp().clamp(max=10.0)[keep]  # (N,)
        return calibration_loss(hidden[keep], scale, labels[keep], lambda h: h @ W.T, chunk_size=7).loss

    initial = loss_fn().item()
    for _ in range(15):
        opt.zero_grad()
        loss = loss_fn()
        loss.backward()
        opt.step()
    final = loss_fn().item()
    assert final < initial - 1e-3, (initial, final)


def test_transformer_head_matches_transformers_llama_decoder_layer():
    """Independent check of the hand-written layer: the same weights in transformers' LlamaDecoderLayer give the
    same tau."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    head = transformer(4)
    config = LlamaConfig(hidden_size=H, intermediate_size=48, num_attention_heads=4, num_key_value_heads=4,
                         rope_theta=100.0, rms_norm_eps=1e-6)
    config._attn_implementation = "eager"
    layer = LlamaDecoderLayer(config, layer_idx=0).eval()
    a, m = head.attn, head.mlp
    weights = {
        "input_layernorm.weight": head.input_norm.weight, "post_attention_layernorm.weight": head.post_attn_norm.weight,
        "self_attn.q_proj.weight": a.q_proj.weight, "self_attn.k_proj.weight": a.k_proj.weight,
        "self_attn.v_proj.weight": a.v_proj.weight, "self_attn.o_proj.weight": a.o_proj.weight,
        "mlp.gate_proj.weight": m.gate_proj.weight, "mlp.up_proj.weight": m.up_proj.weight,
        "mlp.down_proj.weight": m.down_proj.weight,
    }
    layer.load_state_dict(weights, strict=True)
    x = torch.randn(2, 7, H)
    pos = torch.arange(7)[None].expand(2, 7)
    cos, sin = LlamaRotaryEmbedding(config)(x, pos)
    causal = torch.full((7, 7), float("-inf")).triu(1)[None, None].expand(2, 1, 7, 7)
    with torch.no_grad():
        out = layer(x, attention_mask=causal, position_ids=pos, position_embeddings=(cos, sin))
        out = out[0] if isinstance(out, tuple) else out
        expected = head.proj(head.final_norm(out)).squeeze(-1)
        torch.testing.assert_close(head(x), expected, rtol=1e-5, atol=1e-5)


def test_bfloat16_head_with_cache():
    head = transformer(5).to(torch.bfloat16)
    hidden = torch.randn(1, 6, H, dtype=torch.float16)  # any input dtype is cast to the head's
    with torch.no_grad():
        full = head(hidden)
        cache = HeadCache()
        steps = [head(hidden[:, :3], cache=cache)] + [head(hidden[:, t: t + 1], cache=cache) for t in range(3, 6)]
    assert full.dtype == torch.float32 and cache.keys.dtype == torch.bfloat16
    torch.testing.assert_close(torch.cat(steps, 1), full, rtol=0.05, atol=0.05)
