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
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import ClassVar, Protocol

import numpy as np
import torch
from safetensors.torch import load_file, save_file
from torch import Tensor

from ..errors import ATSError
from ..hub import resolve_folder
from ..io import atomic_dir, atomic_file, read_json

CONFIG_NAME = "calibrator_config.json"
WEIGHTS_NAME = "model.safetensors"

# A re-iterable source of token-level fitting data: each call yields chunks of
# logits (N, V) float32 and next-token labels (N,) int64 for response tokens only.
LogitChunks = Callable[[], Iterator[tuple[Tensor, Tensor]]]


class FitSource(Protocol):
    """What a calibrator is fitted on; the workflow layer provides it (`ats.workflows.pipeline.FeatureSource`).

    logit_chunks: token-level (logits, labels) chunks of the response tokens;
    store / logits_fn: the sequences of hidden states and the output layer, for methods that read hidden states;
    backbone / hidden_size: what the calibrator is sized for;
    train_head(calibrator): train an ATS-family head with the run's training config (loss, data, steps, schedule);
    sketch (optional): a `LogitSketch` of the same tokens as logit_chunks, built once; the global-temperature,
    binning and Thermometer methods fit on it instead of passing over the logits again; with it, sequence_ids (N,)
    gives the sequence of each of its rows.
    summary (optional): the scale summary rows (N, D) of the same tokens as logit_chunks, in the same order
    (`ats.model.scale_summary`, stored with the features), or None; temperature scaling and Thermometer evaluate
    F(s) = logsumexp(s z) and its derivatives from it without any pass over the vocabulary (`fits_on_summary`).
    """

    logit_chunks: LogitChunks
    fitted: dict  # name -> calibrator already fitted on this source (e.g. scaling-binning reuses the temperature)
    store: object
    logits_fn: Callable[[Tensor], Tensor]
    backbone: object
    hidden_size: int

    def train_head(self, calibrator: "Calibrator") -> None:
        """Train an ATS-family head in place with the run's training config.

        Args:
            calibrator: the calibrator whose head is trained (`trains_head` is True).
        """
        ...


