"""The incremental detokenizer: the text of one generated sequence, released in pieces while it grows (the one used by
`generate_calibrated`, its streaming, `ats generate` and the server).

After each token the whole sequence is decoded again (`skip_special_tokens`), so the text is exactly the in-process
API's, and cut before the first stop string (keeping the fewest tokens that cover the text before it, as
`generate_calibrated` does). While streaming, a piece of text is released only once nothing can change it: the last
`len(longest stop) - 1` characters wait (a stop string may be completing there) and so does a trailing partial UTF-8
character. With stop strings, a token is released with the text that contains its start.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Sequence


class TextTracker:
    """Token ids, their decoded text and each token's character offset in it, for one sequence.

    Args:
        tokenizer: decodes the ids.
        stop: the request's stop strings (empty ones are ignored).
    """

    def __init__(self, tokenizer, stop: Sequence[str] = ()) -> None:
        self.tokenizer = tokenizer
        self.stop = [s for s in stop if s]
        self.holdback = max((len(s) for s in self.stop), default=1) - 1
        self.ids: list[int] = []
        self.offsets: list[int] = []  # character offset of each token's start in `text`
        self.text = ""
        self.sent_chars = 0
        self.sent_tokens = 0

    def add(self, token: int) -> bool:
        """Append a token id.

        Args:
            token: the generated token id.

        Returns:
            True when the text now holds a stop string (text and tokens are then cut before it).
        """
        self.offsets.append(len(self.text))
        self.ids.append(token)
        self.text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        cut = first_stop(self.text, self.stop) if self.stop else None
        if cut is None:
            return False
        self.text = self.text[:cut]
        keep = tokens_covering(self.tokenizer, self.ids, cut)
        del self.ids[keep:], self.offsets[keep:]
        return True

    def release(self, final: bool = False) -> tuple[str, int]:
        """The text not released yet that nothing can change any more, and how many more tokens go with it.

        Args:
            final: the sequence has ended: release all of it.

        Returns:
            (text piece, number of tokens released with it).
        """
        chars, tokens = len(self.text), len(self.ids)
        if not final:
            chars -= self.holdback
            partial = len(self.text) - len(self.text.rstrip("\ufffd"))
            chars = min(chars, len(self.text) - partial)
            if self.stop:
                tokens = bisect_left(self.offsets, chars)
        chars, tokens = max(chars, self.sent_chars), max(tokens, self.sent_tokens)
        piece = self.text[self.sent_chars:chars]
        released = tokens - self.sent_tokens
        self.sent_chars, self.sent_tokens = chars, tokens
        return piece, released


def first_stop(text: str, stops: Sequence[str]) -> int | None:
    """The index in `text` where the earliest of `stops` begins (empty stops are ignored), or None if none occurs."""
    hits = [i for i in (text.find(s) for s in stops if s) if i >= 0]
    return min(hits) if hits else None


def tokens_covering(tokenizer, ids: list[int], chars: int) -> int:
    """The fewest leading tokens whose decoded text reaches `chars` characters (the tokens before a stop string).

    Args:
        tokenizer: decodes the ids.
        ids: the generated token ids.
        chars: the length of the text to cover.

    Returns:
        The number of tokens (all of them if their text is shorter).
    """
    if chars <= 0:
        return 0
    for n in range(1, len(ids) + 1):
        if len(tokenizer.decode(ids[:n], skip_special_tokens=True)) >= chars:
            return n
    return len(ids)
