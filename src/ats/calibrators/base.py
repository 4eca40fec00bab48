"""One interface for every post-hoc calibrator, ATS included.

A calibrator maps a backbone's logits to calibrated logits (scaling methods) and may map a top-1 confidence to a
calibrated confidence (binning methods, applied after the logits map). Every calibrator is fitted on the same data
ATS trains on, given as a `FitSource` (the response tokens of the instruction data, as logit chunks or as whole
sequences of hidden states), and applied with `apply` / `map_confidence`, which every evaluation uses.

    cal = build_calibrator("temperature").fit_source(source)     # or .fit(chunks) for token-level methods
    q = cal.apply(z, hidden, attention_mask=mask, index=index)  # (B, K, V) calibrated logits
    conf = cal.map_confidence(top1)                             # binning methods map the confidence too
    cal.save_pretrained(dir); load_calibrator(dir)              # JSON + safetensors, never pickle
"""

from __future__ import annotations

import hashlib
import json
from abc import ABC
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch
from torch import Tensor

from ..config import ConfigMixin
from ..errors import ATSError
from .fit_source import FitRoutes, FitSource, LogitChunks
from .hub_card import HubCard
from .saving import CONFIG_NAME, WEIGHTS_NAME, SavedCalibrator, read_config, read_tensors

__all__ = ["CONFIG_NAME", "WEIGHTS_NAME", "Calibrator", "FitSource", "LogitChunks", "NoOptions", "Uncalibrated",
           "read_config", "read_tensors", "top1_confidence"]


@dataclass
class NoOptions(ConfigMixin):
    """The config of a calibrator without options."""


