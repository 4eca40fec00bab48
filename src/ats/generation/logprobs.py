"""Token log-probabilities as decoding reports them: of the calibrated distribution (the one it samples from), beside
the model's own `softmax(z)`, the head's `tau` and the token's confidence; and the answer confidence of a sequence.

They are taken before the request's temperature / top-k / top-p (those shape sampling only); a scaling head's come
from one shared shift per row (`ats.model.numerics.token_log_probs`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import Tensor

from ..confidence import mean_token_confidence
from ..model.numerics import logsumexp, token_log_probs
from .calibration import DecodingCalibration, StepLogits

PROMPT_CHUNK = 256  # prompt positions whose (chunk, V) logits are materialised at once


@dataclass
class TokenLogprob:
    """One token of a prompt or a completion with its probabilities.

    logprob: calibrated log-probability (None for a prompt's first token, which nothing predicts); uncalibrated: the
    backbone's own; tau: the head's log-scale (log s = -log T) at the position that predicted it; top: the most
    likely tokens there with their calibrated log-probabilities, best first (empty unless asked for); offset: where
    the token's text starts in the generated text (characters; set when it is released); confidence: the reported
    confidence (the calibrated probability, through a binning calibrator's map); answer: whether it counts in the
    answer's confidence (not the end-of-sequence token).
    """

    token: int
    logprob: float | None
    uncalibrated: float | None
    tau: float | None
    top: list[tuple[int, float]] = field(default_factory=list)
    offset: int = 0
    confidence: float | None = None
    answer: bool = True
    answer_probability: float | None = None  # on a finished answer's last token: its correctness probe's P(correct)


def score(step: StepLogits, tokens: Tensor, k: int = 0) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Log-probabilities of `tokens` and of each row's k most likely calibrated tokens.

    With a scale (q = z * s, s > 0) both distributions come from one shared shift (`token_log_probs`) and the top
    tokens of q are those of z; otherwise each gets its own log-normaliser.

    Args:
        step: the positions' logits (N rows).
        tokens: (N,) long token ids.
        k: the number of most likely tokens per row (0: none).

    Returns:
        (calibrated (N,), uncalibrated (N,), top ids (N, k), top calibrated log-probabilities (N, k)).
    """
    ranked = step.z if step.scale is not None else step.q  # s > 0: the top tokens of q are those of z
    top_ids = ranked.topk(k, dim=-1).indices if k else tokens.new_zeros(tokens.shape[0], 0)  # (N, k)
    ids = torch.cat([tokens[:, None], top_ids], 1)  # (N, 1 + k)
    if step.scale is not None:
        logp_z, logp_q = token_log_probs(step.z, step.scale.to(step.z.dtype), ids)
    else:
        logp_z = step.z.gather(-1, ids) - logsumexp(step.z)[:, None]
        logp_q = logp_z if step.identity else step.q.gather(-1, ids) - logsumexp(step.q)[:, None]
    return logp_q[:, 0], logp_z[:, 0], top_ids, logp_q[:, 1:]


def records(tokens: list[int], logp_q: Tensor, logp_z: Tensor, tau: Tensor | None, top_ids: Tensor,
            top_logp: Tensor, confidence: list[float]) -> list[TokenLogprob]:
    """`TokenLogprob`s from the outputs of `score`.

    Args:
        tokens: the N token ids.
        logp_q: (N,) calibrated log-probabilities.
        logp_z: (N,) uncalibrated log-probabilities.
        tau: (N,) the head's log-scales, or None.
        top_ids: (N, k) the most likely tokens.
        top_logp: (N, k) their calibrated log-probabilities.
        confidence: the N reported confidences (`DecodingCalibration.confidence`).

    Returns:
        N records, in order.
    """
    q, z, ids, lp = (x.tolist() for x in (logp_q, logp_z, top_ids, top_logp))
    t = tau.tolist() if tau is not None else [None] * len(tokens)
    return [TokenLogprob(token, q[i], z[i], t[i], list(zip(ids[i], lp[i])), confidence=confidence[i])
            for i, token in enumerate(tokens)]


@torch.no_grad()
def prompt_logprobs(backbone, calibration: DecodingCalibration, hidden: Tensor, tau: Tensor | None,
                    state: Tensor | None, ids: list[int], k: int = 0) -> list[TokenLogprob]:
    """Every prompt token's probabilities given the tokens before it (position t predicts token t + 1).

    Args:
        backbone: its output layer gives the logits.
        calibration: the decoding calibration.
        hidden: (P, H) hidden states of the prompt's positions.
        tau: (P,) the head's log-scales (head and none modes), else None.
        state: (H,) the prompt's state (prompt mode), else None.
        ids: the P prompt token ids.
        k: the most likely tokens reported per position.

    Returns:
        P records; the first token's probabilities are None (nothing predicts it).
    """
    out = [TokenLogprob(ids[0], None, None, None)]
    targets = torch.tensor(ids[1:], dtype=torch.long, device=hidden.device)
    for start in range(0, len(ids) - 1, PROMPT_CHUNK):
        stop = min(start + PROMPT_CHUNK, len(ids) - 1)
        part_tau = None if tau is None else tau[start:stop]
        rows = None if state is None else state[None].expand(stop - start, -1)
        step = calibration.logits(backbone.logits(hidden[start:stop]), part_tau, rows)  # (chunk, V)
        logp_q, logp_z, top_ids, top_logp = score(step, targets[start:stop], k)
        out += records(ids[start + 1: stop + 1], logp_q, logp_z, part_tau, top_ids, top_logp,
                       calibration.confidence(logp_q))
    return out


def answer_confidence(tokens: list[TokenLogprob], *, uncalibrated: bool = False) -> float | None:
    """A generated answer's confidence as the evaluation tasks compute it (`ats.confidence.mean_token_confidence`):
    the mean reported confidence of its tokens, the end-of-sequence token left out; None without any. A correctness
    probe's P(correct), carried by the answer's last token once it finished, replaces it.

    Args:
        tokens: the generated tokens.
        uncalibrated: the backbone's own answer confidence instead, by the same rule (its tokens' own
            probabilities; no probe, no binning map): the raw model's number for the same answer.

    Returns:
        The mean, or None.
    """
    probed = next((t.answer_probability for t in reversed(tokens) if t.answer_probability is not None), None)
    if probed is not None and not uncalibrated:
        return probed
    values = [(math.exp(t.uncalibrated) if uncalibrated else t.confidence) for t in tokens
              if t.answer and (t.uncalibrated if uncalibrated else t.confidence) is not None]
    if not values:
        return None
    p = torch.tensor(values, dtype=torch.float64)
    return float(mean_token_confidence(p, torch.ones_like(p)))
