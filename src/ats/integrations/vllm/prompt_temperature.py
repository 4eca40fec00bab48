"""Thermometer's one temperature per request inside vLLM: an attention layer whose keys and values live in vLLM's
paged KV cache beside the base model's, so that the temperature read at the prompt's last token is kept across
steps by the cache itself (prefix caching, chunked prefill, preemption and continuous batching treat it as one more
layer).

At every scheduled position t the layer writes
    key   k_t = the 32 bits of t, one-hot per bit ([b, 1 - b] for each bit b: 64 entries of 0 and 1)
    value v_t = s(h_t), Thermometer's inverse temperature as if the prompt ended at t, as three pieces
                hi + mid + lo in the cache's dtype (each the rounding of what the previous left): exact in
                float32, within 2^-23 relative in bfloat16 and 2^-18 in float16 over s in [0.01, 100] (tested),
                where a 16-bit s alone would be off by about 2^-9 (0.2%); the sum is taken in float32
and reads with the query q_t = W x the one-hot bits of p_t = min(P - 1, t), P the request's prompt length (from
`prompt_lens`, filled per step by `runner_patch`), softmax scale 1. The score of key j is W x (the bits j and p_t
share): 32 W at j = p_t, at most 31 W elsewhere, so with W = 64 every other key weighs below e^-64 (1.6e-28) of it
and the output is v at p_t to float32 rounding. The scores are multiples of 64 up to 2048, exact in float16,
bfloat16 and float32, so the selection does not depend on how an attention kernel rounds. The layer attends over
every earlier position, also on a base model with a sliding window (`compat.full_attention`).

Why the position and not a flag at the prompt's end: a cached block may hold another request's prompt end (in a
chat, the next turn's prompt starts with this turn's prompt and answer); each request selects its own P - 1,
whose value depends only on the tokens up to it, the same whoever computed it. Rows before the prompt's end
(prompt logprobs) select their own position: the temperature of the prompt so far (the front end refuses prompt
logprobs for these exports: `runner_patch`).

The layer is compiled as the base model is (vLLM's `support_torch_compile`, under the model tag "ats_prompt": a
graph of its own, split at its attention like the base's, its artifacts cached apart); with --enforce-eager both
run eagerly. Run eagerly beside a compiled base it cost vLLM 6-10% of its tokens/s on 2 CPU cores at 1-16 clients,
compiled 0-4% (`benchmarks/results/vllm_compiled_thermometer_eager.md`, `vllm_compiled_thermometer.md`).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from vllm.compilation.decorators import support_torch_compile
from vllm.config import VllmConfig
from vllm.model_executor.layers.attention import Attention

from ...calibrators.base import Calibrator
from .compat import full_attention

BITS = 32  # positions below 2^32
HEAD_SIZE = 2 * BITS  # one-hot per bit; also the value's width (3 entries used)
SELECT = 64.0  # W: the score margin of the selected position over any other


def position_bits(positions: Tensor, dtype: torch.dtype) -> Tensor:
    """(N, 64) the one-hot bits of positions (N,): [b_0, 1 - b_0, b_1, 1 - b_1, ...], in `dtype` (exact)."""
    shifts = torch.arange(BITS, device=positions.device, dtype=torch.int64)  # (32,)
    bits = (positions.long()[:, None] >> shifts) & 1  # (N, 32)
    return torch.stack([bits, 1 - bits], dim=-1).reshape(-1, HEAD_SIZE).to(dtype)  # (N, 64)


def split_value(s: Tensor, dtype: torch.dtype) -> Tensor:
    """(N, 64) the value row holding s (N,) float32 as hi + mid + lo in `dtype`, zeros after."""
    hi = s.to(dtype)
    rest = s - hi.float()
    mid = rest.to(dtype)
    lo = (rest - mid.float()).to(dtype)
    value = s.new_zeros((s.shape[0], HEAD_SIZE), dtype=dtype)  # (N, 64)
    value[:, 0], value[:, 1], value[:, 2] = hi, mid, lo
    return value


def joined_value(value: Tensor) -> Tensor:
    """s (N,) float32 from value rows (N, 64) written by `split_value`."""
    return value[:, 0].float() + value[:, 1].float() + value[:, 2].float()


@support_torch_compile(dynamic_arg_dims={"positions": 0, "prompt_lens": 0, "hidden": 0})
class PagedPromptTemperature(nn.Module):
    """s (N,) float32 for the N scheduled tokens of a vLLM step: each request's Thermometer scale, read at its
    prompt's last token (see the module docstring).

    Args:
        calibrator: the Thermometer (weights loaded, float32), run as it is.
        vllm_config: the engine's config (cache dtype, block size).
        layer_index: the layer's index in vLLM's layer naming: one past the base model's layers.

    Build it under `vllm.compilation.backends.set_model_tag("ats_prompt")` (keyword arguments only: vLLM's
    compilation decorator wraps `__init__`).
    """

    def __init__(self, *, calibrator: Calibrator, vllm_config: VllmConfig, layer_index: int) -> None:
        super().__init__()
        self.calibrator = calibrator
        self.dtype = vllm_config.model_config.dtype
        with full_attention(vllm_config.cache_config):  # a base model's window must not hide the prompt's end
            self.attn = Attention(1, HEAD_SIZE, 1.0, num_kv_heads=1, cache_config=vllm_config.cache_config,
                                  prefix=f"ats_prompt.layers.{layer_index}")

    def forward(self, positions: Tensor, prompt_lens: Tensor, hidden: Tensor) -> Tensor:
        """s (N,) float32 from absolute `positions` (N,), each token's request's prompt length `prompt_lens` (N,)
        and the final hidden states (N, H)."""
        own = self.calibrator.inverse_temperature(hidden).float()  # (N,) s as if the prompt ended here
        target = torch.minimum(prompt_lens.long() - 1, positions.long()).clamp(min=0)  # (N,) p_t
        query = position_bits(target, self.dtype) * SELECT  # (N, 64)
        key = position_bits(positions, self.dtype)  # (N, 64)
        out = self.attn(query, key, split_value(own, self.dtype))  # (N, 64)
        return joined_value(out.view(-1, HEAD_SIZE))
