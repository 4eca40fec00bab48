"""The sampler: each row's next token from the calibrated logits `q`, with that row's temperature, top-k, top-p and
random generator.

Greedy (temperature 0) takes the argmax of the model's own logits `z`: for every scaling calibrator (s > 0) that is
the argmax of `q` too, and it keeps greedy text the uncalibrated model's for all of them (vector scaling could move
the argmax of `q`; the evaluation tasks score the model's own greedy answer for every calibrator, and so does this).
With a user's logits processors the decoder hands their output on `q` as both arguments, so greedy rows take its
argmax (a banned token stays banned).
Sampled rows go through transformers' own warpers in `generate`'s order (`TemperatureLogitsWarper`,
`TopKLogitsWarper`, `TopPLogitsWarper`), then `softmax` and `multinomial`, as `generate(do_sample=True)` does after its
processors. A row with its own `torch.Generator` (the server: `seed`, or a fresh one) samples independently of the
other rows of its batch; rows without one (the Python API, seeded with `torch.manual_seed`) draw together from the
global generator, in row order, as `generate` does.
"""

from __future__ import annotations

import math
import secrets
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor
from transformers import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from ..errors import ATSError

SEED_MIN, SEED_MAX = -2 ** 63, 2 ** 64 - 1  # what torch.Generator.manual_seed takes (a negative seed wraps)


@dataclass(frozen=True)
class SamplingParams:
    """A row's sampling options.

    Args:
        temperature: >= 0; 0: greedy.
        top_p: in [0, 1]: the smallest set of most likely tokens whose probability reaches top_p (at least one).
        top_k: keep the k most likely tokens; 0: all.
        seed: the row's random generator's seed, in [SEED_MIN, SEED_MAX]; None: a fresh random one (see
            `generator`).

    Raises:
        ATSError: a value out of its range (named).
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None

    def __post_init__(self) -> None:
        if not (isinstance(self.temperature, (int, float)) and 0 <= self.temperature < math.inf):
            raise ATSError(f"temperature: expected a finite number >= 0, got {self.temperature!r}")
        if not (isinstance(self.top_p, (int, float)) and 0 <= self.top_p <= 1):
            raise ATSError(f"top_p: expected a number in [0, 1], got {self.top_p!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise ATSError(f"top_k: expected an integer >= 0 (0: all tokens), got {self.top_k!r}")
        if self.seed is not None and not SEED_MIN <= self.seed <= SEED_MAX:
            raise ATSError(f"seed must be an integer in [{SEED_MIN}, {SEED_MAX}], got {self.seed}")

    @property
    def greedy(self) -> bool:
        """Whether temperature is 0."""
        return self.temperature == 0

    def generator(self) -> torch.Generator:
        """A CPU random generator seeded with `seed` (or a fresh random seed)."""
        return torch.Generator().manual_seed(self.seed if self.seed is not None else secrets.randbits(63))

    def warp(self, scores: Tensor) -> Tensor:
        """`scores` (n, V) through transformers' temperature, top-k and top-p warpers (those that change anything)."""
        if self.temperature != 1:
            scores = TemperatureLogitsWarper(self.temperature)(None, scores)
        if self.top_k:
            scores = TopKLogitsWarper(self.top_k)(None, scores)
        if self.top_p < 1:
            scores = TopPLogitsWarper(self.top_p)(None, scores)
        return scores


def choose(z: Tensor, q: Tensor, params: Sequence[SamplingParams],
           generators: Sequence[torch.Generator | None]) -> Tensor:
    """The next token of each row.

    Args:
        z: (N, V) the model's own logits (greedy rows take their argmax).
        q: (N, V) calibrated logits (sampled rows draw from them); may be `z` itself.
        params: N sampling options, one per row.
        generators: N random generators, one per row; None: the global one.

    Returns:
        (N,) long token ids.
    """
    tokens = z.argmax(-1)  # greedy rows
    sampled = [i for i, p in enumerate(params) if not p.greedy]
    if not sampled:
        return tokens
    probs = torch.empty(len(sampled), q.shape[-1], dtype=torch.float32, device=q.device)  # (n, V)
    groups: dict[SamplingParams, list[int]] = {}
    for j, i in enumerate(sampled):
        p = params[i]
        groups.setdefault(SamplingParams(p.temperature, p.top_p, p.top_k), []).append(j)
    for option, members in groups.items():
        rows = torch.tensor([sampled[j] for j in members], device=q.device)
        warped = option.warp(q.index_select(0, rows).float())
        probs[torch.tensor(members, device=q.device)] = torch.softmax(warped, dim=-1)
    shared = [j for j, i in enumerate(sampled) if generators[i] is None]
    if shared:
        drawn = torch.multinomial(probs[shared], 1)[:, 0]
        tokens[torch.tensor([sampled[j] for j in shared], device=q.device)] = drawn.to(tokens.device)
    for j, i in enumerate(sampled):
        if generators[i] is not None:
            tokens[i] = torch.multinomial(probs[j].cpu(), 1, generator=generators[i]).to(tokens.device)[0]
    return tokens
