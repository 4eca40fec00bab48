"""Any calibrator inside decoding: what the decoding core asks of it at prefill and at each step.

Four modes, read from the calibrator's class attributes (no type checks):

- `none` (no calibrator, or `Uncalibrated`): q = z, tau = 0.
- `head` (`token_head`: ATS, its controls, the paper's released heads): tau = log s per position from the head
  (`log_scale`), which reads the new positions' hidden states; the transformer head keeps its own KV cache in the
  batch (`HeadCache`), so a step costs the head one position. q = z * s, s = exp(tau) clamped.
- `prompt` (`prompt_hidden`: Thermometer): one temperature per prompt, read from the prompt's last hidden state at
  prefill (kept per row in the batch) and applied to every generated token, exactly as `ats eval` applies it to an
  answer (the hidden state at the position predicting its first token).
- `logits` (everything that reads only the logits: temperature, vector scaling, scaling-binning, histogram,
  isotonic): q = calibrator.apply(z) per step; a map that is one positive factor (temperature and scaling-binning:
  q = z / T; histogram and isotonic: the identity), found by probing it once, is applied as that factor, so
  decoding takes the ATS heads' shared-shift path.

Calibrators that map the top-1 confidence (`maps_confidence`: scaling-binning, histogram, isotonic) additionally map
each generated token's probability through their map (`confidence`), as the evaluation tasks do before averaging an
answer's token probabilities. `describe()` is the one line the CLI prints at start-up.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import Tensor

from ..calibrators.base import Calibrator
from ..errors import ATSError
from ..model.heads import TransformerHead
from ..model.layers import RunningAnswerViews, row_answer_views


class StepLogits:
    """One batch of positions' logits as the sampler and the scorer see them.

    z: (N, V) float32, the model's own; q: (N, V) calibrated (the same tensor when the calibrator leaves them), built
    on first use when it is z * scale (greedy decoding never needs it); scale: (N,) when q = z * scale (the
    shared-shift scoring path), else None; tau: (N,) the log-factor reported per token (ATS's tau; 0 uncalibrated),
    None for calibrators that have none.
    """

    def __init__(self, z: Tensor, q: Tensor | None = None, scale: Tensor | None = None,
                 tau: Tensor | None = None) -> None:
        self.z, self._q, self.scale, self.tau = z, q, scale, tau

    @property
    def q(self) -> Tensor:
        """(N, V) the calibrated logits."""
        if self._q is None:
            self._q = self.z * self.scale[:, None]
        return self._q

    @property
    def identity(self) -> bool:
        """Whether q is z itself (no calibration)."""
        return self._q is self.z


def calibration_mode(calibrator: Calibrator | None) -> str:
    """"none", "head", "prompt" or "logits" (see the module docstring), from the calibrator's class attributes.

    Raises:
        ATSError: for a calibrator that reads hidden states in another way than these.
    """
    if calibrator is None or calibrator.name == "none":
        return "none"
    if calibrator.token_head:
        return "head"
    if calibrator.prompt_hidden:
        return "prompt"
    if calibrator.needs_hidden:
        raise ATSError(f"calibrator {calibrator.name!r} reads hidden states in a way decoding cannot provide "
                       f"(neither a per-token head nor the prompt's last state)")
    return "logits"


class DecodingCalibration:
    """A calibrator prepared for decoding on `backbone` (checked against it and moved to its device).

    Args:
        calibrator: any loaded calibrator, or None for the model's own probabilities.
        backbone: the backbone it calibrates.

    Raises:
        ATSError: if the calibrator does not fit the backbone or cannot run in decoding.
    """

    def __init__(self, calibrator: Calibrator | None, backbone) -> None:
        self.mode = calibration_mode(calibrator)
        self.calibrator = None if self.mode == "none" else calibrator
        if self.calibrator is not None:
            self.calibrator.check_backbone(backbone)
            self.calibrator.to(backbone.device)
            head = getattr(self.calibrator, "head", None)
            if head is not None:
                head.eval()
        self.head_cached = self.mode == "head" and isinstance(self.calibrator.head, TransformerHead)
        self.maps_confidence = bool(self.calibrator is not None and self.calibrator.maps_confidence)
        self.answer_probe = bool(self.calibrator is not None and self.calibrator.answer_probe)
        self.probe_passes = 0  # answers whose probe views needed a pass of their own
        self.fixed_scale = self._fixed_scale(backbone) if self.mode == "logits" else None
        self.changes_logits = self.mode != "none" and self.fixed_scale != 1.0

    def _fixed_scale(self, backbone) -> float | None:
        """The factor s when the logits map is q = z * s with one s > 0 (temperature scaling: 1 / T; 1.0 for the
        confidence-only maps), found by probing it; None for other maps (vector scaling). Decoding then takes the
        shared-shift path of the ATS heads (`token_log_probs`) instead of a second pass over q."""
        probe = torch.linspace(0.5, 3.0, backbone.vocab_size, device=backbone.device)[None]  # (1, V) float32
        ratio = (self.calibrator.apply(probe).double() / probe.double())[0]  # (V,); exactly 1 for the identity
        s = float(ratio[0])
        return s if s > 0 and torch.allclose(ratio, ratio.new_full(ratio.shape, s), rtol=1e-6, atol=0) else None

    @property
    def label(self) -> str:
        """The calibrator's name in tables ("uncalibrated" without one)."""
        return "uncalibrated" if self.calibrator is None else self.calibrator.label

    @property
    def confidence_kind(self) -> str:
        """What a token's reported confidence is: "probability" (of the calibrated distribution) or "mapped" (that
        probability through the calibrator's binning map); "probe" when the answer's confidence is a correctness
        probe's (its tokens' are still their calibrated probabilities)."""
        return "mapped" if self.maps_confidence else "probe" if self.answer_probe else "probability"

    @property
    def probe_layers(self) -> tuple[int, ...]:
        """The decoder layers a correctness probe reads (empty without one, or for a confidence-only probe)."""
        return tuple(self.calibrator.layers) if self.answer_probe else ()

    def probe_answer(self, backbone, prompt: list[int], records: list,
                     states: RunningAnswerViews | None = None) -> float | None:
        """A finished answer's confidence by the correctness probe (None without one): its layers' views at the
        answer, and the answer's uncalibrated mean token probability. The views come from `states`, what decoding
        captured; only where those lack the answer's tokens (a stop string cut it further back than their tail) from
        one more forward pass over prompt + answer (counted in `probe_passes`)."""
        if not self.answer_probe:
            return None
        answer = [r for r in records if r.answer]
        views = states.views(len(answer)) if states is not None else None  # (L, 3, H) or None
        if views is not None:
            views = views[None].cpu()  # (1, L, 3, H), where the probe's weights are (as `row_answer_views` gives)
        else:
            self.probe_passes += 1
            views = row_answer_views(backbone, self.calibrator.layers, prompt, [r.token for r in answer])
        raw = [math.exp(r.uncalibrated) for r in answer if r.uncalibrated is not None]
        confidence = sum(raw) / len(raw) if raw else float("nan")
        return float(self.calibrator.answer_confidence(views, [confidence])[0])

    def describe(self) -> str:
        """One line: what the calibrator changes in decoding, and what it cannot do there."""
        name = self.label
        if self.mode == "none":
            return "uncalibrated: log-probabilities, sampling and confidence are the model's own"
        if self.mode == "head":
            return (f"{name}: per-token temperature from the head ({type(self.calibrator.head).__name__}"
                    f"{', with its KV cache' if self.head_cached else ''}) scales log-probabilities and sampling")
        if self.mode == "prompt":
            return (f"{name}: one temperature per prompt, read from the prompt's last hidden state at prefill, scales "
                    f"the generated tokens' log-probabilities and sampling; echoed prompt tokens get the same "
                    f"temperature, read at the prompt's end (not the temperature `ats eval` reads at an answer's "
                    f"start)")
        logits = ("scales log-probabilities and sampling" if self.changes_logits
                  else "leaves log-probabilities and sampling the model's own")
        if self.maps_confidence:
            return f"{name}: {logits}; maps each token's confidence (and the answer confidence) through its bins"
        if self.answer_probe:
            return (f"{name}: one temperature {logits}; the answer confidence is a correctness probe's P(correct) "
                    f"from layers {self.calibrator.layers} at the finished answer (read during decoding)")
        return f"{name}: {logits}"

    # --- prefill and decoding steps ---------------------------------------------------------------------------------
    @torch.no_grad()
    def prefill(self, hidden: Tensor, mask: Tensor, batch) -> Tensor | None:
        """After the prompts' forward pass: tau (G, P) of every prompt position (head mode, the head cache filled),
        or the prompt state kept in `batch.rows_state` (prompt mode: the last column's hidden state, (G, H)).

        Args:
            hidden: (G, P, H) hidden states of the left-padded prompts.
            mask: (G, P) their attention mask.
            batch: the `BatchCache` being prefilled.

        Returns:
            tau (G, P) float32 in head mode, zeros in none mode, else None.
        """
        if self.mode == "head":
            cache = batch.head if self.head_cached else None
            return self.calibrator.log_scale(hidden, mask, cache=cache).float()
        if self.mode == "prompt":
            batch.rows_state = hidden[:, -1]  # (G, H): left padding puts every prompt's last token last
        if self.mode == "none":
            return torch.zeros(hidden.shape[:2], device=hidden.device)
        return None

    @torch.no_grad()
    def step(self, hidden: Tensor, mask: Tensor, batch) -> Tensor | None:
        """tau (B,) of a decoding step's new position `hidden` (B, 1, H), `mask` (B, L) covering the cache; None
        outside head mode (zeros in none mode)."""
        if self.mode == "head":
            if self.head_cached:
                return self.calibrator.log_scale(hidden, mask, cache=batch.head)[:, -1].float()
            return self.calibrator.log_scale(hidden, mask[:, -1:])[:, -1].float()
        if self.mode == "none":
            return torch.zeros(hidden.shape[0], device=hidden.device)
        return None

    @torch.no_grad()
    def logits(self, z: Tensor, tau: Tensor | None, state: Tensor | None) -> StepLogits:
        """The calibrated logits of N positions.

        Args:
            z: (N, V) the model's logits (made float32).
            tau: (N,) the head's tau (head mode), zeros (none mode), else None.
            state: (N, H) each position's prompt state (prompt mode), else None.

        Returns:
            The `StepLogits`.
        """
        z = z.float()
        if self.mode == "none" or self.fixed_scale == 1.0:
            return StepLogits(z, z, None, tau)
        if self.mode == "head":
            return StepLogits(z, None, self.calibrator.scale(tau).float(), tau)
        if self.fixed_scale is not None:
            return StepLogits(z, None, z.new_full(z.shape[:1], self.fixed_scale), None)
        q = self.calibrator.apply(z, state) if self.mode == "prompt" else self.calibrator.apply(z)
        return StepLogits(z, q, None, None)

    def confidence(self, logp: Tensor) -> list[float]:
        """Each token's reported confidence from its calibrated log-probability `logp` (N,): the probability, through
        the calibrator's confidence map when it has one (as the evaluation tasks score answer tokens)."""
        p = logp.double().exp()
        if self.maps_confidence:
            return np.asarray(self.calibrator.map_confidence(p.cpu())).reshape(-1).tolist()
        return p.tolist()
