"""`ATSCalibratedForCausalLM`: vLLM's own model class of the base architecture, composed with a calibrator.

    forward(ids, positions)  -> h (N, H) from the base model; with a per-token head also tau (N,), with
                                Thermometer its request's s = 1/T (N,): returns [h, tau or s] (N, H + 1) in float32,
                                so the factor travels with h to the sampled rows
    compute_logits(rows)     -> q = z * exp(tau).clamp(max_scale)   (the ATS family: `ATSCalibrator.scale`)
                                q = z * s                          (Thermometer: `prompt_temperature`)
                                q = calibrator.apply(z)            (temperature, vector scaling, none)
                                both in float32 whatever the model's dtype, as ats's decoding core computes them
                                (a bfloat16 scale would be rounded by up to 2^-8, 0.4%)

Every row vLLM samples from or scores (sampled tokens, prompt logprobs) passes through `compute_logits`, so the
logprobs of vLLM's OpenAI server and of lm-eval's `vllm` model are the calibrated ones (vLLM's default
`logprobs_mode="raw_logprobs"`), and a user's sampling temperature applies on top. The head's tau is computed where
hidden states are made, at every scheduled token, because the paper's transformer head attends over earlier
positions (its keys and values are in vLLM's KV cache: `head.PagedTransformerHead`); the context-free heads
(constant, linear, MLP) run as the calibrator's own modules. Thermometer's one temperature per request is read at
the prompt's last token and kept in the paged KV cache by an attention layer of its own
(`prompt_temperature.PagedPromptTemperature`), which needs each token's prompt length: vLLM's runners hand it to
`set_prompt_lens` every step (`runner_patch`), into a persistent buffer. Scaling h instead of z (`W (h s)`) would
need no extra column but is exact only in real numbers (lm_eval_model.py's docstring measured the difference), so
tau is carried.

The base class is whatever vLLM has for the `base_architecture` of the export (Llama, Qwen2, ...): one class for
all, by composition. How a head runs is decided by what it is (`export.head_route`: its class's `reads_context`).
Setups it cannot serve (hidden-state speculative decoders, quantized base weights, pipeline parallelism, the
pooling runner, LoRA) are refused before the base model is built (`compat.check_vllm_config`).
"""

from __future__ import annotations

from collections.abc import Iterable
from contextlib import contextmanager
from pathlib import Path

import torch
from torch import Tensor, nn
from vllm.config import VllmConfig
from vllm.model_executor.models import ModelRegistry

import vllm

from ...calibrators import Calibrator, load_calibrator
from ...errors import ATSError
from ...hub import resolve_folder
from . import CONFIG_KEY
from .compat import check_version, check_vllm_config, cpu_attention_head_sizes, head_size_refusal
from .export import attention_head_sizes, check_engine_calibrator, head_route


@contextmanager
def _float32_on_cpu():
    """Build tensors on the CPU in float32 (vLLM builds the model under the model's dtype and device)."""
    dtype = torch.get_default_dtype()
    torch.set_default_dtype(torch.float32)
    try:
        with torch.device("cpu"):
            yield
    finally:
        torch.set_default_dtype(dtype)


def _load_exported_calibrator(vllm_config: VllmConfig, record: dict) -> Calibrator | None:
    """The export's calibrator, in float32 on the CPU, or None for `none`."""
    if record.get("calibrator") is None:
        return None
    folder = resolve_folder(vllm_config.model_config.model, revision=vllm_config.model_config.revision)
    with _float32_on_cpu():
        calibrator = load_calibrator(Path(folder) / record["calibrator"])
    check_engine_calibrator(calibrator, f"{record['calibrator']!r}")
    return calibrator


def _check_head_sizes(vllm_config: VllmConfig, calibrator: Calibrator | None) -> None:
    """On CPUs, refuse attention head sizes vLLM's CPU attention does not run (`compat.head_size_refusal`), which
    would otherwise kill the engine at its first request."""
    supported = cpu_attention_head_sizes()
    if not supported:
        return
    reason = head_size_refusal(attention_head_sizes(vllm_config.model_config.hf_config, calibrator), supported)
    if reason is not None:
        raise ATSError(f"{vllm_config.model_config.model}: {reason}")


