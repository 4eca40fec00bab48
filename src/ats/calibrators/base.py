"""The one contract of every calibrator, ATS included: its options (`Config`), `fit(source)`, `calibrate`, its fitted
state, and saving, loading and the Hub, all in one base class (as scikit-learn's estimators and peft's models keep
theirs).

A calibrator maps a backbone's logits to calibrated logits (scaling methods) and may map a top-1 confidence to a
calibrated confidence (binning methods, applied after the logits map). Post-hoc methods are fitted on the response
tokens ATS trains on, given as a `FitSource`; the methods that learn a network through the training loop (the ATS
family; Thermometer on answers) are trained by `ats.training` through their training interface (`trainable`,
`scales_at`, `record_training`). Every evaluation applies them with `apply` / `map_confidence`.

    cal = build_calibrator("temperature").fit(source)           # a FitSource, or a LogitChunks callable
    q = cal.apply(z, hidden, attention_mask=mask, index=index)  # (B, K, V) calibrated logits
    conf = cal.map_confidence(top1)                             # binning methods map the confidence too
    cal.save_pretrained(dir); load_calibrator(dir)              # JSON + safetensors, never pickle
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import numpy as np
import torch
from torch import Tensor

from .. import hub
from ..config import ConfigMixin
from ..errors import ATSError
from ..hub import model_card, resolve_folder
from ..io import atomic_file
from . import saved_class  # the registry: the package's __init__, loaded before this module
from .fit_source import ChunkSource, FitSource, LogitChunks, as_source
from .saving import CONFIG_NAME, WEIGHTS_NAME, read_config, read_tensors, write_folder

__all__ = ["CONFIG_NAME", "WEIGHTS_NAME", "Calibrator", "ChunkSource", "FitSource", "LogitChunks", "NoOptions",
           "Uncalibrated", "read_config", "read_tensors", "top1_confidence"]


@dataclass
class NoOptions(ConfigMixin):
    """The config of a calibrator without options."""


class Calibrator:
    """Base class: options, capabilities, fitting, applying, fitted state, saving and loading, the Hub.

    Options live once, in `Config`: the keyword-only constructor takes them, `config_` holds them (also readable as
    attributes: `cal.n_bins`). The fitted state is the attributes named in `fitted_keys` (scalars, saved in the
    config) and the tensors of `state_tensors()` (saved to model.safetensors); `restore` sets both back.

    What a method needs is declared by the class capabilities below, read by the pipeline, the decoder, the server,
    the lm-eval and vLLM bridges, and nowhere else.
    """

    name: ClassVar[str]  # the registry name; also the "type" saved in calibrator_config.json
    Config: ClassVar[type[ConfigMixin]] = NoOptions  # the options: defaults, checks and help in one place
    fitted_attributes: ClassVar[tuple[str, ...]] = ()  # None until fitted (`is_fitted`)
    fitted_keys: ClassVar[tuple[str, ...]] = ()  # attributes saved in the config beside the options (fitted scalars)
    # safetensors metadata of the weights file; ATS heads write {"format": "pt"} (one key: safetensors writes its
    # metadata map in a per-process random order, so two keys would give the same weights different file bytes)
    weights_metadata: ClassVar[dict | None] = None

    # --- capabilities: the one place they are declared ------------------------------------------------------------
    needs_hidden: ClassVar[bool] = False  # reads the backbone's hidden states (ATS, Thermometer)
    token_head: ClassVar[bool] = False  # a per-token head: log_scale(h, mask, cache=) and scale(tau); trained by the
    # training loop with the run's TrainingConfig, never fitted (the ATS family)
    prompt_hidden: ClassVar[bool] = False  # reads only the prompt's last hidden state (Thermometer)
    maps_confidence: ClassVar[bool] = False  # maps the top-1 confidence (binning methods)
    fits_on_summary: ClassVar[bool] = False  # `fit` reads the source's scale summary when it has one (the
    # fingerprints record that route)
    answer_probe: ClassVar[bool] = False  # gives an answer's confidence from hidden states of several layers at it
    # (`answer_confidence(views, confidence)`: the correctness probe); its logits map is the rest of the class

    config_: ConfigMixin = NoOptions()  # the instance's options (a class without options shares this empty one)

    def __init__(self, **options) -> None:
        self.config_ = self.Config(**options)

    def __getattr__(self, name: str):  # options read as attributes: cal.n_bins is cal.config_.n_bins
        if name in self.config_.__dataclass_fields__:
            return getattr(self.config_, name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    @classmethod
    def for_source(cls, source: FitSource, **options) -> "Calibrator":
        """A fresh calibrator sized for the data in `source`: an option `hidden_size` of the config, when not given,
        is the source's.

        Args:
            source: the data it will be fitted on.
            **options: the class's keyword-only constructor options.

        Returns:
            The unfitted calibrator.
        """
        if "hidden_size" in cls.Config.__dataclass_fields__ and "hidden_size" not in options:
            options = {**options, "hidden_size": source.hidden_size}
        return cls(**options)

    @classmethod
    def position_refusal(cls) -> str | None:
        """Why this method cannot run where logits are calibrated one position at a time from that position's
        logits and the hidden states up to it, with each prompt's end known (lm-eval's (context, continuation)
        requests; vLLM, told by `integrations.vllm.runner_patch`); None when it can (the ATS family, Thermometer,
        temperature and vector scaling, none).

        Returns:
            The reason in a few words, to quote in an error, or None.
        """
        if cls.maps_confidence:
            return "maps the top-1 confidence, not the logits"
        if cls.needs_hidden and not cls.token_head and not cls.prompt_hidden:
            return "reads hidden states neither per token nor at the prompt's end"
        return None

    # --- fitting ----------------------------------------------------------------------------------------------------
    def fit(self, source: FitSource | LogitChunks) -> "Calibrator":
        """Fit on `source`; returns self.

        Args:
            source: a `FitSource`, or a `LogitChunks` callable yielding logits (N, V) and labels (N,) (the
                token-level methods fit on it alone).

        Returns:
            self, fitted.

        Raises:
            ATSError: if the data are malformed or empty, or the method is not fitted this way (the ATS family is
                trained by `ats.training`).
        """
        self._fit(as_source(source))
        return self

    def _fit(self, source: FitSource) -> None:
        """Fit on `source` (a `FitSource`); every fitted method defines it. Nothing to fit by default."""

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
            raise ATSError(f"{type(self).__name__}: not fitted; call fit() or from_pretrained() first")

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

    # --- the fitted state -------------------------------------------------------------------------------------------
    def config(self) -> dict:
        """The options and the fitted scalars (`fitted_keys`), JSON-serialisable; tensors go to `state_tensors`.

        Returns:
            {option or fitted key: value}, written to calibrator_config.json beside "type".

        Raises:
            ATSError: if not fitted.
        """
        self.check_fitted()
        return {**self.config_.to_dict(), **{key: getattr(self, key) for key in self.fitted_keys}}

    def state_tensors(self) -> dict[str, Tensor]:
        """The fitted tensors, saved to model.safetensors (none by default).

        Returns:
            {name: tensor}.
        """
        return {}

    def restore(self, fitted: dict, tensors: dict[str, Tensor]) -> None:
        """Set the fitted state from the saved `fitted_keys` values and tensors (nothing by default).

        Raises:
            ATSError: in subclasses, if a value or tensor is missing or invalid.
        """

    @classmethod
    def from_config(cls, config: ConfigMixin) -> "Calibrator":
        """An unfitted calibrator with the options `config` (the loading path; ATS takes its config whole)."""
        return cls(**{f.name: getattr(config, f.name) for f in dataclasses.fields(config)})

    @classmethod
    def from_saved(cls, saved: dict, tensors: dict[str, Tensor], where: str = "calibrator config") -> "Calibrator":
        """Rebuild from what `config()` and `state_tensors()` wrote: the options through `Config`, the rest through
        `restore`.

        Args:
            saved: the saved calibrator_config.json without its "type".
            tensors: the saved tensors ({} when there is no model.safetensors).
            where: the config's file, quoted in errors.

        Returns:
            The calibrator, fitted as it was saved.

        Raises:
            ATSError: if an option is missing, unknown or invalid, or a fitted value or tensor is.
        """
        options = {k: v for k, v in saved.items() if k not in cls.fitted_keys}
        for f in dataclasses.fields(cls.Config):
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING and f.name not in options:
                raise ATSError(f"{where}: missing field {f.name!r}")
        calibrator = cls.from_config(cls.Config.from_dict(options, where))
        calibrator.restore({k: saved[k] for k in cls.fitted_keys if k in saved}, tensors)
        return calibrator

    # --- saving and loading -----------------------------------------------------------------------------------------
    def save_pretrained(self, directory: str | Path) -> None:
        """Write `calibrator_config.json` (with "type") and, if there are tensors, `model.safetensors`, atomically.

        Args:
            directory: the folder to write; an existing one is replaced.

        Raises:
            ATSError: if the calibrator is not fitted.
        """
        write_folder(directory, self.name, self.config(), self.state_tensors(), self.weights_metadata)

    @classmethod
    def from_pretrained(cls, directory: str | Path, backbone=None) -> "Calibrator":
        """Load a saved calibrator of this class or a subclass (the one its folder names: `saved_class`); with
        `backbone`, check that it matches. `Calibrator.from_pretrained` loads any saved calibrator, and
        `ATSCalibrator.from_pretrained` also the paper's released heads.

        Args:
            directory: the calibrator's folder, or a Hub repo id (owner/name) when no such folder exists.
            backbone: the `Backbone` it will be applied to, or None to skip the check.

        Returns:
            The loaded calibrator (a network in eval mode).

        Raises:
            ATSError: naming the folder: if the config or weights are missing or invalid, the saved "type" is not
                this class's (or a subclass's), or the backbone does not match.
        """
        directory = resolve_folder(directory)
        saved = saved_class(directory)
        if not issubclass(saved, cls):
            raise ATSError(f"{directory / CONFIG_NAME}: field 'type' is {saved.name!r}, expected {cls.name!r}")
        calibrator = saved.read_folder(directory, backbone)
        if backbone is not None:
            calibrator.check_backbone(backbone)
        return calibrator

    @classmethod
    def read_folder(cls, directory: Path, backbone=None) -> "Calibrator":
        """This class's calibrator from its saved folder (the config and tensors through `from_saved`); `backbone`
        is for a class that checks it before reading large weights (`from_pretrained` checks it afterwards).

        Raises:
            ATSError: naming the folder, if the config or weights are missing or invalid.
        """
        saved = read_config(directory)
        try:
            return cls.from_saved({k: v for k, v in saved.items() if k != "type"}, read_tensors(directory),
                                  where=str(directory / CONFIG_NAME))
        except ATSError as err:  # errors of the tensors name the file; name the folder too
            if str(directory) in str(err):
                raise
            raise ATSError(f"{directory}: {err}") from None

    # --- the Hub (docs/hub.md) --------------------------------------------------------------------------------------
    def card_info(self) -> dict:
        """What a model card records about this calibrator: its type and label, and from its config the backbone
        (base_model, revision, hidden_size) and the training record, where it has them."""
        config = self.config()
        return {"type": self.name, "label": self.label, "base_model": config.get("base_model"),
                "revision": config.get("revision"), "hidden_size": config.get("hidden_size"),
                "training": config.get("training") or {}}

    def save_for_hub(self, directory: str | Path, repo_id: str, *, datasets: list[str] | None = None,
                     evidence: dict[str, dict[str, float]] | None = None) -> Path:
        """`save_pretrained(directory)` plus the model card README.md that `push_to_hub` uploads.

        Args:
            directory: the folder to write; an existing one is replaced.
            repo_id: the Hub repo the card's usage lines name (owner/name).
            datasets: the training data (Hub ids or descriptions).
            evidence: numbers to record, {row: {metric: value}} (e.g. {"held-out tokens": {"ece": 0.01}}).

        Returns:
            The folder.
        """
        directory = Path(directory)
        self.save_pretrained(directory)
        card = model_card({**self.card_info(), "repo_id": repo_id, "datasets": datasets or [], "evidence": evidence})
        with atomic_file(directory / "README.md") as f:
            f.write(card)
        return directory

    def push_to_hub(self, repo_id: str, *, datasets: list[str] | None = None,
                    evidence: dict[str, dict[str, float]] | None = None, private: bool = False,
                    token: str | None = None, commit_message: str = "Upload calibrator") -> str:
        """Upload the config, the safetensors weights and a generated model card to the Hub repo `repo_id`.

        Needs the network and a write token (`hf auth login`); `save_for_hub` writes the same folder locally.

        Args:
            repo_id: owner/name; created if it does not exist.
            datasets: the training data, recorded in the card.
            evidence: numbers recorded in the card, {row: {metric: value}}.
            private: create the repo private.
            token: a Hub token (None: the logged-in one).
            commit_message: the commit's message.

        Returns:
            The URL of the commit.

        Raises:
            ATSError: if `repo_id` is not owner/name or the upload fails.
        """
        with tempfile.TemporaryDirectory() as tmp:
            folder = self.save_for_hub(Path(tmp) / "calibrator", repo_id, datasets=datasets, evidence=evidence)
            return hub.upload_folder(folder, repo_id, private=private, token=token, commit_message=commit_message)


def _numpy(x) -> np.ndarray:
    if isinstance(x, Tensor):
        return x.detach().double().cpu().numpy()
    return np.asarray(x, dtype=np.float64)


class Uncalibrated(Calibrator):
    """The backbone as it is: the reference row of every table."""

    name = "none"

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
