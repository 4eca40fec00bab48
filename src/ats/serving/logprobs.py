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
    """Log-probabilities at logits z (N, V) with calibration factors `scale` (N,) (None: uncalibrated) of `tokens`
    (N,) and of each row's k most likely tokens: calibrated (N,), uncalibrated (N,), top ids (N, k), top calibrated
    log-probabilities (N, k). The top tokens of `z * s` are those of `z` (s > 0)."""
    top_ids = z.topk(k, dim=-1).indices if k else tokens.new_zeros(tokens.shape[0], 0)  # (N, k)
    ids = torch.cat([tokens[:, None], top_ids], 1)  # (N, 1 + k)
    if scale is None:
        logp_z = logp_q = z.gather(-1, ids) - logsumexp(z)[:, None]
    else:
        logp_z, logp_q = token_log_probs(z, scale.to(z.dtype), ids)
    return logp_q[:, 0], logp_z[:, 0], top_ids, logp_q[:, 1:]


def records(tokens: list[int], logp_q: Tensor, logp_z: Tensor, tau: Tensor, top_ids: Tensor,
            top_logp: Tensor) -> list[TokenLogprob]:
    """`TokenLogprob`s from the (N,) / (N, k) outputs of `score` and taus (N,)."""
    q, z, t, ids, lp = (x.tolist() for x in (logp_q, logp_z, tau, top_ids, top_logp))
    return [TokenLogprob(token, q[i], z[i], t[i], list(zip(ids[i], lp[i]))) for i, token in enumerate(tokens)]


@torch.no_grad()
def prompt_logprobs(logits_fn, hidden: Tensor, scale: Tensor | None, tau: Tensor, ids: list[int],
                    k: int = 0) -> list[TokenLogprob]:
    """Every prompt token's probabilities given the tokens before it: hidden (P, H) and scale, tau (P,) of the
    prompt's positions (position t predicts token t + 1); `logits_fn` maps hidden states to logits z. The first token
    gets None (nothing predicts it)."""
    out = [TokenLogprob(ids[0], None, None, None)]
    targets = torch.tensor(ids[1:], dtype=torch.long, device=hidden.device)
    for start in range(0, len(ids) - 1, PROMPT_CHUNK):
        stop = min(start + PROMPT_CHUNK, len(ids) - 1)
        z = logits_fn(hidden[start:stop]).float()  # (chunk, V)
        part = score(z, None if scale is None else scale[start:stop], targets[start:stop], k)
        out += records(ids[start + 1: stop + 1], *part[:2], tau[start:stop], *part[2:])
    return out
