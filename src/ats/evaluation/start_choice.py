"""Choosing where fixed-sequence testing starts, on answers that are not certified on (`ats certify --start-coverage
choose`).

`DEFAULT_START_COVERAGE` was chosen once, on one model's answers (`start_coverage`). A model whose ranking is good
enough that only its few most confident answers meet a target is better served by a lower start, one whose top
answers are noisy by a higher one. Choosing the start on the certification answers themselves would void the
guarantee; choosing it on other answers drawn the same way keeps it (the start is then fixed before any
certification answer is judged). The rule, the same one that chose the default (benchmarks/start_coverage.py):

- every start s of `START_GRID` is scored on the selection answers by `HALVINGS` seeded halvings, the same splits
  for every s: certify on one half from s (`certify_threshold`), measure the coverage of that threshold on the other
  half; the score of s is that held-out coverage, averaged over the halvings and the given target risks;
- the highest score wins; on a tie, `prefer` (the default start) when it is among the tied, else the smallest.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from .start_coverage import DEFAULT_START_COVERAGE
from .threshold import certify_threshold

START_GRID = (0.0, 0.01, 0.02, 0.05, 0.1, 0.15, 0.2, 0.3)  # the starts tried (fixed before any answer was read)
HALVINGS = 200  # seeded halvings that score a start


def halves(n: int, halvings: int = HALVINGS) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """`halvings` seeded random halvings of n answers, the same on every call: (indices certified on, indices
    measured on), the first n // 2 of a permutation and the rest."""
    rng = np.random.default_rng(0)
    for _ in range(halvings):
        order = rng.permutation(n)
        yield order[: n // 2], order[n // 2:]


def halving_coverage(confidence: np.ndarray, correct: np.ndarray, *, target_risk: float, delta: float,
                     start_coverage: float, halvings: int = HALVINGS) -> np.ndarray:
    """The other half's coverage of the threshold certified on one half, per seeded halving (split order: the
    same splits for every call, so two starts or two calibrators are compared on the same halves).  # (halvings,)

    Args:
        confidence: answer confidences.  # (N,)
        correct: whether each answer is right.  # (N,)
        target_risk: the target risk certified on each half.
        delta: the certificate's delta.
        start_coverage: where each half's sequence starts (`certify_threshold`).
        halvings: how many halvings.
    """
    confidence, correct = np.asarray(confidence, dtype=float), np.asarray(correct, dtype=bool)
    out = np.empty(halvings)
    for i, (a, b) in enumerate(halves(correct.size, halvings)):
        t = certify_threshold(confidence[a], correct[a], target_risk=target_risk, delta=delta,
                              start_coverage=start_coverage)
        out[i] = t.answers(confidence[b]).mean()
    return out


@dataclass(frozen=True)
class StartChoice:
    """The chosen start and every start's held-out coverage per target risk (`choose_start`)."""

    start: float
    coverage: dict[float, dict[float, float]]  # start -> target risk -> mean held-out coverage over halvings
    halvings: int

    def score(self, start: float) -> float:
        """`start`'s score: its mean held-out coverage averaged over the target risks."""
        return float(np.mean(list(self.coverage[start].values())))

    def to_dict(self) -> dict:
        """JSON-ready: {"start", "halvings", "scores": {start: score}, "coverage": {start: {target: coverage}}}."""
        return {"start": self.start, "halvings": self.halvings,
                "scores": {f"{s:g}": self.score(s) for s in self.coverage},
                "coverage": {f"{s:g}": {f"{t:g}": c for t, c in per.items()} for s, per in self.coverage.items()}}


def choose_start(confidence, correct, *, target_risks: tuple[float, ...], delta: float,
                 grid: tuple[float, ...] = START_GRID, halvings: int = HALVINGS,
                 prefer: float = DEFAULT_START_COVERAGE) -> StartChoice:
    """The start of `grid` with the highest held-out coverage on these answers (the module docstring's rule).

    Args:
        confidence: the selection answers' confidences (never the answers certified on).  # (N,)
        correct: whether each is right.  # (N,)
        target_risks: the target risks the score averages over (`ats certify`: the one it certifies).
        delta: the certificate's delta.
        grid: the starts tried.
        halvings: seeded halvings per start and target risk.
        prefer: the start kept on a tie when it is among the tied (the default start); else the smallest tied.
    """
    coverage = {s: {t: float(halving_coverage(confidence, correct, target_risk=t, delta=delta, start_coverage=s,
                                              halvings=halvings).mean())
                    for t in target_risks}
                for s in grid}
    choice = StartChoice(0.0, coverage, halvings)
    best = max(round(choice.score(s), 12) for s in grid)
    tied = [s for s in grid if round(choice.score(s), 12) == best]
    return StartChoice(prefer if prefer in tied else min(tied), coverage, halvings)
