"""The caches of a decoding batch whose sequences join and leave between decoding steps (continuous batching).

A batch holds B sequences left-padded to one length L:

- the backbone's key/value cache, one `RowsLayer` per decoder layer (full or sliding-window attention:
  `check_attention`): (B, kv_heads, L, d) views of buffers whose capacity doubles when full (transformers'
  `DynamicLayer` concatenates, copying the whole past at every step);
- the ATS head's own `HeadCache` (transformer heads), holding the same L positions, on the same `GrowingBuffer`;
- the attention mask (B, L), 0 on padding;
- what the calibrator keeps per row (`rows_state`, e.g. Thermometer's prompt hidden state (B, H)).

Sequences that finish are dropped (`select`); new ones are prefilled as a batch of their own and joined (`extend`: the
shorter batch is left-padded); columns that have become padding in every row are dropped (`trim`). Padding is never
attended to and RoPE positions come from each row's own count of tokens, so a sequence gets the same values whatever
batch it is decoded in.
"""

from __future__ import annotations

import torch
from torch import Tensor
from transformers.cache_utils import Cache, DynamicLayer, get_layer_types_and_kwargs

from ..errors import ATSError
from ..model.buffer import GrowingBuffer
from ..model.heads import HeadCache

ATTENTION = ("full_attention", "sliding_attention")  # the layer types a batch can hold


def check_attention(config) -> int:
    """The number of decoder layers of a model whose layers all use full or sliding-window attention.

    Sliding-window layers (Gemma 2 / 3, Mistral) keep every position here, like full-attention ones (no memory is
    saved), and the model masks out what lies beyond the window from the column indices it is given: each row is
    contiguous after its left padding, so column distance is token distance and the window is exact.

    Args:
        config: the model's config (its text config is read).

    Returns:
        The number of layers.

    Raises:
        ATSError: for linear, recurrent or hybrid layers, whose state is not a per-position cache that rows can be
            padded and joined in.
    """
    types, _ = get_layer_types_and_kwargs(config.get_text_config(decoder=True))
    other = sorted({t for t in types if t not in ATTENTION})
    if other:
        raise ATSError(f"decoding needs a model whose layers all use full or sliding-window attention; this one has "
                       f"{', '.join(other)} layers")
    return len(types)


