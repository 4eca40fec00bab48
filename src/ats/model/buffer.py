"""`GrowingBuffer`: a tensor that grows along one axis without copying its past at every step.

Decoding appends one position per step to several caches (the backbone's keys and values per layer, the ATS head's
keys, values and real-token mask). Concatenating copies the whole past each time; this buffer keeps a capacity that
doubles when full, so an append writes only the new positions, and `view` is the filled part. Rows (sequences) can be
kept or reordered (`select`), padded on the left to line up with a longer batch (`pad_left`, `concat`) and their
leading padding dropped (`drop_left`): what a batch whose sequences join and leave needs. One type, shared by
`model.heads.HeadCache` and `generation.batch.RowsLayer`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from ..errors import ATSError

MIN_CAPACITY = 64  # positions reserved at least, so that short decodes never regrow


class GrowingBuffer:
    """A tensor (B, ..., L, ...) filled along axis `dim` up to `length`, with spare capacity after it.

    Args:
        dim: the growing axis (2 for keys (B, heads, L, d), 1 for masks (B, L)).
    """

    def __init__(self, dim: int) -> None:
        self.dim = dim
        self._data: Tensor | None = None  # (B, ..., capacity, ...)
        self.length = 0

    @property
    def empty(self) -> bool:
        """Whether nothing was ever stored (no shape yet)."""
        return self._data is None

    @property
    def view(self) -> Tensor | None:
        """The filled part (B, ..., length, ...), a view; None while empty."""
        return None if self._data is None else self._data.narrow(self.dim, 0, self.length)

    def _reserve(self, like: Tensor, capacity: int, keep: int) -> None:
        """New storage shaped like `like` with `capacity` along the axis, holding the first `keep` positions."""
        shape = list(like.shape)
        shape[self.dim] = max(capacity, MIN_CAPACITY)
        grown = like.new_empty(shape)
        if self._data is not None and keep:
            grown.narrow(self.dim, 0, keep).copy_(self._data.narrow(self.dim, 0, keep))
        self._data = grown

    def append(self, x: Tensor) -> Tensor:
        """Write `x` (B, ..., T, ...) after the filled part; returns the new filled view.

        Args:
            x: the new positions, same shape as the buffer but along the axis.

        Returns:
            The filled part, length + T along the axis.
        """
        start, end = self.length, self.length + x.shape[self.dim]
        if self._data is None or end > self._data.shape[self.dim]:
            self._reserve(x, max(end, 2 * (0 if self._data is None else self._data.shape[self.dim])), start)
        self._data.narrow(self.dim, start, x.shape[self.dim]).copy_(x)
        self.length = end
        return self.view

    def set(self, x: Tensor, spare: int = 0) -> None:
        """Hold a copy of `x` as the whole filled part, with room for at least `spare` more positions (doubling).

        Args:
            x: the new content (B, ..., L, ...).
            spare: positions expected to be appended soon.
        """
        length = x.shape[self.dim]
        self._data = None
        self._reserve(x, 2 * (length + spare), 0)
        self._data.narrow(self.dim, 0, length).copy_(x)
        self.length = length

    def select(self, index: Tensor) -> None:
        """Keep, reorder or repeat rows (`index` (B',) long)."""
        if self._data is not None:
            self.set(self.view.index_select(0, index))

    def pad_left(self, n: int, value: float = 0) -> None:
        """Prepend `n` positions filled with `value` to every row (nothing for n <= 0 or an empty buffer)."""
        if n <= 0 or self._data is None:
            return
        filled = self.view
        shape = list(filled.shape)
        shape[self.dim] = n
        self.set(torch.cat([filled.new_full(shape, value), filled], self.dim))

    def drop_left(self, n: int) -> None:
        """Forget the first `n` positions (a view of the same storage, no copy)."""
        if n <= 0 or self._data is None:
            return
        if n > self.length:
            raise ATSError(f"GrowingBuffer.drop_left: {n} positions asked, {self.length} held")
        self._data = self._data.narrow(self.dim, n, self._data.shape[self.dim] - n)
        self.length -= n

    @classmethod
    def concat(cls, buffers: Sequence[GrowingBuffer]) -> GrowingBuffer:
        """One buffer holding the rows of `buffers` in order; they must have the same length (see `pad_left`).

        Raises:
            ATSError: if the lengths differ or some buffers are empty and others not.
        """
        lengths = sorted({b.length for b in buffers})
        if len(lengths) > 1:
            raise ATSError(f"GrowingBuffer.concat: buffers of different lengths {lengths}; pad_left the shorter first")
        out = cls(buffers[0].dim)
        filled = [b for b in buffers if not b.empty]
        if filled and len(filled) != len(buffers):
            raise ATSError("GrowingBuffer.concat: some buffers hold positions and some are empty")
        if filled:
            out.set(torch.cat([b.view for b in filled]))
        return out
