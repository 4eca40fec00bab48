"""Features computed on the fly for large backbones: the FeatureStore interface with nothing cached.

The tokenized examples are cut into the same length-sorted shards an extraction would write, and micro-batches follow
the same seeded plan, so a head trained online sees exactly the batches it would see from a cache.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import Tensor

from ..errors import ATSError
from ..model.backbone import Backbone
from ..model.labels import IGNORE_INDEX
from .data import TokenizedExample
from .features import SequenceBatch, _token_batches, micro_batch_plan, pad_batch, shard_plan


class OnlineFeatures:
    """Features computed on the fly (large backbones): the same interface as FeatureStore, nothing cached.

    The tokenized examples are cut into the same length-sorted shards as an extraction would write (`shard_plan`),
    and micro-batches follow the same seeded plan, so a head trained online sees exactly the batches it would see
    from a cache. Each micro-batch runs the frozen backbone (no grad) on its padded token ids; hidden states live
    only for that micro-batch, so memory does not grow with the data set (only the token ids are held).

    Args:
        backbone: the frozen backbone run on each micro-batch.
        examples: the tokenized examples.
        shard_sequences: sequences per shard of the plan.
        batch_tokens: the most padded tokens per forward pass in `sequences`.
        extra_meta: more entries for `meta`.
    """

    def __init__(self, backbone: Backbone, examples: list[TokenizedExample], *, shard_sequences: int = 256,
                 batch_tokens: int = 8192, extra_meta: dict | None = None) -> None:
        self.backbone = backbone
        self.examples = examples
        self.batch_tokens = batch_tokens
        self.plan = shard_plan(examples, shard_sequences)
        shards = []
        for indices in self.plan:
            shards.append({"sequences": len(indices), "tokens": sum(len(examples[i].input_ids) for i in indices),
                           "response_tokens": sum(sum(y != IGNORE_INDEX for y in examples[i].labels)
                                                  for i in indices)})
        self.meta = {"online": True, **backbone.describe(), "shards": shards,
                     "sequences": len(examples), "tokens": sum(s["tokens"] for s in shards),
                     "response_tokens": sum(s["response_tokens"] for s in shards), **(extra_meta or {})}
        self.directory = None

    def __len__(self) -> int:
        return len(self.examples)

    @property
    def n_shards(self) -> int:
        """The number of shards of the plan."""
        return len(self.plan)

    @property
    def hidden_size(self) -> int:
        """H, the backbone's hidden size."""
        return self.backbone.hidden_size

    def check_backbone(self, backbone: Backbone) -> None:
        """Refuse a backbone other than the one computing the features.

        Args:
            backbone: the backbone the features are to be used with.

        Raises:
            ATSError: if its identity (`describe()`) differs.
        """
        if backbone.describe() != self.backbone.describe():
            raise ATSError("online features: the training backbone differs from the one computing the features")

    @torch.no_grad()
    def _forward(self, indices: list[int]) -> SequenceBatch:
        ids = [self.examples[i].input_ids for i in indices]
        input_ids, mask = pad_batch(ids, self.backbone.tokenizer.pad_token_id or 0)
        labels = torch.full(mask.shape, IGNORE_INDEX, dtype=torch.long)
        for row, i in enumerate(indices):
            labels[row, : len(ids[row])] = torch.tensor(self.examples[i].labels)
        device = self.backbone.device
        hidden, _ = self.backbone.forward(input_ids.to(device), mask.to(device))  # (B, T, H)
        hidden = hidden.float() * mask.to(device)[..., None]  # zeros on padding, as a cached batch
        return SequenceBatch(hidden=hidden, attention_mask=mask, labels=labels)

    def batches(self, batch_size: int, *, shuffle: bool = False, seed: int = 0,
                shard_ids: list[int] | None = None, rank: int = 0, world_size: int = 1,
                start: int = 0) -> Iterator[SequenceBatch]:
        """As `FeatureStore.batches` (same arguments; without shuffle, plan order), with the backbone run on each of
        this process's micro-batches.

        Yields:
            `SequenceBatch`es: hidden (B, T, H) float32 on the backbone's device, zeros on padding;
            attention_mask (B, T) and labels (B, T) on the CPU.
        """
        plan = micro_batch_plan([len(p) for p in self.plan], batch_size, shuffle=shuffle, seed=seed,
                                shard_ids=shard_ids)
        for m, (k, rows) in enumerate(plan):
            if m >= start and m % world_size == rank:
                yield self._forward([self.plan[k][i] for i in rows])

    def sequences(self, shard_ids: list[int] | None = None) -> Iterator[tuple[Tensor, Tensor]]:
        """(hidden (T, H) float32, labels (T,)) per sequence, forward passes of at most `batch_tokens` tokens.

        Args:
            shard_ids: the shards to use; default all, in order.

        Yields:
            (hidden (T, H) float32, labels (T,)) per sequence.
        """
        for k in range(self.n_shards) if shard_ids is None else shard_ids:
            indices = self.plan[k]
            for batch in _token_batches([len(self.examples[i].input_ids) for i in indices], self.batch_tokens):
                out = self._forward([indices[j] for j in batch])
                for row in range(len(batch)):
                    n = int(out.attention_mask[row].sum())
                    yield out.hidden[row, :n], out.labels[row, :n]
