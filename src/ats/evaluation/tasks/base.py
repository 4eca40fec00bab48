"""What every evaluation task shares: the `Task` interface, `TaskResult`, and small helpers (subsets, batching).

A task runs the backbone once per example (or batch) and applies every calibrator to that same forward
(`ats.evaluation.tasks.scoring`), so evaluating seven methods costs one backbone pass.
"""

from __future__ import annotations

import random
import zlib
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np

from ... import io
from ...calibrators.base import Calibrator
from ...errors import ATSError


# --- results ---------------------------------------------------------------------------------------------------------
@dataclass
class TaskResult:
    """Per-example results of one method on one task: confidence in [0, 1] and whether the answer was correct.

    `extra` holds further per-example arrays of the same length (e.g. TriviaQA's `confidence_product`).
    Inputs are flattened to (N,) float64 / bool.

    Raises:
        ATSError: if `confidence` and `correct` differ in length.
    """

    confidence: np.ndarray  # (N,) float
    correct: np.ndarray  # (N,) bool
    extra: dict[str, np.ndarray] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.confidence = np.asarray(self.confidence, dtype=np.float64).reshape(-1)
        self.correct = np.asarray(self.correct, dtype=bool).reshape(-1)
        if self.confidence.shape != self.correct.shape:
            raise ATSError(f"TaskResult: confidence has {self.confidence.size} entries, correct "
                           f"{self.correct.size}")
        self.extra = {k: np.asarray(v) for k, v in self.extra.items()}

    def __len__(self) -> int:
        return int(self.confidence.size)

    def to_dict(self) -> dict:
        """A JSON-ready dict of lists.

        Returns:
            {"confidence": [N floats], "correct": [N bools], "extra": {name: list}}.
        """
        return {"confidence": self.confidence.tolist(), "correct": self.correct.tolist(),
                "extra": {k: v.tolist() for k, v in self.extra.items()}}

    @classmethod
    def from_dict(cls, data: dict, where: str = "task result") -> "TaskResult":
        """The result from `to_dict`'s output.

        Args:
            data: {"confidence", "correct", optional "extra"}.
            where: what the data came from, quoted in the error.

        Returns:
            The result.

        Raises:
            ATSError: if a field is missing or malformed, or the lengths differ.
        """
        try:
            return cls(confidence=np.asarray(data["confidence"], dtype=np.float64),
                       correct=np.asarray(data["correct"], dtype=bool),
                       extra={k: np.asarray(v) for k, v in data.get("extra", {}).items()})
        except (KeyError, TypeError, ValueError) as err:
            raise ATSError(f"{where}: malformed task result ({err})") from None


class Task(ABC):
    """An evaluation task: `run` returns, per calibrator name, per-example confidence and correctness."""

    name: str  # safe for file names

    @abstractmethod
    def run(self, backbone, calibrators: dict[str, Calibrator], *, progress: bool = True) -> dict[str, TaskResult]:
        """Evaluate every calibrator on the same backbone forward passes.

        Args:
            backbone: the frozen backbone (its tokenizer encodes the prompts).
            calibrators: method name -> fitted calibrator, all applied to the same forward passes.
            progress: show progress bars.

        Returns:
            method -> per-example results, one entry per calibrator.
        """

    def describe(self) -> dict:
        """The settings that determine the results (stored beside them, so stale results are never reused).

        Returns:
            A JSON-ready dict with at least "name".
        """
        return {"name": self.name}

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.describe()})"


# --- small helpers ---------------------------------------------------------------------------------------------------
def progress_bar(iterable: Iterable, *, enabled: bool, desc: str, total: int | None = None):
    """`iterable` wrapped in a tqdm bar that disappears when done.

    Args:
        iterable: what to iterate.
        enabled: show the bar; otherwise it is disabled (the items still pass through).
        desc: the bar's label.
        total: the number of items, when `iterable` has no length.

    Returns:
        The tqdm iterator.
    """
    from tqdm.auto import tqdm

    return tqdm(iterable, desc=desc, total=total, disable=not enabled, leave=False, dynamic_ncols=True)


def chunks(items: Sequence, size: int) -> list[Sequence]:
    """Consecutive slices of `items` of `size` (the last may be shorter).

    Args:
        items: a sliceable sequence.
        size: the slice length (at least 1 is used).

    Returns:
        The slices, in order.
    """
    size = max(1, int(size))
    return [items[i:i + size] for i in range(0, len(items), size)]


def seeded_subset(n: int, limit: int | None, seed: int, *, salt: str = "", held_out_from: int | None = None
                  ) -> list[int]:
    """Sorted indices of a seeded random subset of `range(n)` of size `limit` (all of them when None); with
    `held_out_from`, a subset of the items NOT in the subset of that size (same seed and salt): questions a calibrator
    trained on the first subset never saw (a certification split, `workflows/answer_pool.held_out_tasks`).

    Args:
        n: the number of items.
        limit: the subset's size; None or >= n: all.
        seed: the seed of the subset.
        salt: mixed into the seed, so different subjects or tasks get different subsets.
        held_out_from: the size of the subset to leave out; None: leave nothing out.

    Returns:
        The indices, increasing.

    Raises:
        ATSError: if `limit` < 0.
    """
    if held_out_from is not None:
        taken = set(seeded_subset(n, held_out_from, seed, salt=salt))
        rest = [i for i in range(n) if i not in taken]
        return [rest[i] for i in seeded_subset(len(rest), limit, seed, salt=salt + "/held-out")]
    if limit is None or limit >= n:
        return list(range(n))
    if limit < 0:
        raise ATSError(f"limit must be >= 0, got {limit}")
    rng = random.Random(seed * 1_000_003 + zlib.crc32(salt.encode()))
    return sorted(rng.sample(range(n), limit))


def read_jsonl(path: Path) -> list[dict]:
    """All rows of a JSONL file (errors name the file and line).

    Args:
        path: the file.

    Returns:
        The parsed rows, blank lines skipped.

    Raises:
        ATSError: on a line that is not valid JSON.
    """
    return [row for _, row in io.read_jsonl(path)]
