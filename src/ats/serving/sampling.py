"""Choosing each row's next token from the calibrated logits `q = z * s` with the request's own temperature, top-p
and seed.

temperature 0 is greedy: argmax q, which is argmax z (s > 0), so greedy text is the model's own. Otherwise the
request's temperature divides q and top-p cuts the result, as transformers' warpers do after the calibration
processor in `generate_calibrated`. Every request has its own random generator (seeded by `seed`), so what a request
samples does not depend on the other requests in its batch.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass

import torch
from torch import Tensor

from ..model.numerics import logsumexp, softmax_


@dataclass(frozen=True)
class SamplingParams:
    """A request's sampling options.

    Args:
        temperature: >= 0; 0: greedy.
        top_p: in [0, 1]: the smallest set of most likely tokens whose probability reaches top_p (at least one).
        seed: the random generator's seed; None: a fresh random one.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None

    @property
    def greedy(self) -> bool:
        """Whether temperature is 0."""
        return self.temperature == 0

    def generator(self) -> torch.Generator:
        """A CPU random generator seeded with `seed` (or a fresh random seed)."""
        return torch.Generator().manual_seed(self.seed if self.seed is not None else secrets.randbits(63))


def top_p_filter(probs: Tensor, top_p: Tensor) -> Tensor:
    """Zero the tokens outside each row's top-p set, as transformers' `TopPLogitsWarper` (tokens sorted by
    probability, those whose cumulative probability from the least likely stays <= 1 - top_p are removed, the most
    likely is always kept).

    Args:
        probs: (N, V) probabilities.
        top_p: (N,) each row's top_p.

    Returns:
        (N, V) the probabilities with the removed tokens at 0 (not renormalised).
    """
    ordered, order = probs.sort(-1)  # ascending
    remove = ordered.cumsum(-1) <= (1 - top_p)[:, None]
    remove[:, -1] = False
    return probs.scatter(1, order, ordered.masked_fill(remove, 0.0))


def choose(q: Tensor, params: list[SamplingParams], generators: list[torch.Generator]) -> Tensor:
    """The next token of each row of calibrated logits.

    Args:
        q: (N, V) calibrated logits.
        params: N sampling options, one per row.
        generators: N random generators, one per row (read by sampled rows only).

    Returns:
        (N,) long token ids.
    """
    tokens = q.argmax(-1)  # greedy rows
    sampled = [i for i, p in enumerate(params) if not p.greedy]
    if not sampled:
        return tokens
    rows = torch.tensor(sampled, device=q.device)
    temperature = torch.tensor([params[i].temperature for i in sampled], dtype=q.dtype, device=q.device)
    logits = q.index_select(0, rows) / temperature[:, None]  # (n, V)
    probs = softmax_(logits, logsumexp(logits))
    top_p = torch.tensor([params[i].top_p for i in sampled], dtype=q.dtype, device=q.device)
    if bool((top_p < 1).any()):
        probs = top_p_filter(probs, top_p)
    for j, i in enumerate(sampled):
        tokens[i] = torch.multinomial(probs[j].cpu(), 1, generator=generators[i]).to(tokens.device)[0]
    return tokens
