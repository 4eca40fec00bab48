"""Streaming calibrated tokens: `StreamToken`s with incrementally decoded text, coloured by confidence in a terminal."""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass

from torch import Tensor

# Confidence colours for streaming: red < LOW <= yellow < HIGH <= green.
LOW, HIGH = 0.3, 0.7
_RED, _YELLOW, _GREEN, _RESET = "\033[31m", "\033[33m", "\033[32m", "\033[0m"


@dataclass
class StreamToken:
    """One streamed token of sequence `row`: `text` is the new text it completes (may be "" for a special token or
    a partial UTF-8 character held back), `done` marks the end of that sequence (no token then)."""

    row: int
    index: int
    token_id: int
    text: str
    confidence: float
    uncalibrated: float
    tau: float
    done: bool = False


def colorize(text: str, confidence: float) -> str:
    """`text` in ANSI red (< 0.3), yellow (< 0.7) or green, by calibrated confidence; plain when NO_COLOR is set.

    Args:
        text: the text to colour.
        confidence: its calibrated confidence in [0, 1].

    Returns:
        The text, wrapped in colour codes unless NO_COLOR is set.
    """
    if os.environ.get("NO_COLOR"):
        return text
    colour = _RED if confidence < LOW else _YELLOW if confidence < HIGH else _GREEN
    return f"{colour}{text}{_RESET}"


def print_stream(token: StreamToken, file=None) -> None:
    """Streaming callback for the CLI: prints the first sequence token by token, coloured by confidence.

    Args:
        token: the streamed token; other rows than 0 are ignored, `done` ends the line.
        file: where to print; None: stdout.
    """
    file = file or sys.stdout
    if token.row != 0:
        return
    if token.done:
        print(file=file, flush=True)
    elif token.text:
        print(colorize(token.text, token.confidence), end="", file=file, flush=True)


class Streamer:
    """Turns per-step records into `StreamToken`s with incrementally decoded text, per sequence.

    Called as a `CalibrationProcessor`'s `on_record` with (tokens (B,), logp_q (B,), logp_z (B,), tau (B,)); a row
    stops at an end-of-sequence token or a stop string.

    Args:
        callback: receives each `StreamToken`.
        tokenizer: decodes each row's tokens so far.
        rows: B, the number of sequences.
        eos: end-of-sequence token ids.
        stop_strings: the row's text is cut before the first of these, which ends it.
    """

    def __init__(self, callback, tokenizer, rows: int, eos: set[int], stop_strings: Sequence[str]) -> None:
        self.callback, self.tokenizer, self.eos, self.stop = callback, tokenizer, eos, list(stop_strings or [])
        self.ids: list[list[int]] = [[] for _ in range(rows)]
        self.emitted = [0] * rows
        self.finished = [False] * rows

    def __call__(self, tokens: Tensor, logp_q: Tensor, logp_z: Tensor, tau: Tensor) -> None:
        tokens, pq, pz, tau = (t.tolist() for t in (tokens, logp_q.exp(), logp_z.exp(), tau))
        for row, token in enumerate(tokens):
            if self.finished[row]:
                continue
            self.ids[row].append(token)
            text = ""
            if token in self.eos:
                self.finished[row] = True
            else:
                full = self.tokenizer.decode(self.ids[row], skip_special_tokens=True)
                cut = first_stop(full, self.stop)
                if cut is not None:
                    full, self.finished[row] = full[:cut], True
                if cut is not None or not full.endswith("\ufffd"):  # hold back a partial UTF-8 character
                    text, self.emitted[row] = full[self.emitted[row]:], len(full)
            self.callback(StreamToken(row, len(self.ids[row]) - 1, token, text, pq[row], pz[row], tau[row]))

    def close(self) -> None:
        """Send every row a final `done` token (token_id -1, no text, NaN probabilities)."""
        for row in range(len(self.ids)):
            self.callback(StreamToken(row, len(self.ids[row]), -1, "", float("nan"), float("nan"), float("nan"),
                                      done=True))


def first_stop(text: str, stops: Sequence[str]) -> int | None:
    """The index in `text` where the earliest of `stops` begins (empty stops are ignored), or None if none occurs."""
    hits = [i for i in (text.find(s) for s in stops if s) if i >= 0]
    return min(hits) if hits else None
