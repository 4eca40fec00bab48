"""Where each lm-eval row's prompt ends: the position at which Thermometer (a `prompt_hidden` calibrator) reads its
one temperature.

HFLM runs a log-likelihood request as the row (context + continuation)[-(max_length + 1):][:-1] and scores the
continuation at the row's last len(continuation) positions. The first of them, len(row) - len(continuation), is the
context's last token predicting the first continuation token: the position `ats eval` reads (`index[:, 0]`, the
first position whose logits are passed; `thermometer_net.prompt_features`), and the temperature applies from there
to the row's end. A rolling log-likelihood window has no context: its whole row is the prompt, read at the row's
last token and applied to every position, as `Calibrator.apply` reads a row passed without `index`.

`_model_call` sees only the right-padded token ids (padded with zeros), so the ends are looked up by the row's ids
without trailing zeros. Two requests whose rows look alike there but end elsewhere (the same ids split otherwise
between context and continuation, or rows differing only by trailing zeros) would be one key: `layers` puts them
in separate runs of HFLM's loop, in each of which every key has one end.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

Key = tuple[int, ...]


@dataclass(frozen=True)
class PromptEnd:
    """One row's prompt end: `length` real tokens, the temperature read at position `at`; `whole`: every position
    is scored (a rolling window), else positions at..length-1 (a continuation)."""

    length: int
    at: int
    whole: bool

    @property
    def first(self) -> int:
        """The first position lm-eval scores."""
        return 0 if self.whole else self.at


def row_key(ids: Sequence[int]) -> Key:
    """A row's ids without trailing zeros (HFLM's right padding), as `_model_call` can see them."""
    end = len(ids)
    while end > 0 and ids[end - 1] == 0:
        end -= 1
    return tuple(ids[:end])


def prompt_end(context: Sequence[int], continuation: Sequence[int], max_length: int,
               rolling: bool) -> tuple[Key, PromptEnd]:
    """The row HFLM runs for one request (its key) and where its prompt ends (see the module docstring).

    Args:
        context: the context's token ids.
        continuation: the continuation's token ids (at least one).
        max_length: HFLM's maximum length (the row is truncated on the left to it).
        rolling: whether the request is a rolling log-likelihood window.

    Returns:
        (the row's key, its PromptEnd).
    """
    row = (list(context) + list(continuation))[-(max_length + 1):][:-1]
    length = len(row)
    at = length - 1 if rolling else max(0, length - len(continuation))
    return row_key(row), PromptEnd(length=length, at=at, whole=rolling)


class PromptEnds:
    """The prompt ends of the rows of the current run of HFLM's loop (`use`), looked up by `_model_call` (`of`)."""

    def __init__(self) -> None:
        self.ends: dict[Key, PromptEnd] = {}

    @staticmethod
    def layers(requests: Sequence, max_length: int, rolling: bool) -> list[tuple[list[int], dict[Key, PromptEnd]]]:
        """The requests split into runs in each of which every row key has one prompt end (one run, nearly always).

        Args:
            requests: HFLM's (cache key, context ids, continuation ids) triples.
            max_length: HFLM's maximum length.
            rolling: whether these are rolling log-likelihood windows.

        Returns:
            [(request indices, key -> PromptEnd)], in order.
        """
        runs: list[tuple[list[int], dict[Key, PromptEnd]]] = []
        for i, (_, context, continuation) in enumerate(requests):
            key, end = prompt_end(context, continuation, max_length, rolling)
            for indices, ends in runs:
                if ends.setdefault(key, end) == end:
                    indices.append(i)
                    break
            else:
                runs.append(([i], {key: end}))
        return runs

    def use(self, ends: dict[Key, PromptEnd]) -> None:
        """Make `ends` the ones `of` answers from (an empty dict: none)."""
        self.ends = ends

    def of(self, rows: list[list[int]]) -> list[PromptEnd] | None:
        """The prompt ends of a batch's right-padded rows; None for a batch of rows no request runs (HFLM probing
        the largest batch that fits, `batch_size=auto`, whose numbers it throws away) or outside a run."""
        found = [self.ends.get(row_key(row)) for row in rows]
        return None if any(end is None for end in found) else found
