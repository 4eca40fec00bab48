"""The paper's head: one Llama decoder layer over the hidden states (RoPE attention, SwiGLU), causal, with a
decoding cache and a fused leaner path for cached steps."""

from __future__ import annotations

from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ...errors import ATSError
from .cache import HeadCache
from .common import RMSNorm, init_weights, mask_padding, zero_linear


def _allowed(real: Tensor, past: int) -> Tensor:
    """Attention mask (B, 1, T, T_past+T) bool from the keys' real-token mask `real` (B, T_past+T): query i
    (absolute past+i) sees key j if j <= past+i and key j is real; always itself, so that padding query rows are never
    fully masked (no NaN); real queries never see padding keys."""
    total = real.shape[1]
    q_idx = torch.arange(past, total, device=real.device)[:, None]  # (T, 1)
    k_idx = torch.arange(total, device=real.device)[None, :]  # (1, T_past+T)
    allowed = (k_idx <= q_idx) & real[:, None, :]  # (B, T, T_past+T)
    return (allowed | (k_idx == q_idx))[:, None]  # (B, 1, T, T_past+T)


def _rotate_half(x: Tensor) -> Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention with RoPE (Llama layout: rotate-half, no biases).

    Args:
        hidden_size: H.
        num_heads: attention heads; H / num_heads must be an even integer.
        rope_theta: the RoPE base.
    """

    def __init__(self, hidden_size: int, num_heads: int, rope_theta: float = 10000.0):
        super().__init__()
        self.n_heads = num_heads
        self.head_dim = hidden_size // num_heads
        self.q_proj = nn.Linear(hidden_size, hidden_size, bias=False)
        self.k_proj = nn.Linear(hidden_size, hidden_size, bias=False)
        self.v_proj = nn.Linear(hidden_size, hidden_size, bias=False)
        self.o_proj = nn.Linear(hidden_size, hidden_size, bias=False)
        inv_freq = 1.0 / (rope_theta ** (torch.arange(0, self.head_dim, 2, dtype=torch.float32) / self.head_dim))
        # (d,) each frequency twice, for the rotate-half layout; derived, not saved
        self.register_buffer("inv_freq", torch.cat((inv_freq, inv_freq)), persistent=False)

    def rope(self, x: Tensor, position_ids: Tensor) -> Tensor:
        """Rotate x (B, ..., T, d) by the angles of `position_ids` (B, T), in float32.

        Args:
            x: (B, ..., T, d) queries or keys.
            position_ids: (B, T) positions.

        Returns:
            The rotated `x`, same shape and dtype.
        """
        B, T = position_ids.shape
        angles = position_ids[..., None] * self.inv_freq.float()  # (B, T, d) float32
        angles = angles.view(B, *[1] * (x.dim() - 3), T, x.shape[-1])  # (B, 1.., T, d)
        xf = x if x.dtype == torch.float32 else x.float()
        out = xf * angles.cos() + _rotate_half(xf) * angles.sin()
        return out if out.dtype == x.dtype else out.to(x.dtype)

    def forward(self, x: Tensor, position_ids: Tensor, allowed: Tensor) -> Tensor:
        """Self-attention over the T positions of `x`.

        Args:
            x: (B, T, H) input.
            position_ids: (B, T) RoPE positions.
            allowed: (B, 1, T, T) bool, True where a query may see a key.

        Returns:
            (B, T, H) output.
        """
        B, T, H = x.shape
        q = self.q_proj(x).view(B, T, self.n_heads, self.head_dim).transpose(1, 2)  # (B, nh, T, d)
        k = self.k_proj(x).view(B, T, self.n_heads, self.head_dim).transpose(1, 2)  # (B, nh, T, d)
        v = self.v_proj(x).view(B, T, self.n_heads, self.head_dim).transpose(1, 2)  # (B, nh, T, d)
        q, k = self.rope(q, position_ids), self.rope(k, position_ids)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)  # (B, nh, T, d)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, H))  # (B, T, H)


class SwiGLU(nn.Module):
    """Llama MLP: down(silu(gate(x)) * up(x)).

    Args:
        hidden_size: H.
        intermediate_size: I, the width of gate and up.
    """

    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        """x (..., H) -> (..., H)."""
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class TransformerHead(nn.Module):
    """One Llama decoder layer over the hidden states, then RMSNorm + Linear H -> 1 (the paper's ATS head).

    Without a cache, `hidden` is the whole sequence (training, evaluation). With a `cache` (generation), `hidden`
    holds only the new positions (B, T_new, H) and `attention_mask` covers past + new positions (B, T_past + T_new);
    the cache keeps its own copy of the past, is extended in place, and the step runs a leaner path with the same
    numbers (q/k/v and gate/up fused into one matrix product each, RoPE positions and key mask kept in the cache,
    no mask at all when nothing is padding): 66 instead of 107 operations per decoding step.

    Args:
        hidden_size: H.
        num_heads: attention heads; H / num_heads must be an even integer.
        intermediate_size: I, the SwiGLU width.
        rope_theta: the RoPE base.

    Raises:
        ATSError: if H / num_heads is not an even integer.
    """

    reads_context: ClassVar[bool] = True  # tau at a position attends over the earlier ones (a KV cache)

    def __init__(self, hidden_size: int, num_heads: int, intermediate_size: int, rope_theta: float = 10000.0):
        super().__init__()
        if hidden_size % num_heads != 0 or (hidden_size // num_heads) % 2 != 0:
            raise ATSError(f"num_heads: hidden_size {hidden_size} / num_heads {num_heads} must be an even integer")
        self.input_norm = RMSNorm(hidden_size)
        self.attn = CausalSelfAttention(hidden_size, num_heads, rope_theta)
        self.post_attn_norm = RMSNorm(hidden_size)
        self.mlp = SwiGLU(hidden_size, intermediate_size)
        self.final_norm = RMSNorm(hidden_size)
        self.proj = nn.Linear(hidden_size, 1)
        init_weights(self)
        zero_linear(self.proj)

    @classmethod
    def from_config(cls, config) -> TransformerHead:
        """The head for a `HeadConfig`."""
        return cls(config.hidden_size, config.num_heads, config.intermediate_size, rope_theta=config.rope_theta)

    def forward(self, hidden: Tensor, attention_mask: Tensor | None = None, cache: HeadCache | None = None) -> Tensor:
        """tau (B, T) float32, 0 on padding (the module docstring gives the signature; with a cache, T is T_new).

        Raises:
            ATSError: if `attention_mask` is not (B, T_past + T).
        """
        B, T, _ = hidden.shape
        past = cache.length if cache is not None else 0
        if attention_mask is not None and tuple(attention_mask.shape) != (B, past + T):
            raise ATSError(f"attention_mask: expected shape {(B, past + T)} (past {past} + new {T}), "
                           f"got {tuple(attention_mask.shape)}")
        if cache is not None:
            return self._forward_cached(hidden, None if attention_mask is None else attention_mask[:, past:], cache)
        if attention_mask is None:
            mask = torch.ones(B, T, dtype=torch.bool, device=hidden.device)
        else:
            mask = attention_mask.to(hidden.device).bool()  # (B, T)
        position_ids = (mask.long().cumsum(-1) - 1).clamp(min=0)  # (B, T)
        x = hidden.to(self.proj.weight.dtype)  # (B, T, H)
        x = x + self.attn(self.input_norm(x), position_ids, _allowed(mask, 0))
        x = x + self.mlp(self.post_attn_norm(x))
        return mask_padding(self.proj(self.final_norm(x)), mask)  # (B, T)

    def forward_at(self, hidden: Tensor, attention_mask: Tensor | None, index: Tensor) -> Tensor:
        """tau (B, K) at positions `index` (B, K) only, equal to `forward(hidden, attention_mask)` gathered there.

        Keys and values are projected at every position (the queries attend to them); the queries, the attention
        output, the MLP and the projection run at the K positions only: answer-level training scores a few
        positions of long prompts (5-shot MMLU: 1 of ~700), so this costs a fraction of the full layer.

        Args:
            hidden: (B, T, H) hidden states of whole right-padded sequences.
            attention_mask: (B, T), 1 on real tokens; None: all real.
            index: (B, K) long positions (real tokens).

        Returns:
            tau (B, K) float32.
        """
        B, T, H = hidden.shape
        mask = (torch.ones(B, T, dtype=torch.bool, device=hidden.device) if attention_mask is None
                else attention_mask.to(hidden.device).bool())  # (B, T)
        index = index.to(hidden.device)
        position_ids = (mask.long().cumsum(-1) - 1).clamp(min=0)  # (B, T)
        x = hidden.to(self.proj.weight.dtype)  # (B, T, H)
        xn = self.input_norm(x)
        attn, nh, d = self.attn, self.attn.n_heads, self.attn.head_dim
        K = index.shape[1]
        at = index[..., None].expand(-1, -1, H)  # (B, K, H)
        q = attn.q_proj(xn.gather(1, at)).view(B, K, nh, d).transpose(1, 2)  # (B, nh, K, d)
        k = attn.k_proj(xn).view(B, T, nh, d).transpose(1, 2)  # (B, nh, T, d)
        v = attn.v_proj(xn).view(B, T, nh, d).transpose(1, 2)  # (B, nh, T, d)
        q, k = attn.rope(q, position_ids.gather(1, index)), attn.rope(k, position_ids)
        keys = torch.arange(T, device=hidden.device)[None, None, :]  # (1, 1, T)
        allowed = ((keys <= index[..., None]) & mask[:, None, :]) | (keys == index[..., None])  # (B, K, T)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed[:, None])  # (B, nh, K, d)
        x = x.gather(1, at) + attn.o_proj(y.transpose(1, 2).reshape(B, K, H))  # (B, K, H)
        x = x + self.mlp(self.post_attn_norm(x))
        return self.proj(self.final_norm(x)).squeeze(-1).float()  # (B, K)

    @torch.no_grad()
    def _forward_cached(self, hidden: Tensor, real: Tensor | None, cache: HeadCache) -> Tensor:
        """The same layer as `forward` for new positions `hidden` (B, T, H) with real-token mask `real` (B, T)
        (None: all real), attending over the cache. Inference only (no gradients). Every operation counts here:
        a decoding step of a small head is bound by per-operation overhead, not arithmetic."""
        B, T, H = hidden.shape
        attn, nh, d = self.attn, self.attn.n_heads, self.attn.head_dim
        if cache.weights is None:
            cache.weights = (torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]),  # (3H, H)
                             torch.cat([self.mlp.gate_proj.weight, self.mlp.up_proj.weight]))  # (2I, H)
        if cache.positions is None:
            cache.positions = torch.zeros(B, dtype=torch.long, device=hidden.device)
        if real is None:
            real = torch.ones(B, T, dtype=torch.bool, device=hidden.device)
            all_real = True
        else:
            real = real.to(hidden.device, torch.bool)
            all_real = bool(real.all())
        past = cache.positions[:, None]  # (B, 1) real tokens seen so far
        if all_real and T == 1:  # a decoding step: the next position of every row
            position_ids, cache.positions = past, cache.positions + 1  # (B, 1)
        else:  # as cumsum(mask) - 1 over the whole sequence
            counted = real.long().cumsum(-1)  # (B, T)
            position_ids, cache.positions = (past + counted - 1).clamp(min=0), past[:, 0] + counted[:, -1]

        x = hidden if hidden.dtype == self.proj.weight.dtype else hidden.to(self.proj.weight.dtype)  # (B, T, H)
        qkv = F.linear(self.input_norm(x), cache.weights[0]).view(B, T, 3, nh, d)
        q, k = attn.rope(qkv[:, :, :2].permute(0, 2, 3, 1, 4), position_ids).unbind(1)  # 2 x (B, nh, T, d)
        start = cache.length
        keys, values, seen = cache.update(k, qkv[:, :, 2].transpose(1, 2), real, all_real)  # (B, nh, S, d), (B, S)
        causal = False
        if T == 1:  # one query and no future keys: only padding keys need masking
            allowed = None if not cache.has_padding else seen[:, None, None] if all_real else _allowed(seen, start)
        elif start == 0 and not cache.has_padding:  # a prompt without padding: plain causal attention
            allowed, causal = None, True
        else:
            allowed = _allowed(seen, start)  # (B, 1, T, S)
        y = F.scaled_dot_product_attention(q, keys, values, attn_mask=allowed, is_causal=causal)  # (B, nh, T, d)
        x = x + attn.o_proj(y.transpose(1, 2).reshape(B, T, H))
        gate, up = F.linear(self.post_attn_norm(x), cache.weights[1]).chunk(2, dim=-1)  # 2 x (B, T, I)
        x = x + self.mlp.down_proj(F.silu(gate) * up)
        tau = self.proj(self.final_norm(x))  # (B, T, 1)
        return tau.squeeze(-1).float() if all_real else mask_padding(tau, real)  # (B, T)
