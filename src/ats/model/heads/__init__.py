"""Calibration heads: map the backbone's final hidden states h (B, T, H) to a per-token log-scale tau (B, T)
(tau = log s = -log T, docs/method.md).

The calibrated logits are `q = z * exp(tau)` (clamped by the caller), so every head ends in a zero-initialised H -> 1
projection: tau == 0 exactly at step 0 and the calibrated model starts as the original model.

Four heads share one signature, `head(hidden, attention_mask=None, cache=None) -> tau (B, T) float32`, where
`hidden` is (B, T, H), `attention_mask` (B, T) is 1 on real tokens (with a cache: (B, T_past + T), covering the
cached positions too) and `cache` is a `HeadCache` (read by the transformer head only; the others ignore it).
Each class says what tau reads (`reads_context`: False when tau at a position reads only that position's hidden
state, True when it attends over the earlier ones), which decides how an engine runs it (vLLM: per token, or as
a layer in its paged KV cache):

- `ConstantHead`: one learned scalar, the same tau for every token (a global temperature trained with ATS's loss:
  the control that shows what per-token adaptivity adds).
- `LinearHead`: H -> 1.
- `MLPHead`: H -> mlp_hidden -> 1 with GELU.
- `TransformerHead`: one Llama-style decoder layer at the backbone's hidden size (RMSNorm, causal self-attention with
  RoPE, SwiGLU MLP), then RMSNorm + Linear H -> 1. This is the head of the paper. It is causal (tau at position t
  reads h_0..h_t only) and has a KV cache (`HeadCache`) so calibrated generation costs one position per step.

Padding: positions where `attention_mask == 0` get tau == 0 and are never attended to. Right padding (training) and
left padding (generation) both work: RoPE positions come from the mask, `cumsum(mask) - 1`, so a left-padded sequence
gets the same tau as the same sequence unpadded.

Names are imported on first use (`ats.lazy`): `config` and `registry` load without torch.
"""

from ...lazy import lazy_exports

_EXPORTS = {"HeadCache": ".cache", "RMSNorm": ".common", "HEAD_TYPES": ".config", "HeadConfig": ".config",
            "MAX_SCALE": ".config",
            "default_intermediate_size": ".config", "default_num_heads": ".config", "HEADS": ".registry",
            "build_head": ".registry", "head_class": ".registry", "register_head": ".registry", "tau_at": ".registry",
            "ConstantHead": ".simple", "LinearHead": ".simple", "MLPHead": ".simple",
            "CausalSelfAttention": ".transformer", "SwiGLU": ".transformer", "TransformerHead": ".transformer"}

__all__ = sorted(_EXPORTS)
__getattr__ = lazy_exports(__name__, _EXPORTS)
