"""The ATS calibrator: a small head reads the frozen backbone's hidden states and rescales its logits per token.

    tau = head(h)                      # (B, T)   log-scale per token: tau = log s = log(1 / T)  (`log_scale`)
    s   = exp(tau).clamp(max_scale)    # (B, T)   s > 0, so argmax is unchanged and accuracy is untouched
    q   = z * s[..., None]             # (B, T, V)

Saved like a peft adapter: a folder with `calibrator_config.json` (head type and sizes, clamp, the base model and its
revision, hidden size, vocabulary size, library version, and the training settings for the record) and
`model.safetensors` (the head's weights). Loading checks the head against the backbone and refuses a mismatch.

The same class carries the controls: a `constant` head is one global temperature trained with ATS's own loss, data
and schedule (`selective-temperature` in the registry), a `linear` head the shallow per-token variant
(`selective-linear`); `method` records which of them a saved folder holds.
"""

from __future__ import annotations

import dataclasses
import warnings

import torch
from torch import Tensor, nn

from ..errors import ATSError
from ..model.backbone import Backbone
from ..model.heads import HeadConfig, build_head, tau_at
from .ats_config import ATSConfig
from .base import Calibrator, FitSource
from .saving import load_module

__all__ = ["ATSCalibrator", "ATSConfig"]