class Calibrator(ABC):
    """Base class: fit, apply (logits, then the confidence map), move, check against a backbone, save and load."""

    name: ClassVar[str]  # the registry name; also the "type" saved in calibrator_config.json
    needs_hidden: ClassVar[bool] = False  # reads the backbone's hidden states (ATS, Thermometer)
    maps_confidence: ClassVar[bool] = False  # maps the top-1 confidence (binning methods)
    trains_head: ClassVar[bool] = False  # trained by the ATS trainer with the run's TrainingConfig (ATS, controls)
    fits_on_sketch: ClassVar[bool] = False  # fit_source uses the source's LogitSketch when it has one
    fits_on_summary: ClassVar[bool] = False  # fit_source uses the source's scale summary when it has one
    token_head: ClassVar[bool] = False  # a per-token head: log_scale(h, mask, cache=) and scale(tau) (ATS family)
    prompt_hidden: ClassVar[bool] = False  # reads only the prompt's last hidden state (Thermometer)

    # --- fitting ----------------------------------------------------------------------------------------------------
    @classmethod
    def for_source(cls, source: FitSource, **options) -> "Calibrator":
        """A fresh calibrator sized for the data in `source` (most need nothing from it).

        Args:
            source: the data it will be fitted on.
            **options: the class's keyword-only constructor options.

        Returns:
            The unfitted calibrator.
        """
        return cls(**options)

    def fit_source(self, source: FitSource) -> "Calibrator":
        """Fit on `source`; token-level methods use its logit chunks. Returns self.

        Args:
            source: the fitting data.

        Returns:
            self, fitted.

        Raises:
            ATSError: if the data are malformed or empty.
        """
        return self.fit(source.logit_chunks)

    def fit(self, chunks: LogitChunks) -> "Calibrator":
        """Fit on token-level (logits, labels) chunks; returns self.

        Args:
            chunks: a `LogitChunks` callable yielding logits (N, V) and labels (N,).

        Returns:
            self, fitted (in subclasses fitted on chunks).

        Raises:
            ATSError: always here: a method that is not fitted on logit chunks (use `fit_source`).
        """
        raise ATSError(f"calibrator {self.name!r} is not fitted on logit chunks; use fit_source()")

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

    # --- persistence: JSON config + safetensors, never pickle -------------------------------------------------------
    def config(self) -> dict:
        """JSON-serialisable settings and fitted scalars (tensors go to `state_tensors`).

        Returns:
            {option: value}, written to calibrator_config.json beside "type".
        """
        return {}

    def state_tensors(self) -> dict[str, Tensor]:
        """The fitted tensors, saved to model.safetensors (none by default).

        Returns:
            {name: tensor}.
        """
        return {}

    def load_state(self, config: dict, tensors: dict[str, Tensor]) -> None:
        """Restore from what `config` and `state_tensors` wrote.

        Args:
            config: the saved calibrator_config.json without its "type".
            tensors: the saved tensors ({} when there is no model.safetensors).

        Raises:
            ATSError: in subclasses, if a value or tensor is missing or invalid.
        """

    def save_pretrained(self, directory: str | Path) -> None:
        """Write `calibrator_config.json` (with "type") and, if there are tensors, `model.safetensors`, atomically.

        Args:
            directory: the folder to write; an existing one is replaced.

        Raises:
            ATSError: if the calibrator is not fitted.
        """
        with atomic_dir(directory) as tmp:
            (tmp / CONFIG_NAME).write_text(json.dumps({"type": self.name, **self.config()}, indent=2, sort_keys=True))
            tensors = {k: v.detach().contiguous().cpu() for k, v in self.state_tensors().items()}
            if tensors:
                save_file(tensors, str(tmp / WEIGHTS_NAME))

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
        from ..hub import model_card

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
        import tempfile

        from ..hub import upload_folder

        with tempfile.TemporaryDirectory() as tmp:
            folder = self.save_for_hub(Path(tmp) / "calibrator", repo_id, datasets=datasets, evidence=evidence)
            return upload_folder(folder, repo_id, private=private, token=token, commit_message=commit_message)

    @classmethod
    def from_pretrained(cls, directory: str | Path, backbone=None) -> "Calibrator":
        """Load a saved calibrator of this type; with `backbone`, check that it matches.

        Args:
            directory: the calibrator's folder, or a Hub repo id (owner/name) when no such folder exists.
            backbone: the `Backbone` it will be applied to, or None to skip the check.

        Returns:
            The loaded calibrator.

        Raises:
            ATSError: if the config or weights are missing or invalid, the saved "type" is not this class's, or
                the backbone does not match.
        """
        directory = resolve_folder(directory)
        config = read_config(directory)
        if config.get("type") != cls.name:
            raise ATSError(f"{directory / CONFIG_NAME}: field 'type' is {config.get('type')!r}, expected {cls.name!r}")
        tensors = read_tensors(directory) if (directory / WEIGHTS_NAME).exists() else {}
        obj = cls.__new__(cls)
        obj.load_state({k: v for k, v in config.items() if k != "type"}, tensors)
        if backbone is not None:
            obj.check_backbone(backbone)
        return obj


def read_config(directory: Path) -> dict:
    """A calibrator folder's config; a folder without one gets a hint at where heads are saved.

    Args:
        directory: the calibrator's folder.

    Returns:
        The parsed calibrator_config.json, "type" included.

    Raises:
        ATSError: if the file is missing (a run folder is named as such) or is not a JSON object.
    """
    path = directory / CONFIG_NAME
    if directory.is_dir() and not path.exists() and (directory / "head" / CONFIG_NAME).exists():
        raise ATSError(f"{directory}: a run folder, not a calibrator; the head is in {directory / 'head'}")
    config = read_json(path)
    if not isinstance(config, dict):
        raise ATSError(f"{path}: expected a JSON object, got {type(config).__name__}")
    return config


def read_tensors(directory: Path) -> dict[str, Tensor]:
    """The tensors of `model.safetensors`, with one-line errors for a missing or corrupt file.

    Args:
        directory: the calibrator's folder.

    Returns:
        {name: tensor}, on the CPU.

    Raises:
        ATSError: if the file is missing, corrupt or truncated.
    """
    path = directory / WEIGHTS_NAME
    try:
        return load_file(str(path))
    except FileNotFoundError:
        raise ATSError(f"{path}: file not found") from None
    except Exception as err:  # safetensors raises its own error types for corrupt files
        raise ATSError(f"{path}: corrupt or truncated safetensors file ({err})") from None


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

    def fit_source(self, source: FitSource) -> "Uncalibrated":
        """Nothing to fit: `source` is ignored; returns self."""
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
