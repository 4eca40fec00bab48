"""Vector scaling (Guo et al. 2017): q = a * z + b with a per-class scale a (V,) and bias b (V,).

Unlike every other method here it can change the argmax (a class-dependent scale and bias reorder the logits), so it
can change accuracy as well as confidence. With V ~ 49k classes and tens of thousands of fitting tokens most classes
are rare, so the fit adds `weight_decay * (||a - 1||^2 + ||b||^2)` (summed over classes) to the mean NLL, pulling
every parameter back to the identity map unless the data clearly move it.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..checks import check_positive_int
from ..config import ConfigMixin, option
from ..errors import ATSError
from ._fitting import iter_chunks
from .base import Calibrator
from .fit_loop import BatchObjective, FitLoop


@dataclass
class VectorConfig(ConfigMixin):
    """Vector scaling's options: minibatch Adam over the chunks, and the penalty pulling the map to the identity."""

    epochs: int = option(5, "passes over the chunks", low=1)
    lr: float = option(1e-2, "Adam's learning rate (the one loop's AdamW, without decay)", low=0, low_open=True)
    weight_decay: float = option(1e-4, "the weight of the penalty pulling (a, b) back to (1, 0)", low=0)
    batch_size: int = option(512, "tokens per Adam step (minibatches are drawn within a chunk)", low=1)
    seed: int = option(0, "the seed of the shuffling")


class _AffineMap(nn.Module):
    """The parameters fitted: a (V,) from ones, b (V,) from zeros (vectors: no weight decay in `decay_groups`)."""

    def __init__(self, vocab: int) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(vocab))
        self.bias = nn.Parameter(torch.zeros(vocab))


class VectorScaling(Calibrator):
    """Per-class affine map of the logits, fitted by minibatch Adam over the chunks with an identity-pulling penalty.

    Options: `VectorConfig` (epochs, lr, weight_decay, batch_size, seed), keyword-only.
    """

    name = "vector"
    Config = VectorConfig
    fitted_keys = ("vocab_size",)
    fitted_attributes = ("scale", "bias")
    scale: Tensor | None = None  # (V,) a
    bias: Tensor | None = None  # (V,) b

    def _fit(self, source) -> None:
        """Fit a (V,) and b (V,) from the identity through the one loop (`FitLoop`: Adam, minibatches drawn within
        each chunk); V and the device come from the first chunk.

        Raises:
            ATSError: if a chunk is malformed, chunks differ in V, or there is no fitting token.
        """
        chunks = source.logit_chunks
        first_pass = iter_chunks(chunks)  # epoch 0's pass: its first chunk sizes the map
        first = next(first_pass, None)
        if first is None:
            raise ATSError("chunks: no fitting tokens (every chunk was empty)")
        vocab, device = first[0].shape[1], first[0].device
        maps = _AffineMap(vocab).to(device)
        gen = torch.Generator().manual_seed(self.seed)

        def batches(epoch: int):
            seen = 0
            for logits, labels in itertools.chain([first], first_pass) if epoch == 0 else iter_chunks(chunks):
                if logits.shape[1] != vocab:
                    raise ATSError(f"chunks: vocabulary size {logits.shape[1]} differs from the first chunk's {vocab}")
                order = torch.randperm(labels.numel(), generator=gen).to(logits.device)  # shuffle within the chunk
                for batch in order.split(self.batch_size):
                    yield logits[batch], labels[batch]
                seen += labels.numel()
            if seen == 0:
                raise ATSError("chunks: no fitting tokens (every chunk was empty)")

        def loss(batch) -> tuple[Tensor, dict]:
            logits, labels = batch
            out = F.cross_entropy(logits.float() * maps.scale + maps.bias, labels)  # (n, V) -> ()
            if self.weight_decay:
                out = out + self.weight_decay * ((maps.scale - 1).square().sum() + maps.bias.square().sum())
            return out, {}

        FitLoop(maps, BatchObjective("vector scaling", batches, loss), lr=self.lr, weight_decay=0.0,
                epochs=self.epochs, seed=self.seed).run()
        self.scale = maps.scale.detach().cpu().clone()
        self.bias = maps.bias.detach().cpu().clone()

    @property
    def vocab_size(self) -> int:
        """V, the size of the fitted vectors."""
        self.check_fitted()
        return self.scale.numel()

    def calibrate(self, logits: Tensor, hidden: Tensor | None = None, *, attention_mask: Tensor | None = None,
                  index: Tensor | None = None) -> Tensor:
        """a * z + b over the last axis; same shape and dtype as `logits` (computed in float32).

        Same arguments as `Calibrator.calibrate`; only `logits`, (B, K, V) or (N, V), is read. Raises `ATSError`
        if not fitted or V differs from the fitted vocabulary size.
        """
        self.check_fitted()
        a, b = self.scale, self.bias
        if logits.shape[-1] != a.numel():
            raise ATSError(f"logits: vocabulary size {logits.shape[-1]} does not match the fitted {a.numel()}")
        a, b = a.to(logits.device), b.to(logits.device)
        return (logits.float() * a + b).to(logits.dtype)

    def state_tensors(self) -> dict[str, Tensor]:
        """The fitted vectors.

        Returns:
            {"scale": a (V,), "bias": b (V,)}.

        Raises:
            ATSError: if not fitted.
        """
        self.check_fitted()
        return {"scale": self.scale, "bias": self.bias}

    def restore(self, fitted: dict, tensors: dict[str, Tensor]) -> None:
        """Set the saved vectors (as float32).

        Raises:
            ATSError: if vocab_size is invalid, or a tensor is missing or not of shape (vocab_size,).
        """
        vocab = check_positive_int("vocab_size", fitted.get("vocab_size"))
        for key in ("scale", "bias"):
            if key not in tensors:
                raise ATSError(f"model.safetensors: tensor {key!r} missing")
            if tuple(tensors[key].shape) != (vocab,):
                raise ATSError(f"model.safetensors: tensor {key!r} has shape {tuple(tensors[key].shape)}, "
                               f"expected ({vocab},)")
        self.scale = tensors["scale"].float()
        self.bias = tensors["bias"].float()
