"""Calibration heads: map the backbone's final hidden states h (B, T, H) to a per-token log-temperature tau (B, T).

The calibrated logits are `q = z * exp(tau)` (clamped by the caller), so every head ends in a zero-initialised H -> 1
projection: tau == 0 exactly at step 0 and the calibrated model starts as the original model.

Four heads share one signature, `head(hidden, attention_mask=None, cache=None) -> tau (B, T) float32`, where
`hidden` is (B, T, H), `attention_mask` (B, T) is 1 on real tokens (with a cache: (B, T_past + T), covering the
cached positions too) and `cache` is a `HeadCache` (read by the transformer head only; the others ignore it):

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
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..config import ConfigMixin, option
from ..errors import ATSError
from .buffer import GrowingBuffer

HEAD_TYPES = ("constant", "linear", "mlp", "transformer")


# --------------------------------------------------------------------------------------------------------------------
# config


def default_num_heads(hidden_size: int) -> int:
    """Head dim 64 when H is a multiple of 64 (576 -> 9 heads); otherwise the divisor of H whose (even) head dim is
    closest to 64 (32 -> 1 head of 32).

    Args:
        hidden_size: H.

    Returns:
        The number of attention heads (1 when H is odd: `HeadConfig` then refuses it).
    """
    if hidden_size % 64 == 0:
        return hidden_size // 64
    candidates = [n for n in range(1, hidden_size + 1) if hidden_size % n == 0 and (hidden_size // n) % 2 == 0]
    if not candidates:
        return 1  # odd hidden size: rejected by HeadConfig with a clear message (RoPE needs an even head dim)
    return min(candidates, key=lambda n: (abs(hidden_size // n - 64), n))


def default_intermediate_size(hidden_size: int, multiple_of: int = 256) -> int:
    """Llama's SwiGLU width: 8/3 * H rounded up to a multiple of 256 (576 -> 1536 as in SmolLM2, 4096 -> 11008).

    Args:
        hidden_size: H.
        multiple_of: the width is rounded up to a multiple of this.

    Returns:
        The intermediate size.
    """
    width = int(8 * hidden_size / 3)
    return multiple_of * math.ceil(width / multiple_of)


@dataclass
class HeadConfig(ConfigMixin):
    """Which head to build and its sizes. Sizes left as None are filled from `hidden_size` (see the defaults above)."""

    head_type: str = option("transformer", "calibration head: constant (one global temperature, the control), "
                            "linear, mlp, or transformer (one decoder layer, the paper's)", choices=HEAD_TYPES,
                            flag="--head")
    hidden_size: int = option(576, "backbone hidden size", cli=False, low=1)
    mlp_hidden: int | None = option(None, "MLP head width (default: hidden size)", cli=False, low=1)
    num_heads: int | None = option(None, "transformer head: attention heads (default: head dim 64)", cli=False, low=1)
    intermediate_size: int | None = option(None, "transformer head: SwiGLU width (default: Llama's 8/3 H)",
                                           cli=False, low=1)
    rope_theta: float = option(10000.0, "transformer head: RoPE base", cli=False, low=0, low_open=True)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.mlp_hidden is None:
            self.mlp_hidden = self.hidden_size
        if self.num_heads is None:
            self.num_heads = default_num_heads(self.hidden_size)
        if self.intermediate_size is None:
            self.intermediate_size = default_intermediate_size(self.hidden_size)
        if self.head_type == "transformer":
            if self.hidden_size % self.num_heads != 0:
                raise ATSError(f"num_heads: hidden_size {self.hidden_size} is not divisible by num_heads "
                               f"{self.num_heads}")
            if (self.hidden_size // self.num_heads) % 2 != 0:
                raise ATSError(f"num_heads: head dim {self.hidden_size // self.num_heads} "
                               f"(hidden_size {self.hidden_size} / num_heads {self.num_heads}) must be even for RoPE")


def build_head(config: HeadConfig) -> nn.Module:
    """The head described by `config`, at identity (tau == 0).

    Args:
        config: the head type and sizes (defaults already filled in).

    Returns:
        A `ConstantHead`, `LinearHead`, `MLPHead` or `TransformerHead`.
    """
    if config.head_type == "constant":
        return ConstantHead(config.hidden_size)
    if config.head_type == "linear":
        return LinearHead(config.hidden_size)
    if config.head_type == "mlp":
        return MLPHead(config.hidden_size, mlp_hidden=config.mlp_hidden)
    return TransformerHead(config.hidden_size, config.num_heads, config.intermediate_size,
                           rope_theta=config.rope_theta)


# --------------------------------------------------------------------------------------------------------------------
# shared pieces


def _init_weights(module: nn.Module) -> None:
    """GPT/Llama-style init: Linear weights N(0, 0.02), biases 0 (RMSNorm weights stay 1)."""
    for m in module.modules():
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, mean=0.0, std=0.02)
            if m.bias is not None:
                nn.init.zeros_(m.bias)


def _zero_linear(layer: nn.Linear) -> nn.Linear:
    """The final H -> 1 projection starts at zero so that tau == 0 exactly (identity calibration)."""
    nn.init.zeros_(layer.weight)
    nn.init.zeros_(layer.bias)
    return layer


def _finish(tau: Tensor, attention_mask: Tensor | None) -> Tensor:
    """tau (B, T, 1) -> (B, T) float32, 0 on padding. The mask may cover past + new positions: use its tail."""
    tau = tau.squeeze(-1).float()  # (B, T)
    if attention_mask is not None:
        new = attention_mask[:, attention_mask.shape[1] - tau.shape[1]:].bool()  # (B, T)
        tau = tau.masked_fill(~new, 0.0)
    return tau


class ConstantHead(nn.Module):
    """tau = gain * c for every token: one global temperature, trained like any head (the "no adaptivity" control).

    Adam moves a parameter by about lr per step whatever its gradient, so a bare scalar could move tau by only
    lr x steps (0.2 in 200 steps at lr 1e-3) while a linear head's output moves by up to lr x sum_i |h_i| per step.
    The gain sqrt(hidden_size) lets the control reach its optimum within the same steps and schedule.

    Args:
        hidden_size: H (sets the gain only).
    """

    def __init__(self, hidden_size: int) -> None:
        super().__init__()
        self.gain = math.sqrt(hidden_size)
        self.tau = nn.Parameter(torch.zeros(1))

    def forward(self, hidden: Tensor, attention_mask: Tensor | None = None, cache: "HeadCache | None" = None) -> Tensor:
        """tau (B, T) float32, the same value at every real token (the module docstring gives the signature)."""
        tau = (self.gain * self.tau).to(hidden.device).expand(*hidden.shape[:2], 1)  # (B, T, 1)
        return _finish(tau, attention_mask)  # (B, T)


class LinearHead(nn.Module):
    """tau = w . h + b: one log-temperature per token from a linear probe of the hidden state.

    Args:
        hidden_size: H.
    """

    def __init__(self, hidden_size: int):
        super().__init__()
        self.proj = _zero_linear(nn.Linear(hidden_size, 1))

    def forward(self, hidden: Tensor, attention_mask: Tensor | None = None, cache: "HeadCache | None" = None) -> Tensor:
        """tau (B, T) float32, 0 on padding (the module docstring gives the signature)."""
        x = hidden.to(self.proj.weight.dtype)  # (B, T, H)
        return _finish(self.proj(x), attention_mask)  # (B, T)


class MLPHead(nn.Module):
    """tau = w . gelu(W h + c) + b: a per-token nonlinear probe (no context).

    Args:
        hidden_size: H.
        mlp_hidden: the hidden layer's width; None: H.
    """

    def __init__(self, hidden_size: int, mlp_hidden: int | None = None):
        super().__init__()
        mlp_hidden = mlp_hidden or hidden_size
        self.fc = nn.Linear(hidden_size, mlp_hidden)
        self.act = nn.GELU()
        self.proj = nn.Linear(mlp_hidden, 1)
        _init_weights(self)
        _zero_linear(self.proj)

    def forward(self, hidden: Tensor, attention_mask: Tensor | None = None, cache: "HeadCache | None" = None) -> Tensor:
        """tau (B, T) float32, 0 on padding (the module docstring gives the signature)."""
        x = hidden.to(self.fc.weight.dtype)  # (B, T, H)
        return _finish(self.proj(self.act(self.fc(x))), attention_mask)  # (B, T)


# --------------------------------------------------------------------------------------------------------------------
# transformer head


class RMSNorm(nn.Module):
    """Llama RMSNorm: x / sqrt(mean(x^2) + eps) * weight.

    Args:
        dim: the size of the normalised (last) axis.
        eps: added to the mean square.
    """

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        """x (..., dim) normalised over its last axis (computed in float32), same shape and dtype."""
        xf = x if x.dtype == torch.float32 else x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * (xf if xf.dtype == x.dtype else xf.to(x.dtype))


class HeadCache:
    """What the transformer head keeps between decoding steps; extended in place, one cache per head and sequence
    batch.

    keys, values: (B, n_heads, T_past, head_dim), keys already rotated (RoPE); real: (B, T_past) bool, which cached
    positions are tokens rather than padding; positions: (B,) the RoPE position of each row's next real token. The
    three are `GrowingBuffer`s (the buffer type the backbone's decoding cache uses too), so a decoding step appends
    without copying the past. `weights` holds the head's fused projection matrices, packed on the first cached call
    (a cache belongs to one head and the weights it had then): a copy of (3H + 2I) x H values for the cache's
    lifetime, 11 MB at SmolLM2's size and 0.56 GB in float32 for a Llama-2-7B-sized head (half in bfloat16).
    """

    def __init__(self) -> None:
        self._k, self._v, self._real = GrowingBuffer(2), GrowingBuffer(2), GrowingBuffer(1)
        self.positions: Tensor | None = None  # (B,) long
        self.has_padding = False  # any cached position is padding: attention then needs a mask
        self.weights: tuple[Tensor, Tensor] | None = None  # (3H, H) q|k|v and (2I, H) gate|up, see TransformerHead

    @property
    def keys(self) -> Tensor | None:
        """(B, n_heads, T_past, head_dim) cached keys, rotated; None before the first update."""
        return self._k.view

    @property
    def values(self) -> Tensor | None:
        """(B, n_heads, T_past, head_dim) cached values; None before the first update."""
        return self._v.view

    @property
    def real(self) -> Tensor | None:
        """(B, T_past) bool, True where a cached position is a token; None before the first update."""
        return self._real.view

    @property
    def length(self) -> int:
        """Number of cached positions (T_past)."""
        return self._k.length

    def _buffers(self) -> tuple[GrowingBuffer, GrowingBuffer, GrowingBuffer]:
        return self._k, self._v, self._real

    def update(self, k: Tensor, v: Tensor, real: Tensor, all_real: bool | None = None) -> tuple[Tensor, Tensor, Tensor]:
        """Append the new positions and return all cached ones.

        Args:
            k: (B, n_heads, T_new, d) new keys, rotated.
            v: (B, n_heads, T_new, d) new values.
            real: (B, T_new) bool, True on tokens.
            all_real: whether `real` is all True, if the caller knows (saves a check); None: checked here.

        Returns:
            (keys, values (B, n_heads, T_past + T_new, d), real (B, T_past + T_new)).
        """
        self.has_padding = self.has_padding or not (bool(real.all()) if all_real is None else all_real)
        return self._k.append(k), self._v.append(v), self._real.append(real)

    def select(self, index: Tensor) -> None:
        """Keep (or reorder) batch rows, e.g. after sequences finish.

        Args:
            index: (B',) long, the rows to keep, in their new order.
        """
        for buffer in self._buffers():
            buffer.select(index)
        if not self._real.empty:
            self.has_padding = not bool(self.real.all())
        if self.positions is not None:
            self.positions = self.positions.index_select(0, index)

    def pad_left(self, n: int) -> None:
        """Prepend `n` padding positions to every row, so that a shorter batch lines up with a longer one before
        `concat` (a server joining new sequences to running ones); padding keys are never attended to.

        Args:
            n: the number of positions; nothing happens for n <= 0 or an empty cache.
        """
        if n <= 0 or self._k.empty:
            return
        for buffer in self._buffers():
            buffer.pad_left(n)
        self.has_padding = True

    def trim_left(self, n: int) -> None:
        """Drop the first `n` positions, which must be padding in every row (after the rows that needed them left).

        Args:
            n: the number of positions; nothing happens for n <= 0 or an empty cache.

        Raises:
            ATSError: if `n` exceeds the length or one of those positions is a token.
        """
        if n <= 0 or self._k.empty:
            return
        if n > self.length or bool(self.real[:, :n].any()):
            raise ATSError(f"HeadCache.trim_left: the first {n} of {self.length} positions are not all padding")
        for buffer in self._buffers():
            buffer.drop_left(n)
        self.has_padding = not bool(self.real.all())

    @classmethod
    def concat(cls, caches: Sequence[HeadCache]) -> HeadCache:
        """One cache holding the rows of `caches`, in order; they must have the same length (see `pad_left`).

        Args:
            caches: the caches to join (all filled or all empty).

        Returns:
            A new cache; the first packed weights found are kept.

        Raises:
            ATSError: if the lengths differ, or some caches are empty and others not.
        """
        lengths = sorted({c.length for c in caches})
        if len(lengths) != 1:
            raise ATSError(f"HeadCache.concat: caches of different lengths {lengths}; pad_left the shorter first")
        out = cls()
        out._k, out._v, out._real = (GrowingBuffer.concat([c._buffers()[i] for c in caches]) for i in range(3))
        if all(c.positions is not None for c in caches):
            out.positions = torch.cat([c.positions for c in caches])
        out.has_padding = any(c.has_padding for c in caches)
        out.weights = next((c.weights for c in caches if c.weights is not None), None)
        return out


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
        _init_weights(self)
        _zero_linear(self.proj)

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
        return _finish(self.proj(self.final_norm(x)), mask)  # (B, T)

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
        return tau.squeeze(-1).float() if all_real else _finish(tau, real)  # (B, T)


def tau_at(head: nn.Module, hidden: Tensor, attention_mask: Tensor | None, index: Tensor) -> Tensor:
    """tau (B, K) of any head at positions `index` (B, K): the transformer head computes only those positions'
    queries (`TransformerHead.forward_at`), the per-token heads gather their output.

    Args:
        head: a head built by `build_head`.
        hidden: (B, T, H) hidden states.
        attention_mask: (B, T), 1 on real tokens; None: all real.
        index: (B, K) long positions.

    Returns:
        tau (B, K) float32.
    """
    if isinstance(head, TransformerHead):
        return head.forward_at(hidden, attention_mask, index)
    return head(hidden, attention_mask).gather(1, index.to(hidden.device))
