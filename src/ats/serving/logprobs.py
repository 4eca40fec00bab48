"""Token log-probabilities as the server reports them: of the calibrated distribution `softmax(z * s)` (the one it
samples from), beside the model's own `softmax(z)` and `tau`.

They are taken before the request's temperature and top-p (those shape sampling only), from one shared shift per row
(`ats.model.numerics.token_log_probs`, the function `generate_calibrated` uses), so they equal the in-process API's.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from ..model.numerics import logsumexp, token_log_probs

PROMPT_CHUNK = 256  # prompt positions whose (chunk, V) logits are materialised at once


@dataclass
class TokenLogprob:
    """One token of a prompt or a completion with its probabilities.

    logprob: calibrated log-probability (None for a prompt's first token, which nothing predicts); uncalibrated: the
    backbone's own; tau: the head's log-temperature at the position that predicted it; top: the most likely tokens
    there with their calibrated log-probabilities, best first (empty unless asked for); offset: where the token's
    text starts in the generated text (characters; set when it is released).
    """

    token: int
    logprob: float | None
    uncalibrated: float | None
    tau: float | None
    top: list[tuple[int, float]] = field(default_factory=list)
    offset: int = 0


def score(z: Tensor, scale: Tensor | None, tokens: Tensor, k: int = 0) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Log-probabilities of `tokens` and of each row's k most likely tokens (those of `z * s` are those of `z`, s > 0).

    Args:
        z: (N, V) logits.
        scale: (N,) calibration factors s > 0; None: uncalibrated (calibrated = uncalibrated).
        tokens: (N,) long token ids.
        k: the number of most likely tokens per row (0: none).

    Returns:
        (calibrated (N,), uncalibrated (N,), top ids (N, k), top calibrated log-probabilities (N, k)).
    """
    top_ids = z.topk(k, dim=-1).indices if k else tokens.new_zeros(tokens.shape[0], 0)  # (N, k)
    ids = torch.cat([tokens[:, None], top_ids], 1)  # (N, 1 + k)
    if scale is None:
        logp_z = logp_q = z.gather(-1, ids) - logsumexp(z)[:, None]
    else:
        logp_z, logp_q = token_log_probs(z, scale.to(z.dtype), ids)
    return logp_q[:, 0], logp_z[:, 0], top_ids, logp_q[:, 1:]


def records(tokens: list[int], logp_q: Tensor, logp_z: Tensor, tau: Tensor, top_ids: Tensor,
            top_logp: Tensor) -> list[TokenLogprob]:
    """`TokenLogprob`s from the outputs of `score`.

    Args:
        tokens: the N token ids.
        logp_q: (N,) calibrated log-probabilities.
        logp_z: (N,) uncalibrated log-probabilities.
        tau: (N,) the head's log-temperatures.
        top_ids: (N, k) the most likely tokens.
        top_logp: (N, k) their calibrated log-probabilities.

    Returns:
        N records, in order.
    """
    q, z, t, ids, lp = (x.tolist() for x in (logp_q, logp_z, tau, top_ids, top_logp))
    return [TokenLogprob(token, q[i], z[i], t[i], list(zip(ids[i], lp[i]))) for i, token in enumerate(tokens)]


@torch.no_grad()
def prompt_logprobs(logits_fn, hidden: Tensor, scale: Tensor | None, tau: Tensor, ids: list[int],
                    k: int = 0) -> list[TokenLogprob]:
    """Every prompt token's probabilities given the tokens before it (position t predicts token t + 1).

    Args:
        logits_fn: hidden states (n, H) -> logits z (n, V).
        hidden: (P, H) hidden states of the prompt's positions.
        scale: (P,) calibration factors; None: uncalibrated.
        tau: (P,) the head's log-temperatures.
        ids: the P prompt token ids.
        k: the most likely tokens reported per position.

    Returns:
        P records; the first token's probabilities are None (nothing predicts it).
    """
    out = [TokenLogprob(ids[0], None, None, None)]
    targets = torch.tensor(ids[1:], dtype=torch.long, device=hidden.device)
    for start in range(0, len(ids) - 1, PROMPT_CHUNK):
        stop = min(start + PROMPT_CHUNK, len(ids) - 1)
        z = logits_fn(hidden[start:stop]).float()  # (chunk, V)
        part = score(z, None if scale is None else scale[start:stop], targets[start:stop], k)
        out += records(ids[start + 1: stop + 1], *part[:2], tau[start:stop], *part[2:])
    return out
