"""Rescoring: the probabilities of tokens already generated, under any calibrator the server loaded, without
generating again (the playground's "compare calibrators" on the same text, POST /v1/playground/rescore).

The prompt and its completion go through the backbone in one forward pass (causal: each position's hidden state is
the one decoding saw); the calibrator then reads them as decoding would: a token head its tau at every position, a
prompt-level calibrator (Thermometer) the hidden state of the prompt's last token (its state at prefill), a logits
map the logits. So rescoring under the served calibrator gives the streamed values again (up to float rounding),
and under another calibrator the values it would have given had it been served, on the same tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from ..evaluation.threshold import CertifiedThreshold
from ..generation.batch import BatchCache, check_attention
from ..generation.calibration import DecodingCalibration
from ..generation.logprobs import PROMPT_CHUNK, TokenLogprob, prompt_logprobs


@dataclass
class ServedCalibrator:
    """A calibrator the server can score with: `id` (unique on this server), its decoding calibration, its
    certified threshold (or None), its folder (None: uncalibrated) and its digest (matched against saved
    evaluations)."""

    id: str
    calibration: DecodingCalibration
    threshold: CertifiedThreshold | None = None
    folder: Path | None = None
    digest: str | None = None


def unique_ids(labels: list[str]) -> list[str]:
    """`labels` made unique in order: a repeated label gets "#2", "#3", ... (two Thermometer folders, say)."""
    seen: dict[str, int] = {}
    out = []
    for label in labels:
        seen[label] = seen.get(label, 0) + 1
        out.append(label if seen[label] == 1 else f"{label}#{seen[label]}")
    return out


@torch.no_grad()
def rescore(backbone, calibration: DecodingCalibration, prompt: list[int], completion: list[int], *, k: int = 0,
            eos: set[int] = frozenset(), ignore_eos: bool = False) -> tuple[list[TokenLogprob], list[list[float]]]:
    """Each completion token's probabilities given the prompt and the completion before it, under `calibration`.

    Args:
        backbone: the served backbone.
        calibration: the calibration to score with.
        prompt: the P prompt token ids (P >= 1).
        completion: the C generated token ids (C >= 1).
        k: the most likely tokens reported per position (as `top_logprobs`).
        eos: end-of-sequence ids; a last token among them does not count in the answer confidence (as in decoding).
        ignore_eos: the generation kept going after end-of-sequence tokens (they then count, as in decoding).

    Returns:
        (C records as decoding makes them, with `top` (id, calibrated log-probability); for each, the uncalibrated
        log-probabilities of its `top` ids).
    """
    ids = prompt + completion
    device = backbone.device
    tokens = torch.tensor([ids], dtype=torch.long, device=device)  # (1, L)
    mask = torch.ones_like(tokens)
    hidden, _ = backbone.forward(tokens, mask)  # (1, L, H)
    batch = BatchCache(check_attention(backbone.model.config), head=calibration.head_cached)
    tau = calibration.prefill(hidden, mask, batch)  # (1, L) or None
    start = len(prompt) - 1  # the position predicting the first completion token
    state = hidden[0, start] if calibration.mode == "prompt" else None  # Thermometer: the prompt's last h
    records = prompt_logprobs(backbone, calibration, hidden[0, start:], None if tau is None else tau[0, start:],
                              state, ids[start:], k)[1:]  # (C,) the first record is ids[start], predicted by none
    raw_top: list[list[float]] = [[] for _ in records]
    if k:
        positions = hidden[0, start:-1]  # (C, H): position i predicts completion token i
        for lo in range(0, len(records), PROMPT_CHUNK):  # (chunk, V) logits at a time, as prompt scoring does
            logp_z = backbone.logits(positions[lo:lo + PROMPT_CHUNK]).float().log_softmax(-1)  # (chunk, V)
            for i, record in enumerate(records[lo:lo + PROMPT_CHUNK]):
                ids_i = torch.tensor([t for t, _ in record.top], dtype=torch.long, device=logp_z.device)
                raw_top[lo + i] = logp_z[i, ids_i].tolist()
    if records and not ignore_eos and records[-1].token in eos:
        records[-1].answer = False
    return records, raw_top