class ATSCalibratedForCausalLM(nn.Module):
    """A base model of any architecture vLLM supports with a calibrator inside (see the module docstring).

    Args:
        vllm_config: the engine's config; `model_config.hf_config` is the exported config.json, whose
            "ats_calibration" record names the base architecture and the calibrator folder.
        prefix: the model's name prefix (vLLM's convention), passed to the base model.
    """

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__()
        check_version(vllm.__version__)  # the plugin only warns on a vLLM it does not support: an export stops here
        check_vllm_config(vllm_config)
        hf_config = vllm_config.model_config.hf_config
        record = getattr(hf_config, CONFIG_KEY, None)
        if not isinstance(record, dict) or "base_architecture" not in record:
            raise ATSError(f"{vllm_config.model_config.model}: config.json has no {CONFIG_KEY!r} record naming the "
                           f"base architecture; make the folder with `ats export --engine vllm`")
        calibrator = _load_exported_calibrator(vllm_config, record)
        _check_head_sizes(vllm_config, calibrator)
        base_class, _ = ModelRegistry.resolve_model_cls([record["base_architecture"]], vllm_config.model_config)
        self.base = base_class(vllm_config=vllm_config, prefix=prefix)
        self.calibrator = calibrator
        self.dtype = vllm_config.model_config.dtype
        self.head: nn.Module | None = None
        self.paged = False  # the head attends over earlier positions (the paper's transformer head)
        self.prompt: nn.Module | None = None  # Thermometer's per-request temperature, kept in the paged cache
        self.needs_prompt_lens = False  # read by `runner_patch`: the runners hand over each token's prompt length
        route = head_route(self.calibrator)
        if route == "prompt":
            self._build_prompt_temperature(vllm_config, hf_config.num_hidden_layers)
        elif route != "logits":
            device = torch.get_default_device()
            if route == "paged":
                from vllm.compilation.backends import set_model_tag

                from .head import PagedTransformerHead

                with set_model_tag("ats_head"):  # compiled as a graph of its own, cached apart from the base's
                    self.head = PagedTransformerHead(calibrator=self.calibrator, vllm_config=vllm_config,
                                                     layer_index=hf_config.num_hidden_layers)
                self.paged = True
                self.head.final_norm.to(device)
                self.head.proj.to(device)
            else:
                self.head = self.calibrator.head.to(device)  # constant, linear, MLP: per token, float32
        elif self.calibrator is not None:
            self.calibrator.to(torch.get_default_device())

    def _build_prompt_temperature(self, vllm_config: VllmConfig, layer_index: int) -> None:
        """Thermometer's layer, the per-token prompt lengths' buffer (as many as a step schedules, persistent for
        CUDA graphs) and the V2 runner's model state that fills it."""
        from vllm.compilation.backends import set_model_tag

        from .prompt_temperature import PagedPromptTemperature
        from .runner_patch import v2_model_state, wrap_v1_runner

        device = torch.get_default_device()
        self.calibrator.to(device)
        with set_model_tag("ats_prompt"):  # compiled as a graph of its own, cached apart from the base's
            self.prompt = PagedPromptTemperature(calibrator=self.calibrator, vllm_config=vllm_config,
                                                 layer_index=layer_index)
        size = vllm_config.scheduler_config.max_num_batched_tokens  # as the runners size their input_ids buffers
        self.register_buffer("prompt_lens", torch.zeros(size, dtype=torch.int32, device=device), persistent=False)
        self.needs_prompt_lens = True
        wrap_v1_runner()  # the V1 runner, building this model, hands the lengths every step from now on
        self.get_model_state_cls = v2_model_state  # the V2 runner asks the model for its ModelState class

    def set_prompt_lens(self, lens: Tensor) -> None:
        """Each scheduled token's request's prompt length (n,) int32 on the CPU, for this step (`runner_patch`)."""
        self.prompt_lens[: lens.shape[0]].copy_(lens, non_blocking=True)

    def embed_input_ids(self, input_ids: Tensor) -> Tensor:
        """The base model's token embeddings."""
        return self.base.embed_input_ids(input_ids)

    def forward(self, input_ids: Tensor | None, positions: Tensor, intermediate_tensors=None,
                inputs_embeds: Tensor | None = None, **kwargs) -> Tensor:
        """h (N, H) of the N scheduled tokens, with tau (a per-token head) or s (Thermometer) as one more column
        (N, H + 1)."""
        hidden = self.base(input_ids, positions, intermediate_tensors, inputs_embeds, **kwargs)  # (N, H)
        if self.prompt is not None:  # Thermometer: s of each token's request, from its prompt's end
            s = self.prompt(positions, self.prompt_lens[: positions.shape[0]], hidden)  # (N,)
            return torch.cat([hidden.float(), s[:, None]], dim=-1)  # (N, H + 1)
        if self.head is None:
            return hidden
        if self.paged:  # attends over the KV cache
            tau = self.head(positions, hidden)  # (N,)
        else:
            tau = self.calibrator.log_scale(hidden[None])[0]  # (N,)
        return torch.cat([hidden.float(), tau[:, None]], dim=-1)  # (N, H + 1)

    def compute_logits(self, hidden_states: Tensor) -> Tensor | None:
        """Calibrated logits (n, V) of the n rows vLLM samples from or scores: float32 (ats's decoding core makes
        z float32 before calibrating it; vLLM's sampler computes in float32 either way), the model's own without a
        calibrator."""
        if self.calibrator is None:
            return self.base.compute_logits(hidden_states)
        if self.head is None and self.prompt is None:  # temperature / vector scaling: a map of the logits
            logits = self.base.compute_logits(hidden_states)
            return None if logits is None else self.calibrator.apply(logits.float())
        hidden, carried = hidden_states[:, :-1].to(self.dtype), hidden_states[:, -1]  # (n, H), (n,) float32
        logits = self.base.compute_logits(hidden)  # (n, V) in the model's dtype
        if logits is None:
            return None
        scale = carried if self.prompt is not None else self.calibrator.scale(carried)  # (n,): s, or exp(tau)
        return logits.float() * scale.float()[:, None]  # (n, V) float32

    def load_weights(self, weights: Iterable[tuple[str, Tensor]]) -> set[str]:
        """The base model's weights from the folder (vLLM's loader), then the head's from the calibrator."""
        loaded = {f"base.{name}" for name in self.base.load_weights(weights)}
        if self.head is not None:
            names = self.head.load_layer_weights() if self.paged else {n for n, _ in self.head.named_parameters()}
            loaded |= {f"head.{name}" for name in names}
        return loaded
