"""The head registry: `@register_head(name)` on a head class with `from_config(config)`; `build_head` looks the
configured type up, so a new head is one decorated class (lm-eval's `register_task` style)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import Tensor, nn

from ...errors import ATSError

if TYPE_CHECKING:
    from .config import HeadConfig

HEADS: dict[str, type[nn.Module]] = {}  # head type -> class, in registration order


def register_head(name: str):
    """Class decorator: register a head class under `name` (`HeadConfig.head_type`); it must define
    `from_config(config) -> module`.

    Raises:
        ATSError: if `name` is taken by another class.
    """

    def wrap(cls: type[nn.Module]) -> type[nn.Module]:
        if HEADS.get(name, cls) is not cls:
            raise ATSError(f"head type {name!r} is already registered by {HEADS[name].__name__}")
        HEADS[name] = cls
        return cls

    return wrap


def build_head(config: HeadConfig) -> nn.Module:
    """The head described by `config`, at identity (tau == 0).

    Args:
        config: the head type and sizes (defaults already filled in).

    Returns:
        The registered head class's `from_config(config)`.

    Raises:
        ATSError: if no head is registered under `config.head_type`.
    """
    if config.head_type not in HEADS:
        raise ATSError(f"head_type: unknown head {config.head_type!r} (one of {', '.join(HEADS)})")
    return HEADS[config.head_type].from_config(config)


def tau_at(head: nn.Module, hidden: Tensor, attention_mask: Tensor | None, index: Tensor) -> Tensor:
    """tau (B, K) of any head at positions `index` (B, K): the transformer head computes only those positions'
    queries (`TransformerHead.forward_at`), the per-token heads gather their output.

    Args:
        head: a head built by `build_head`.
        hidden: (B, T, H) hidden states.
        attention_mask: (B, T), 1 on real tokens; None: all real.
        index: (B, K) long positions.

    Returns:
        tau (B, K) float32.
    """
    if hasattr(head, "forward_at"):  # a head that can compute only the asked positions (the transformer head)
        return head.forward_at(hidden, attention_mask, index)
    return head(hidden, attention_mask).gather(1, index.to(hidden.device))