class RowsLayer(DynamicLayer):
    """A full-attention cache layer over `GrowingBuffer`s: `keys` / `values` (B, kv_heads, L, d) are views of their
    first L positions, so a decoding step writes one column instead of copying the past (transformers'
    `DynamicLayer` concatenates)."""

    def lazy_initialization(self, key_states: Tensor, value_states: Tensor) -> None:
        """Start empty on the device of `key_states` (B, kv_heads, T, d); the buffers come with the first update."""
        self.device = key_states.device
        self._k, self._v = GrowingBuffer(2), GrowingBuffer(2)
        self.keys, self.values = key_states[:, :, :0], value_states[:, :, :0]
        self.is_initialized = True

    def update(self, key_states: Tensor, value_states: Tensor, *args, **kwargs) -> tuple[Tensor, Tensor]:
        """Append the new positions' `key_states`, `value_states` (B, kv_heads, T, d); returns all keys and values
        (B, kv_heads, L + T, d). Other arguments (transformers' cache kwargs) are ignored."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.keys, self.values = self._k.append(key_states), self._v.append(value_states)
        return self.keys, self.values

    def _sync(self) -> None:
        self.keys, self.values = self._k.view, self._v.view

    def select(self, index: Tensor) -> None:
        """Keep, reorder or repeat rows (`index` (B',) long)."""
        self._k.select(index)
        self._v.select(index)
        self._sync()

    def pad_left(self, n: int) -> None:
        """Prepend `n` padding positions (zeros, never attended to) to every row."""
        self._k.pad_left(n)
        self._v.pad_left(n)
        self._sync()

    def drop_left(self, n: int) -> None:
        """Forget the first `n` positions (views, no copy)."""
        self._k.drop_left(n)
        self._v.drop_left(n)
        self._sync()

    def join(self, other: "RowsLayer") -> None:
        """Append the rows of `other` (same length) after these."""
        self._k = GrowingBuffer.concat([self._k, other._k])
        self._v = GrowingBuffer.concat([self._v, other._v])
        self._sync()


def _pad_left(x: Tensor, n: int, dim: int) -> Tensor:
    if n <= 0:
        return x
    shape = list(x.shape)
    shape[dim] = n
    return torch.cat([x.new_zeros(shape), x], dim)


class BatchCache:
    """Backbone KV cache, head cache and attention mask of the sequences decoded together; row i is sequence i.

    Args:
        num_layers: the backbone's decoder layers.
        head: keep a `HeadCache` too (the transformer head).
    """

    def __init__(self, num_layers: int, *, head: bool) -> None:
        self.kv = Cache(layers=[RowsLayer() for _ in range(num_layers)])
        self.head = HeadCache() if head else None
        self.mask: Tensor | None = None  # (B, L) long, 0 on padding
        self.rows_state: Tensor | None = None  # (B, ...) what a calibrator keeps per row (Thermometer: the prompt's h)

    @property
    def rows(self) -> int:
        """B, the number of sequences (0 when empty)."""
        return 0 if self.mask is None else self.mask.shape[0]

    @property
    def length(self) -> int:
        """L, the number of cached positions, padding included (0 when empty)."""
        return 0 if self.mask is None else self.mask.shape[1]

    def _layers(self) -> list[RowsLayer]:
        return [layer for layer in self.kv.layers if layer.is_initialized]

    def append_column(self) -> Tensor:
        """Extend the mask by one real position per row (the tokens about to be fed); returns it (B, L + 1)."""
        self.mask = torch.cat([self.mask, self.mask.new_ones(self.rows, 1)], 1)
        return self.mask

    def next_positions(self) -> Tensor:
        """(B, 1) RoPE position of each row's last mask column: its count of real tokens before it."""
        return self.mask.sum(-1, keepdim=True) - 1

    def select(self, index: Tensor) -> None:
        """Keep, reorder or repeat rows (`index` (B',) long)."""
        for layer in self._layers():
            layer.select(index)
        if self.head is not None:
            self.head.select(index)
        if self.rows_state is not None:
            self.rows_state = self.rows_state.index_select(0, index)
        self.mask = self.mask.index_select(0, index)

    def extend(self, other: BatchCache) -> None:
        """Append the rows of `other` (a freshly prefilled batch) after these; the shorter one is left-padded."""
        if self.mask is None or self.rows == 0:
            self.kv, self.head, self.mask, self.rows_state = other.kv, other.head, other.mask, other.rows_state
            return
        length = max(self.length, other.length)
        pad_self, pad_other = length - self.length, length - other.length
        for mine, theirs in zip(self.kv.layers, other.kv.layers):
            mine.pad_left(pad_self)
            theirs.pad_left(pad_other)
            mine.join(theirs)
        if self.rows_state is not None:
            self.rows_state = torch.cat([self.rows_state, other.rows_state])
        if self.head is not None:
            self.head.pad_left(pad_self)
            other.head.pad_left(pad_other)
            self.head = HeadCache.concat([self.head, other.head])
        self.mask = torch.cat([_pad_left(self.mask, pad_self, 1), _pad_left(other.mask, pad_other, 1)])

    def trim(self) -> int:
        """Drop the leading columns that are padding in every row; returns how many."""
        if self.mask is None or self.rows == 0:
            return 0
        used = self.mask.any(0)  # (L,)
        n = int(used.int().argmax()) if bool(used.any()) else self.length
        if n:
            for layer in self._layers():
                layer.drop_left(n)
            if self.head is not None:
                self.head.trim_left(n)
            self.mask = self.mask[:, n:]
        return n

