"""`HeadConfig`: which head and its sizes (defaults derived from the backbone's hidden size); torch-free, so the
CLI's options load without torch."""

from __future__ import annotations

import math
from dataclasses import dataclass

from ...config import ConfigMixin, option
from ...errors import ATSError
from .registry import HEADS

HEAD_TYPES = tuple(HEADS)  # ("constant", "linear", "mlp", "transformer"): the registry's names, in its order
# the clamp on s = exp(tau), the factor on the logits (the reference code's max_temperature, also the paper's released
# heads'): `ATSConfig.max_scale`'s default and the range of the default scale summary
MAX_SCALE = 10.0


# --------------------------------------------------------------------------------------------------------------------
# config


def default_num_heads(hidden_size: int) -> int:
    """Head dim 64 when H is a multiple of 64 (576 -> 9 heads); otherwise the divisor of H whose (even) head dim is
    closest to 64 (32 -> 1 head of 32).

    Args:
        hidden_size: H.

    Returns:
        The number of attention heads (1 when H is odd: `HeadConfig` then refuses it).
    """
    if hidden_size % 64 == 0:
        return hidden_size // 64
    candidates = [n for n in range(1, hidden_size + 1) if hidden_size % n == 0 and (hidden_size // n) % 2 == 0]
    if not candidates:
        return 1  # odd hidden size: rejected by HeadConfig with a clear message (RoPE needs an even head dim)
    return min(candidates, key=lambda n: (abs(hidden_size // n - 64), n))


def default_intermediate_size(hidden_size: int, multiple_of: int = 256) -> int:
    """Llama's SwiGLU width: 8/3 * H rounded up to a multiple of 256 (576 -> 1536 as in SmolLM2, 4096 -> 11008).

    Args:
        hidden_size: H.
        multiple_of: the width is rounded up to a multiple of this.

    Returns:
        The intermediate size.
    """
    width = int(8 * hidden_size / 3)
    return multiple_of * math.ceil(width / multiple_of)


@dataclass
class HeadConfig(ConfigMixin):
    """Which head to build and its sizes. Sizes left as None are filled from `hidden_size` (see the defaults above)."""

    head_type: str = option("transformer", "calibration head: constant (one global temperature, the control), "
                            "linear, mlp, or transformer (one decoder layer, the paper's)", choices=HEAD_TYPES,
                            flag="--head")
    hidden_size: int = option(576, "backbone hidden size", cli=False, low=1)
    mlp_hidden: int | None = option(None, "MLP head width (default: hidden size)", cli=False, low=1)
    num_heads: int | None = option(None, "transformer head: attention heads (default: head dim 64)", cli=False, low=1)
    intermediate_size: int | None = option(None, "transformer head: SwiGLU width (default: Llama's 8/3 H)",
                                           cli=False, low=1)
    rope_theta: float = option(10000.0, "transformer head: RoPE base", cli=False, low=0, low_open=True)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.mlp_hidden is None:
            self.mlp_hidden = self.hidden_size
        if self.num_heads is None:
            self.num_heads = default_num_heads(self.hidden_size)
        if self.intermediate_size is None:
            self.intermediate_size = default_intermediate_size(self.hidden_size)
        if self.head_type == "transformer":
            if self.hidden_size % self.num_heads != 0:
                raise ATSError(f"num_heads: hidden_size {self.hidden_size} is not divisible by num_heads "
                               f"{self.num_heads}")
            if (self.hidden_size // self.num_heads) % 2 != 0:
                raise ATSError(f"num_heads: head dim {self.hidden_size // self.num_heads} "
                               f"(hidden_size {self.hidden_size} / num_heads {self.num_heads}) must be even for RoPE")
