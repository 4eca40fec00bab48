"""The head registry: head type -> the class that builds it (`from_config(config)`), named as "module:Class" and
imported on first use, so the names load without torch (`HeadConfig`'s choices, the CLI's --head). A new head is one
class and one line in `HEADS` (or `@register_head(name)` on a class outside this package)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ...errors import ATSError
from ...lazy import load

if TYPE_CHECKING:
    from torch import Tensor, nn

    from .config import HeadConfig

# head type -> its class, or "module:Class" (relative to this package) until first used; in --help's order
HEADS: dict[str, str | type[nn.Module]] = {
    "constant": ".simple:ConstantHead",
    "linear": ".simple:LinearHead",
    "mlp": ".simple:MLPHead",
    "transformer": ".transformer:TransformerHead",
}


def head_class(name: str) -> type[nn.Module]:
    """The class registered under head type `name`, imported on first use.

    Raises:
        ATSError: if no head is registered under `name`.
    """
    if name not in HEADS:
        raise ATSError(f"head_type: unknown head {name!r} (one of {', '.join(HEADS)})")
    if isinstance(HEADS[name], str):
        HEADS[name] = load(HEADS[name], __package__)
    return HEADS[name]


def register_head(name: str):
    """Class decorator: register a head class under `name` (`HeadConfig.head_type`); it must define
    `from_config(config) -> module`.

    Raises:
        ATSError: if `name` is taken by another class.
    """

    def wrap(cls: type[nn.Module]) -> type[nn.Module]:
        if name in HEADS and head_class(name) is not cls:
            raise ATSError(f"head type {name!r} is already registered by {head_class(name).__name__}")
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
    return head_class(config.head_type).from_config(config)


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