class Calibrator(FitRoutes, SavedCalibrator, HubCard, ABC):
    """Base class: options (a `Config` dataclass), fitting by route, apply (logits, then the confidence map), move,
    check against a backbone, digest; fitting routes (`FitRoutes`), save and load (`SavedCalibrator`), the Hub
    (`HubCard`).

    A method declares what it needs as class capabilities, read here and by the pipeline, the decoder, the server
    and the lm-eval bridge: hidden states (`needs_hidden`), only the prompt's (`prompt_hidden`), a per-token head
    (`token_head`), the shared sketch or scale summary (`fits_on_sketch`, `fits_on_summary`), the ATS trainer
    (`trains_head`), another method fitted on the same source (`builds_on`). Its options live once, in `Config`:
    the keyword-only constructor takes them, `config_` holds them (also readable as attributes: `cal.n_bins`), and
    `config()` saves them beside the fitted values named in `fitted_keys`.
    """

    name: ClassVar[str]  # the registry name; also the "type" saved in calibrator_config.json
    Config: ClassVar[type[ConfigMixin]] = NoOptions  # the options: defaults, checks and help in one place
    fitted_attributes: ClassVar[tuple[str, ...]] = ()  # None until fitted (`is_fitted`)

    needs_hidden: ClassVar[bool] = False  # reads the backbone's hidden states (ATS, Thermometer)
    maps_confidence: ClassVar[bool] = False  # maps the top-1 confidence (binning methods)
    token_head: ClassVar[bool] = False  # a per-token head: log_scale(h, mask, cache=) and scale(tau) (ATS family)
    prompt_hidden: ClassVar[bool] = False  # reads only the prompt's last hidden state (Thermometer)
    # the routes it fits by (trains_head, fits_on_summary, fits_on_sketch, builds_on): see `FitRoutes`

    config_: ConfigMixin = NoOptions()  # the instance's options (a class without options shares this empty one)

    def __init__(self, **options) -> None:
        self.config_ = self.Config(**options)

    def __getattr__(self, name: str):  # options read as attributes: cal.n_bins is cal.config_.n_bins
        if name in self.config_.__dataclass_fields__:
            return getattr(self.config_, name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    @classmethod
    def position_refusal(cls) -> str | None:
        """Why this method cannot run where logits are calibrated one position at a time from that position's
        logits and the hidden states up to it (lm-eval's batched requests, an inference engine such as vLLM);
        None when it can (the ATS family, temperature and vector scaling, none).

        Returns:
            The reason in a few words, to quote in an error, or None.
        """
        if cls.maps_confidence:
            return "maps the top-1 confidence, not the logits"
        if cls.needs_hidden and not cls.token_head:
            return "reads one temperature per prompt from the prompt's last hidden state and holds it over the answer"
        return None

    @property
    def is_fitted(self) -> bool:
        """Whether every attribute in `fitted_attributes` is set (always, for a class without any)."""
        return all(getattr(self, key, None) is not None for key in self.fitted_attributes)

    def check_fitted(self) -> None:
        """Refuse to calibrate, save or digest before fitting.

        Raises:
            ATSError: if not fitted.
        """
        if not self.is_fitted:
            raise ATSError(f"{type(self).__name__}: not fitted; call fit_source() (or fit()) or from_pretrained() "
                           "first")

    # --- applying ---------------------------------------------------------------------------------------------------
    def calibrate(
        self,
        logits: Tensor,  # (B, K, V) or (N, V)
        hidden: Tensor | None = None,  # (B, T, H): the whole sequence, read by needs_hidden methods only
        *,
        attention_mask: Tensor | None = None,  # (B, T)
        index: Tensor | None = None,  # (B, K) positions of `logits` in `hidden`; None: K == T
    ) -> Tensor:
        """Calibrated logits, same shape as `logits`. Identity unless overridden.

        Args:
            logits: the backbone's logits, (B, K, V) or (N, V).
            hidden: the backbone's hidden states, (B, T, H) (or (N, H) with 2-D logits); read by `needs_hidden`
                methods only.
            attention_mask: (B, T), 1 on real tokens.
            index: (B, K) positions of `logits` in `hidden`; None: K == T.

        Returns:
            Calibrated logits, same shape as `logits`.
        """
        return logits

    def calibrate_confidence(self, confidence: Tensor | np.ndarray) -> Tensor | np.ndarray:
        """Map a top-1 confidence in [0, 1] to a calibrated one. Identity unless overridden.

        Args:
            confidence: top-1 confidences, any shape.

        Returns:
            The mapped confidences, same shape (and, for the binning methods, same kind: tensor or array).
        """
        return confidence

    def apply(self, logits: Tensor, hidden: Tensor | None = None, *, attention_mask: Tensor | None = None,
              index: Tensor | None = None) -> Tensor:
        """Calibrated logits (same shape) in float32; `hidden` is passed on only to methods that read it.

        Args:
            logits: the backbone's logits, (B, K, V) or (N, V).
            hidden: the backbone's hidden states, (B, T, H) (or (N, H) with 2-D logits), or None for methods that
                do not read them.
            attention_mask: (B, T), 1 on real tokens.
            index: (B, K) positions of `logits` in `hidden`; None: K == T.

        Returns:
            Calibrated logits, same shape as `logits`, float32.

        Raises:
            ATSError: if the calibrator returns another shape, or is not fitted or lacks the hidden states it needs.
        """
        if self.needs_hidden:
            q = self.calibrate(logits, hidden, attention_mask=attention_mask, index=index)
        else:
            q = self.calibrate(logits)
        if tuple(q.shape) != tuple(logits.shape):
            raise ATSError(f"calibrator {type(self).__name__} returned logits of shape {tuple(q.shape)}, "
                           f"expected {tuple(logits.shape)}")
        return q.float()

    def map_confidence(self, confidence: Tensor | np.ndarray) -> np.ndarray:
        """A top-1 confidence from calibrated logits, through the binning map when there is one; float64 in [0, 1].

        Args:
            confidence: top-1 confidences of the calibrated logits, any shape.

        Returns:
            The (mapped) confidences, same shape, float64, clipped to [0, 1].
        """
        conf = _numpy(confidence)
        if self.maps_confidence:
            conf = _numpy(self.calibrate_confidence(conf)).reshape(np.shape(confidence))
        return np.clip(conf, 0.0, 1.0)

    def top1(self, logits: Tensor, hidden: Tensor | None = None, **where) -> tuple[np.ndarray, Tensor]:
        """(calibrated top-1 confidence (...,) float64, argmax of the calibrated logits (...,)) at `logits`'
        positions (vector scaling can move the argmax, so the prediction is per calibrator).

        Args:
            logits: the backbone's logits, (B, K, V) or (N, V).
            hidden: the backbone's hidden states, as for `apply`.
            **where: `attention_mask` and `index`, as for `apply`.

        Returns:
            (confidence, prediction): float64 array and long tensor, both of shape `logits.shape[:-1]`.
        """
        conf, pred = top1_confidence(self.apply(logits, hidden, **where))
        return self.map_confidence(conf), pred

    # --- placement and checks ---------------------------------------------------------------------------------------
    def to(self, device) -> "Calibrator":
        """Move any tensors to `device`; returns self.

        Args:
            device: a torch device or its name.

        Returns:
            self.
        """
        return self

    def check_backbone(self, backbone) -> None:
        """Refuse a backbone this calibrator was not fitted for (sizes, identity). Nothing to check by default.

        Args:
            backbone: the `Backbone` the calibrator is to be applied to.

        Raises:
            ATSError: in subclasses, on a mismatch.
        """

    @property
    def label(self) -> str:
        """The method's name in tables and results."""
        return self.name

    def digest(self) -> str:
        """A hash of everything the calibrator is (type, config, fitted tensors): results computed with it are
        reused only for the same digest.

        Returns:
            16 hex digits of a sha256.
        """
        h = hashlib.sha256(json.dumps({"type": self.name, **self.config()}, sort_keys=True, default=str).encode())
        for key, tensor in sorted(self.state_tensors().items()):
            h.update(key.encode())
            h.update(tensor.detach().cpu().double().contiguous().numpy().tobytes())
        return h.hexdigest()[:16]


def _numpy(x) -> np.ndarray:
    if isinstance(x, Tensor):
        return x.detach().double().cpu().numpy()
    return np.asarray(x, dtype=np.float64)


class Uncalibrated(Calibrator):
    """The backbone as it is: the reference row of every table."""

    name = "none"

    def fit(self, chunks: LogitChunks) -> "Uncalibrated":
        """Nothing to fit: `chunks` is ignored; returns self."""
        return self

    @property
    def label(self) -> str:
        """The row name in tables: "uncalibrated"."""
        return "uncalibrated"


def top1_confidence(logits: Tensor) -> tuple[Tensor, Tensor]:
    """(confidence, argmax) of softmax(logits) over the last axis, computed in float32.

    Args:
        logits: (..., V).

    Returns:
        (confidence (...,) float32, argmax (...,) long).
    """
    probs = torch.softmax(logits.float(), dim=-1)
    conf, pred = probs.max(dim=-1)
    return conf, pred