class ATSCalibrator(Calibrator):
    """Adaptive Temperature Scaling: per-token temperatures predicted from the backbone's hidden states.

    Args:
        config: the head and the backbone it is sized for; the head is built from `config.head` at identity.
    """

    name = "ats"
    Config = ATSConfig
    needs_hidden = True
    token_head = True
    weights_metadata = {"format": "pt"}

    def __init__(self, config: ATSConfig) -> None:
        self.config_ = config
        self.head: nn.Module = build_head(config.head)

    @classmethod
    def from_config(cls, config: ATSConfig) -> "ATSCalibrator":
        """An identity head built from `config` (the loading path)."""
        return cls(config)

    @classmethod
    def for_backbone(cls, backbone: Backbone, *, head_type: str = "transformer", seed: int = 0,
                     **options) -> "ATSCalibrator":
        """A fresh (identity) calibrator sized for `backbone`, initialised from `seed` (the global RNG is left
        untouched); options go to ATSConfig / HeadConfig.

        Args:
            backbone: the backbone the head reads; gives the sizes, name and revision.
            head_type: "constant", "linear", "mlp" or "transformer".
            seed: the seed of the head's initial weights.
            **options: fields of `HeadConfig` (sizes) or of `ATSConfig` (`max_scale`, `method`, `training`).

        Returns:
            The untrained calibrator.

        Raises:
            ATSError: if an option is invalid.
        """
        head, config_options = cls.head_config(backbone.hidden_size, head_type=head_type, **options)
        config = ATSConfig(head=head, hidden_size=backbone.hidden_size, vocab_size=backbone.vocab_size,
                           base_model=backbone.name, revision=backbone.revision, **config_options)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            return cls(config)

    @staticmethod
    def head_config(hidden_size: int, *, head_type: str = "transformer", **options) -> tuple[HeadConfig, dict]:
        """The `HeadConfig` that `for_backbone(head_type=..., **options)` builds for a backbone of `hidden_size`, and
        the options left for `ATSConfig` (read before any model loads, to check a saved head against a request)."""
        head_fields = {f.name for f in dataclasses.fields(HeadConfig)}
        head = HeadConfig(head_type=head_type, hidden_size=hidden_size,
                          **{k: v for k, v in options.items() if k in head_fields})
        return head, {k: v for k, v in options.items() if k not in head_fields}

    @classmethod
    def for_source(cls, source: FitSource, **options) -> "ATSCalibrator":
        """A fresh calibrator sized for `source.backbone` (see `for_backbone`).

        Args:
            source: the fitting data; only its backbone is read.
            **options: as for `for_backbone`.

        Returns:
            The untrained calibrator.
        """
        return cls.for_backbone(source.backbone, **options)

    @property
    def label(self) -> str:
        """The method's name in tables: "ats", "selective-temperature" or "selective-linear"."""
        return self.config_.method

    # --- the method --------------------------------------------------------------------------------------------
    def log_scale(self, hidden: Tensor, attention_mask: Tensor | None = None, cache=None) -> Tensor:
        """tau (B, T) from hidden states (B, T, H): the log of the factor on the logits, tau = log s = log(1 / T)
        (docs/method.md, "Names"); `scale(tau)` gives s.

        Args:
            hidden: (B, T, H) hidden states, moved to the head's device and dtype.
            attention_mask: (B, T) (or past + new positions when decoding with `cache`), 1 on real tokens.
            cache: the transformer head's `HeadCache` between decoding steps, or None.

        Returns:
            tau (B, T) float32 per token (0 on padding: s = 1).
        """
        param = next(self.head.parameters())
        return self.head(hidden.to(param.device, param.dtype), attention_mask, cache=cache)

    # --- training (`ats.training`: the one loop trains `trainable` on `scales_at`, then `record_training`) -------
    def _fit(self, source: FitSource) -> None:
        """Refuse: an ATS-family head is trained with the run's training config by `ats.training` (`train_ats` on
        instruction features, `train_on_answers` on answers; `ats train`), not fitted on a source.

        Raises:
            ATSError: always.
        """
        raise ATSError(f"{self.label}: a head is trained, not fitted: use ats.training.train_ats (ats train) or "
                       "ats.workflows.pipeline.fit_head")

    @property
    def trainable(self) -> torch.nn.Module:
        """The module training updates: the head."""
        return self.head

    def scales_at(self, hidden: Tensor, attention_mask: Tensor, index: Tensor, scored: Tensor) -> tuple[Tensor, Tensor]:
        """(s (B, K), penalty ()) at positions `index` (B, K) of sequences `hidden` (B, T, H), differentiable: the
        head's per-token scales there (`tau_at`: the transformer head computes only those queries); no penalty.

        Args:
            hidden: (B, T, H) hidden states.
            attention_mask: (B, T), 1 on real tokens.
            index: (B, K) positions; entries where `scored` is False are padding.
            scored: (B, K) bool, the real entries of `index`.

        Returns:
            (s (B, K) float32, a zero penalty).
        """
        param = next(self.head.parameters())
        tau = tau_at(self.head, hidden.to(param.device, param.dtype), attention_mask.to(param.device),
                     index.to(param.device))
        return self.scale(tau.float()), torch.zeros((), device=param.device)

    def record_training(self, record: dict, final_loss: float | None = None) -> None:
        """Keep the training record in the config, saved with the head (the loss history goes elsewhere:
        training_history.json)."""
        self.config_.training = record

    def temperature(self, hidden: Tensor, attention_mask: Tensor | None = None, cache=None) -> Tensor:
        """Deprecated name of `log_scale` (it returns tau = log(1 / T), not a temperature T); kept for callers
        written before the rename."""
        warnings.warn("ATSCalibrator.temperature() returns tau = log(1/T) and is renamed log_scale()",
                      DeprecationWarning, stacklevel=2)
        return self.log_scale(hidden, attention_mask, cache=cache)

    def scale(self, tau: Tensor) -> Tensor:
        """s = exp(tau), clamped to max_scale: the factor applied to the logits.

        Args:
            tau: log-scales, any shape ((B, T) from `log_scale`).

        Returns:
            s, same shape.
        """
        return torch.exp(tau).clamp(max=self.config_.max_scale)

    def calibrate(self, logits: Tensor, hidden: Tensor | None = None, *, attention_mask: Tensor | None = None,
                  index: Tensor | None = None) -> Tensor:
        """Calibrated logits q = z * s at the positions of `logits` (B, K, V) (K == T when `index` is None).

        The head runs without gradients.

        Args:
            logits: z, (B, K, V), or (N, V) with hidden (N, H) (each row one position).
            hidden: (B, T, H) hidden states of the whole sequence, or (N, H).
            attention_mask: (B, T), 1 on real tokens.
            index: (B, K) positions of `logits` in `hidden`; None: K == T.

        Returns:
            q, same shape as `logits`.

        Raises:
            ATSError: if `hidden` is None or its last dimension is not the head's hidden size.
        """
        if hidden is None:
            raise ATSError("ATS needs the backbone's hidden states: pass hidden=(B, T, H)")
        if hidden.shape[-1] != self.config_.hidden_size:
            raise ATSError(f"hidden: shape {tuple(hidden.shape)}, but this head reads hidden states of size "
                           f"{self.config_.hidden_size} (those of {self.config_.base_model or 'its backbone'})")
        squeeze = logits.dim() == 2  # (N, V) with hidden (N, H): one position per row
        if squeeze:
            logits, hidden = logits[:, None], hidden[:, None]
        with torch.no_grad():
            s = self.scale(self.log_scale(hidden, attention_mask))  # (B, T)
        if index is not None:
            s = s.gather(1, index.to(s.device))  # (B, K)
        q = logits * s.to(logits.device, logits.dtype).unsqueeze(-1)
        return q[:, 0] if squeeze else q

    # --- checks and persistence --------------------------------------------------------------------------------
    def check_backbone(self, backbone: Backbone) -> None:
        """Refuse a head trained for another backbone (hidden size, vocabulary, base model, revision).

        Args:
            backbone: the backbone the head is to read.

        Raises:
            ATSError: naming the first of those that differs.
        """
        c = self.config_
        if c.hidden_size != backbone.hidden_size:
            raise ATSError(f"calibrator expects hidden size {c.hidden_size}, backbone {backbone.name} has "
                           f"{backbone.hidden_size}")
        if c.vocab_size != backbone.vocab_size:
            raise ATSError(f"calibrator expects vocabulary size {c.vocab_size}, backbone {backbone.name} has "
                           f"{backbone.vocab_size}")
        if c.base_model != backbone.name:
            raise ATSError(f"calibrator was trained for base model {c.base_model!r}, not {backbone.name!r}")
        if c.revision != backbone.revision:
            raise ATSError(f"calibrator was trained on {c.base_model} revision {c.revision!r}, the backbone is "
                           f"revision {backbone.revision!r}")

    def to(self, device) -> "ATSCalibrator":
        """Move the head to `device` (a torch device or its name); returns self."""
        self.head.to(device)
        return self

    def state_tensors(self) -> dict[str, Tensor]:
        """The head's weights.

        Returns:
            The head's state dict.
        """
        return dict(self.head.state_dict())

    def restore(self, fitted: dict, tensors: dict[str, Tensor]) -> None:
        """Load the head's saved weights (eval mode).

        Raises:
            ATSError: if the weights are missing or do not match the config.
        """
        load_module(self.head, tensors)
