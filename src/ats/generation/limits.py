"""What a prompt may be before it is decoded: not empty, its token ids in the vocabulary, and prompt + new tokens
within the context. One rule for the server's engine (`ats serve`: a 400) and `generate_calibrated` (`ats generate`
and the Python API): a model run past the positions it was trained on gives text, silently, that means nothing.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..errors import ATSError
from ..model.backbone import Backbone


class ContextLengthExceeded(ATSError):
    """A prompt plus its new tokens do not fit the context."""


def context_length(backbone: Backbone) -> int:
    """The positions `backbone` was trained on: its config's `max_position_embeddings` (2048 if it names none)."""
    return int(getattr(backbone.model.config, "max_position_embeddings", None) or 2048)


def check_prompts(prompts: Sequence[Sequence[int]], *, vocab_size: int, max_model_len: int, max_tokens: int) -> None:
    """Refuse prompts (token ids) that cannot be decoded.

    Args:
        prompts: the prompts' token ids.
        vocab_size: ids must be in [0, vocab_size).
        max_model_len: the context (`context_length`, or a server's smaller limit).
        max_tokens: the new tokens each prompt may get.

    Raises:
        ATSError: naming the prompt, if one is empty or has a token id outside the vocabulary;
            `ContextLengthExceeded` if prompt + max_tokens is over the context.
    """
    for i, prompt in enumerate(prompts):
        if not len(prompt):
            raise ATSError(f"prompt {i}: empty (no tokens)")
        bad = [t for t in prompt if not 0 <= t < vocab_size]
        if bad:
            raise ATSError(f"prompt {i}: token id {bad[0]} is outside the vocabulary (0..{vocab_size - 1})")
        if len(prompt) + max_tokens > max_model_len:
            raise ContextLengthExceeded(f"this model's maximum context length is {max_model_len} tokens, but prompt "
                                        f"{i} has {len(prompt)} tokens and max_tokens is {max_tokens}")
