"""A correctness probe: P(the model's answer is right) from its hidden states, beside a temperature for its tokens.

Every other calibrator rescales logits, which moves the level of confidence but barely changes which answers rank
above which. A probe reads what the model "knows" about its own answer instead (Orgad et al., ICLR 2025; CCPS,
EMNLP 2025): the outputs of a few decoder layers at the answer (`ats.training.answers.PROBE_VIEWS`: the prompt's last
position, the mean and the last of the answer's own tokens) and the answer's uncalibrated confidence, standardized,
into a logistic regression trained with the log loss (a proper scoring rule) on the model's own labelled answers
(`ats.training.probe_fit` chooses the layers, views and L2 strength on held-out pool tasks and fits it). The L2
penalty shrinks the hidden-state weights only: the confidence's weight is left free, so a probe whose hidden
states carry nothing that transfers falls back to Platt scaling of the answer's confidence. With no layers it IS
that: the confidence-only setting the choice can pick.

A probe does not change logits: the token half of the artifact is temperature scaling (this class extends it), so
every route that serves a temperature serves a probe's token probabilities, and the routes that compute an answer's
confidence (`ats eval` on answer sets, `ats serve`, `ats generate`) ask `answer_confidence`.

    probe.answer_confidence(views, confidence)   # views (N, L, 3, H) at probe.layers, confidence (N,) -> (N,)
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from ..config import option
from ..errors import ATSError
from ..model.layers import ANSWER_VIEWS
from .temperature import TemperatureConfig, TemperatureScaling

VIEWS = ANSWER_VIEWS  # the order answer sets store them in
EPS = 1e-6  # the answer confidence's clip before its logit


@dataclass
class ProbeConfig(TemperatureConfig):
    """The probe's options (chosen by `probe_fit.fit_probe` when left empty) and its backbone; the temperature's."""

    layers: list = option(list, "decoder layers read (0-based outputs); empty: chosen on held-out pool tasks (a "
                                "fitted probe without layers reads the confidence alone)", cli=False)
    views: list = option(list, f"positions read, of {', '.join(VIEWS)}; empty: chosen on held-out pool tasks",
                         cli=False)
    c: float = option(0.0, "C, the inverse L2 strength on the hidden-state features (the confidence's weight is "
                           "not shrunk); 0: chosen on held-out pool tasks", low=0)
    with_confidence: bool = option(True, "also read the logit of the answer's uncalibrated confidence")
    hidden_size: int = option(0, "H, the backbone's hidden size", cli=False, low=0)
    base_model: str = option("", "the backbone it was fitted on", cli=False)
    revision: str = option("", "that backbone's revision", cli=False)
    training: dict = option(dict, "what it was fitted on (the answer record: tasks, sizes, loss)", cli=False)


class CorrectnessProbe(TemperatureScaling):
    """Answer confidence by a logistic probe on hidden states; token probabilities by one temperature.

    Options: `ProbeConfig`, keyword-only.
    """

    name = "probe"
    Config = ProbeConfig
    answer_probe = True
    fitted_keys = ("temperature", "selection")
    fitted_attributes = ("temperature", "weight")
    weight: Tensor | None = None  # (D,) on standardized features
    bias: Tensor | None = None  # ()
    mean: Tensor | None = None  # (D,) the training features' mean
    scale: Tensor | None = None  # (D,) and standard deviation (1 where constant)
    selection: dict | None = None  # how layers, views and C were chosen (`probe_fit`), for the record

    def __init__(self, **options) -> None:
        super().__init__(**options)
        bad = [v for v in self.views if v not in VIEWS]
        if bad:
            raise ATSError(f"probe views {bad}: each must be one of {', '.join(VIEWS)}")
        self.selection = {}

    # --- the method ---------------------------------------------------------------------------------------------
    def features(self, views: Tensor, confidence: Tensor | np.ndarray) -> Tensor:
        """(N, D) float32: the chosen views of the chosen layers, flattened, and the confidence's logit (last).

        Args:
            views: (N, L, 3, H) the `VIEWS` of exactly `self.layers`, in that order.
            confidence: (N,) the answers' uncalibrated confidence.
        """
        if views.dim() != 4 or views.shape[1:3] != (len(self.layers), len(VIEWS)):
            raise ATSError(f"probe: expected views (N, {len(self.layers)}, {len(VIEWS)}, H), got {tuple(views.shape)}")
        picked = views[:, :, [VIEWS.index(v) for v in self.views]].float().flatten(1)  # (N, L * V' * H)
        if not self.with_confidence:
            return picked
        p = torch.as_tensor(np.nan_to_num(np.asarray(confidence, dtype=np.float64), nan=0.5))  # empty: no signal
        p = p.clamp(EPS, 1 - EPS)
        return torch.cat([picked, torch.log(p / (1 - p)).float()[:, None]], dim=1)

    def answer_confidence(self, views: Tensor, confidence: Tensor | np.ndarray) -> np.ndarray:
        """P(correct) (N,) float64 of answers given their views (N, L, 3, H) at `self.layers` and their uncalibrated
        confidence (N,)."""
        self.check_fitted()
        x = (self.features(views, confidence) - self.mean) / self.scale
        return torch.sigmoid(x.double() @ self.weight.double() + self.bias.double()).numpy()

    def set_weights(self, weight: Tensor, bias: float, mean: Tensor, scale: Tensor) -> None:
        """The fitted logistic regression on standardized features (`probe_fit`)."""
        self.weight, self.bias = weight.float(), torch.tensor(float(bias))
        self.mean, self.scale = mean.float(), scale.float()

    # --- the fitted state, the backbone -------------------------------------------------------------------------
    def state_tensors(self) -> dict[str, Tensor]:
        """The logistic regression and the standardization (model.safetensors)."""
        self.check_fitted()
        return {"weight": self.weight, "bias": self.bias, "mean": self.mean, "scale": self.scale}

    def restore(self, fitted: dict, tensors: dict[str, Tensor]) -> None:
        """Set the saved temperature, selection record and tensors.

        Raises:
            ATSError: if one is missing or the tensors' sizes disagree.
        """
        super().restore(fitted, tensors)
        missing = [k for k in ("weight", "bias", "mean", "scale") if k not in tensors]
        if missing:
            raise ATSError(f"probe: missing tensors {', '.join(missing)}")
        sizes = {tensors[k].numel() for k in ("weight", "mean", "scale")}
        if len(sizes) != 1:
            raise ATSError(f"probe: weight, mean and scale differ in size ({sorted(sizes)})")
        self.set_weights(tensors["weight"], float(tensors["bias"]), tensors["mean"], tensors["scale"])
        self.selection = fitted.get("selection") or {}

    def check_backbone(self, backbone) -> None:
        """Refuse a backbone other than the one the probe was fitted on (hidden size, name, revision).

        Raises:
            ATSError: naming what differs.
        """
        for field, ours, theirs in (("hidden size", self.hidden_size, backbone.hidden_size),
                                    ("base model", self.base_model, backbone.name),
                                    ("revision", self.revision, backbone.revision)):
            if ours != theirs:
                raise ATSError(f"probe fitted on {field} {ours!r}, backbone {backbone.name} has {theirs!r}")

    @property
    def label(self) -> str:
        """The row name in tables: "probe"."""
        return "probe"
