"""The paper's head (one Llama decoder layer, then a norm and H -> 1) built from vLLM's own layers, so that its keys
and values live in vLLM's paged KV cache beside the base model's: prefix caching, chunked prefill and continuous
batching treat it as one more layer of the model.

vLLM's `LlamaDecoderLayer` is `TransformerHead`'s layer to the operation (RMSNorm eps 1e-6, neox-style RoPE on the
absolute positions, full attention with one key/value head per query head (also over a base model with a
sliding window: `compat.full_attention`), SwiGLU), sharded across tensor-parallel
ranks like the base model's layers; the head's final norm and projection (1 output) are replicated, run in
float32, and taken from the loaded calibrator itself.

The head is compiled as the base model is (vLLM's `support_torch_compile`: its own graph, split at its attention
like the base's, under the model tag "ats_head" so its compiled artifacts are cached apart from the base's); with
--enforce-eager both run eagerly. Run eagerly beside a compiled base, its few dozen operators cost vLLM 5-9% of
its tokens/s on 2 CPU cores at 1-16 clients (`benchmarks/results/vllm_compiled_eager_head.md`).
"""

from __future__ import annotations

from torch import Tensor, nn
from transformers import LlamaConfig
from vllm.compilation.decorators import support_torch_compile
from vllm.config import VllmConfig
from vllm.model_executor.models.llama import LlamaDecoderLayer

from ...calibrators.ats import ATSCalibrator
from ...errors import ATSError
from .compat import full_attention

# our TransformerHead's state-dict key -> (the vLLM layer's parameter, shard id or None)
_LAYER_KEYS = {
    "input_norm.weight": ("input_layernorm.weight", None),
    "attn.q_proj.weight": ("self_attn.qkv_proj.weight", "q"),
    "attn.k_proj.weight": ("self_attn.qkv_proj.weight", "k"),
    "attn.v_proj.weight": ("self_attn.qkv_proj.weight", "v"),
    "attn.o_proj.weight": ("self_attn.o_proj.weight", None),
    "post_attn_norm.weight": ("post_attention_layernorm.weight", None),
    "mlp.gate_proj.weight": ("mlp.gate_up_proj.weight", 0),
    "mlp.up_proj.weight": ("mlp.gate_up_proj.weight", 1),
    "mlp.down_proj.weight": ("mlp.down_proj.weight", None),
}


class _HeadLayer(LlamaDecoderLayer):
    """vLLM's Llama layer, never quantized (the head is small and trained in float32)."""

    def get_quant_config(self, vllm_config: VllmConfig):
        return None


def check_layout(head: nn.Module) -> None:
    """Refuse a head that attends over earlier positions without the transformer head's layout."""
    missing = sorted(set(_LAYER_KEYS) - set(head.state_dict()))
    if missing:
        raise ATSError(f"calibration head {type(head).__name__} attends over earlier positions but has no "
                       f"{missing[0]!r}: vLLM's paged layer takes the transformer head's layout")


@support_torch_compile(dynamic_arg_dims={"positions": 0, "hidden": 0})
class PagedTransformerHead(nn.Module):
    """tau (N,) for the N scheduled tokens of a vLLM step from their final hidden states (N, H).

    Args:
        calibrator: the ATS calibrator (weights loaded) whose head is a `TransformerHead`; its final norm and
            projection are reused as they are.
        vllm_config: the engine's config (cache, parallelism, maximum length).
        layer_index: the layer's index in vLLM's layer naming: one past the base model's layers, so its KV cache
            is bound after theirs.

    Build it under `vllm.compilation.backends.set_model_tag("ats_head")` (keyword arguments only: vLLM's
    compilation decorator wraps `__init__`).
    """

    def __init__(self, *, calibrator: ATSCalibrator, vllm_config: VllmConfig, layer_index: int) -> None:
        super().__init__()
        sizes, head = calibrator.config_.head, calibrator.head
        check_layout(head)
        ranks = vllm_config.parallel_config.tensor_parallel_size
        if sizes.num_heads % ranks:
            raise ATSError(f"the calibration head's {sizes.num_heads} attention heads do not divide among "
                           f"{ranks} tensor-parallel ranks")
        config = LlamaConfig(
            hidden_size=sizes.hidden_size, num_attention_heads=sizes.num_heads, num_key_value_heads=sizes.num_heads,
            head_dim=sizes.hidden_size // sizes.num_heads, intermediate_size=sizes.intermediate_size,
            hidden_act="silu", rms_norm_eps=head.input_norm.eps, attention_bias=False, mlp_bias=False,
            max_position_embeddings=vllm_config.model_config.max_model_len,
            rope_parameters={"rope_type": "default", "rope_theta": sizes.rope_theta})
        with full_attention(vllm_config.cache_config):  # ats's head attends over every earlier position
            self.layer = _HeadLayer(vllm_config, prefix=f"ats_head.layers.{layer_index}", config=config)
        self.final_norm = head.final_norm  # RMSNorm, or the identity for the paper's released heads
        self.proj = head.proj
        self._source = {k: v for k, v in head.state_dict().items() if k in _LAYER_KEYS}

    def load_layer_weights(self) -> set[str]:
        """Copy the calibrator's layer weights into vLLM's (sharded) parameters; the names loaded."""
        params = dict(self.layer.named_parameters())
        loaded = set()
        for key, (name, shard) in _LAYER_KEYS.items():
            param = params[name]
            loader = getattr(param, "weight_loader", None)
            tensor = self._source[key].to(param.dtype)
            if loader is None:
                param.data.copy_(tensor)
            elif shard is None:
                loader(param, tensor)
            else:
                loader(param, tensor, shard)
            loaded.add(f"layer.{name}")
        self._source = {}
        return loaded | {f"{n}" for n, _ in self.named_parameters() if not n.startswith("layer.")}

    def forward(self, positions: Tensor, hidden: Tensor) -> Tensor:
        """tau (N,) float32 from hidden states (N, H) at absolute `positions` (N,)."""
        x, residual = self.layer(positions, hidden, None)
        x = (x + residual).float()  # (N, H)
        return self.proj(self.final_norm(x)).squeeze(-1).float()  # (N,)

