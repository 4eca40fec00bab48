"""One interface for every post-hoc calibrator, ATS included.

A calibrator maps a backbone's logits to calibrated logits (scaling methods), and optionally maps a top-1 confidence
to a calibrated confidence (binning methods, applied after the logits map). All calibrators are fitted on the same
token-level data ATS trains on: the response tokens of the instruction data, given as chunks of (logits, labels).
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Callable, ClassVar, Iterator

import numpy as np
import torch
from safetensors.torch import load_file, save_file
from torch import Tensor

from ..errors import ATSError
from ..io import atomic_dir, read_json

CONFIG_NAME = "calibrator_config.json"
WEIGHTS_NAME = "model.safetensors"

# A re-iterable source of token-level fitting data: each call yields chunks of
# logits (N, V) float32 and next-token labels (N,) int64 for response tokens only.
LogitChunks = Callable[[], Iterator[tuple[Tensor, Tensor]]]


class Calibrator(ABC):
    """Base class: `fit` on token-level logits, `calibrate` logits, `calibrate_confidence` for binning methods."""

    name: ClassVar[str]
    needs_hidden: ClassVar[bool] = False  # True for ATS: it reads the backbone's hidden states
    maps_confidence: ClassVar[bool] = False  # True for binning methods

    @abstractmethod
    def fit(self, chunks: LogitChunks) -> "Calibrator":
        """Fit on token-level (logits, labels) chunks; returns self."""

    def calibrate(
        self,
        logits: Tensor,  # (B, K, V) or (N, V)
        hidden: Tensor | None = None,  # (B, T, H): the whole sequence, needed by ATS only
        *,
        attention_mask: Tensor | None = None,  # (B, T)
        index: Tensor | None = None,  # (B, K) positions of `logits` in `hidden`; None: K == T
    ) -> Tensor:
        """Calibrated logits, same shape as `logits`. Identity unless overridden."""
        return logits

    def calibrate_confidence(self, confidence: Tensor | np.ndarray) -> Tensor | np.ndarray:
        """Map a top-1 confidence in [0, 1] to a calibrated one. Identity unless overridden."""
        return confidence

    # --- persistence: JSON config + safetensors, never pickle -------------------------------------------------
    def config(self) -> dict:
        """JSON-serialisable settings and fitted scalars (tensors go to `state_tensors`)."""
        return {}

    def state_tensors(self) -> dict[str, Tensor]:
        return {}

    def load_state(self, config: dict, tensors: dict[str, Tensor]) -> None:
        """Restore from what `config` and `state_tensors` wrote."""

    def save_pretrained(self, directory: str | Path) -> None:
        with atomic_dir(directory) as tmp:
            (tmp / CONFIG_NAME).write_text(json.dumps({"type": self.name, **self.config()}, indent=2, sort_keys=True))
            tensors = {k: v.detach().contiguous().cpu() for k, v in self.state_tensors().items()}
            if tensors:
                save_file(tensors, str(tmp / WEIGHTS_NAME))

    @classmethod
    def from_pretrained(cls, directory: str | Path) -> "Calibrator":
        directory = Path(directory)
        config = read_json(directory / CONFIG_NAME)
        if config.get("type") != cls.name:
            raise ATSError(f"{directory / CONFIG_NAME}: field 'type' is {config.get('type')!r}, expected {cls.name!r}")
        tensors = {}
        if (directory / WEIGHTS_NAME).exists():
            try:
                tensors = load_file(str(directory / WEIGHTS_NAME))
            except Exception as err:  # safetensors raises its own error types for corrupt files
                raise ATSError(f"{directory / WEIGHTS_NAME}: corrupt or truncated safetensors file ({err})") from None
        obj = cls.__new__(cls)
        obj.load_state({k: v for k, v in config.items() if k != "type"}, tensors)
        return obj


class Uncalibrated(Calibrator):
    """The backbone as it is: the reference row of every table."""

    name = "none"

    def __init__(self) -> None:
        pass

    def fit(self, chunks: LogitChunks) -> "Uncalibrated":
        return self


def top1_confidence(logits: Tensor) -> tuple[Tensor, Tensor]:
    """(confidence, argmax) of softmax(logits) over the last axis, computed in float32."""
    probs = torch.softmax(logits.float(), dim=-1)
    conf, pred = probs.max(dim=-1)
    return conf, pred
