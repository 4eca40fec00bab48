"""Streaming calibrated tokens: `StreamToken` (a token with the new text it completes, from `text.TextTracker`), and
terminal output coloured by confidence."""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass

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
