"""The transformer head's decoding cache (keys, values, which positions are real, RoPE positions)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from ...errors import ATSError
from ..buffer import GrowingBuffer


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
