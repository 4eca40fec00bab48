"""Settings under which vLLM's CPU backend starts on a shared machine, for `ats serve --engine vllm`.

Left to itself, vLLM's CPU backend keeps one core per rank back for its scheduler (half of a 2-core machine), binds
its threads by NUMA node and SMT sibling ("auto": one logical CPU per physical core), and reserves 92% of the
machine's memory (`gpu_memory_utilization`), dying at start in a traceback when anything else holds 8% of it. Here,
for every setting the user has not made (environment or vLLM option), `cpu_settings` chooses:

    VLLM_CPU_NUM_OF_RESERVED_CPU  0 on machines of up to 4 cores (vLLM's own default above that: one per rank)
    VLLM_CPU_OMP_THREADS_BIND     this process's cores (its affinity: taskset, cgroups) less the reserved ones,
                                  split among the tensor-parallel ranks ("0-1", "0|1")
    VLLM_CPU_KVCACHE_SPACE        the KV cache sized to the model (GiB, rounded up): room for the longest sequence
                                  and for --max-num-seqs sequences of up to CHAT_TOKENS tokens each; with it set,
                                  vLLM reserves that instead of 92% of the machine

and `check_memory` compares the weights, that KV cache and the engine's own memory with what is available now,
refusing in one line naming the setting and the numbers before anything starts.
"""

from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path

from ...errors import ATSError

GIB = 1 << 30
CHAT_TOKENS = 2048  # tokens per concurrent sequence the default KV cache holds (prompt + answer of a chat turn)
RUNTIME_BYTES = int(1.5 * GIB)  # the engine's own memory beside weights and KV cache: an estimate (its API server
# and engine-core processes each hold about 0.7 GiB after importing torch and vLLM here)
SMALL_MACHINE = 4  # cores up to which no core is kept back for vLLM's scheduler
DTYPE_BYTES = {"float32": 4, "float": 4, "float16": 2, "half": 2, "bfloat16": 2, "F32": 4, "F16": 2, "BF16": 2,
               "F64": 8, "I8": 1, "U8": 1, "I32": 4, "I64": 8, "BOOL": 1}
ENV_RESERVED, ENV_BIND, ENV_KV = "VLLM_CPU_NUM_OF_RESERVED_CPU", "VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_KVCACHE_SPACE"


@dataclass
class CPUSettings:
    """What `cpu_settings` chose: the environment variables to add, and why (one log line each)."""

    env: dict[str, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    kv_bytes: int | None = None  # the KV cache vLLM will reserve, when known (chosen or set by the user)
    kv_setting: str | None = None  # the setting that sized it, for the error


def _ranges(cores: list[int]) -> str:
    """[0, 1, 2, 5] -> "0-2,5" (vLLM's list syntax)."""
    parts, start = [], None
    for i, core in enumerate(cores):
        if start is None:
            start = core
        if i + 1 == len(cores) or cores[i + 1] != core + 1:
            parts.append(str(start) if start == core else f"{start}-{core}")
            start = None
    return ",".join(parts)


def weights_bytes(folder: Path, dtype_bytes: int) -> int:
    """The model's weights in memory at `dtype_bytes` per floating-point element (safetensors headers; the files'
    sizes without safetensors)."""
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        return sum(p.stat().st_size for p in folder.glob("*.bin"))
    total = 0
    for path in files:
        with path.open("rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(size))
        for name, entry in header.items():
            if name == "__metadata__":
                continue
            count = math.prod(entry["shape"])
            stored = DTYPE_BYTES.get(entry["dtype"], 4)
            total += count * (dtype_bytes if entry["dtype"] in ("F32", "F16", "BF16") else stored)
    return total


def kv_bytes_per_token(config, dtype_bytes: int, head_width: int = 0) -> int:
    """Bytes of KV cache one token takes: keys and values of every layer (plus the calibration head's layer,
    `head_width` wide, when it runs in the paged cache)."""
    text = config.get_text_config()
    kv_heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
    return 2 * dtype_bytes * (text.num_hidden_layers * kv_heads * base_head_size(text) + head_width)


def base_head_size(text_config) -> int:
    """A transformers text config's attention head size: its `head_dim`, else hidden size / attention heads."""
    return getattr(text_config, "head_dim", None) or text_config.hidden_size // text_config.num_attention_heads


def cpu_settings(environ: dict[str, str], options: dict, *, folder: Path, config, dtype_bytes: int,
                 max_model_len: int, max_num_seqs: int, tensor_parallel: int, head_width: int = 0,
                 cores: list[int] | None = None) -> CPUSettings:
    """The settings to add for vLLM's CPU backend (see the module docstring), never one the user made.

    Args:
        environ: the environment vLLM will get.
        options: the vLLM options the user gave (dest -> value: only those given).
        folder: the export (its weights). config: its transformers config.
        dtype_bytes: bytes per element of the served dtype (and of the KV cache).
        max_model_len, max_num_seqs, tensor_parallel: the engine's.
        head_width: the calibration head's KV width per token when it runs in the paged cache (0 otherwise).
        cores: the cores this process may use (default: its affinity).

    Raises:
        ATSError: fewer usable cores than tensor-parallel ranks.
    """
    out = CPUSettings()
    cores = sorted(os.sched_getaffinity(0)) if cores is None else sorted(cores)
    if ENV_RESERVED in environ:
        reserved = int(environ[ENV_RESERVED])
    else:
        reserved = 0 if len(cores) <= SMALL_MACHINE else tensor_parallel  # vLLM's default above small machines
        out.env[ENV_RESERVED] = str(reserved)
        out.notes.append(f"{ENV_RESERVED}={reserved}: {len(cores)} cores here"
                         + (" (vLLM would keep one per rank back for its scheduler)" if reserved == 0 else ""))
    if ENV_BIND not in environ:
        usable = cores[:len(cores) - reserved] if reserved else cores
        if len(usable) < tensor_parallel:
            raise ATSError(f"{ENV_BIND}: {len(usable)} usable cores ({len(cores)} less {ENV_RESERVED}={reserved}) "
                           f"for {tensor_parallel} tensor-parallel ranks; set {ENV_BIND} (e.g. '0|1')")
        per = len(usable) // tensor_parallel
        bind = "|".join(_ranges(usable[r * per:(r + 1) * per]) for r in range(tensor_parallel))
        out.env[ENV_BIND] = bind
        out.notes.append(f"{ENV_BIND}={bind}: this process's cores, split among {tensor_parallel} rank(s) "
                         f"(vLLM's 'auto' binds one logical CPU per physical core of a NUMA node)")
    if ENV_KV in environ and environ[ENV_KV] != "":
        out.kv_bytes, out.kv_setting = int(environ[ENV_KV]) * GIB, f"{ENV_KV}={environ[ENV_KV]}"
    elif options.get("kv_cache_memory_bytes") is not None:
        out.kv_bytes = int(options["kv_cache_memory_bytes"])
        out.kv_setting = f"--kv-cache-memory-bytes {options['kv_cache_memory_bytes']}"
    elif "gpu_memory_utilization" not in options:
        tokens = max(max_model_len, max_num_seqs * min(max_model_len, CHAT_TOKENS))
        gib = max(1, math.ceil(tokens * kv_bytes_per_token(config, dtype_bytes, head_width) / GIB))
        out.env[ENV_KV] = str(gib)
        out.kv_bytes, out.kv_setting = gib * GIB, f"{ENV_KV}={gib}"
        out.notes.append(f"{ENV_KV}={gib} (GiB of KV cache: {tokens} tokens, a {max_model_len}-token sequence or "
                         f"{max_num_seqs} of up to {min(max_model_len, CHAT_TOKENS)}; vLLM would reserve 92% of "
                         f"the machine's memory)")
    return out


def available_memory() -> tuple[int, int]:
    """(available, total) bytes of memory now (the kernel's MemAvailable)."""
    import psutil

    memory = psutil.virtual_memory()
    return int(memory.available), int(memory.total)


def check_memory(settings: CPUSettings, options: dict, *, weights: int, available: int, total: int) -> str:
    """Refuse a start the memory available now cannot hold; the plan as one line for the log.

    Args:
        settings: `cpu_settings`'s (the KV cache and the setting that sized it).
        options: the vLLM options the user gave (`gpu_memory_utilization` when no KV cache size is set).
        weights: the weights' bytes. available, total: the machine's memory now.

    Raises:
        ATSError: one line naming the setting, what it asks and what is available.
    """
    gib = lambda n: f"{n / GIB:.2f} GiB"  # noqa: E731
    if settings.kv_bytes is None:  # the user chose a share of the machine: vLLM asks for it whole at start
        share = float(options["gpu_memory_utilization"])
        wanted = math.ceil(total * share)
        if wanted > available:
            raise ATSError(f"--gpu-memory-utilization {share}: vLLM's CPU backend reserves that share of the "
                           f"machine's memory ({gib(wanted)} of {gib(total)}) and {gib(available)} is available; "
                           f"lower it, or unset it to size the KV cache to the model")
        return f"memory: --gpu-memory-utilization {share} ({gib(wanted)}), {gib(available)} available"
    wanted = weights + settings.kv_bytes + RUNTIME_BYTES
    if wanted > available:
        raise ATSError(f"{settings.kv_setting}: vLLM needs about {gib(wanted)} (weights {gib(weights)}, KV cache "
                       f"{gib(settings.kv_bytes)}, engine {gib(RUNTIME_BYTES)}) and {gib(available)} of "
                       f"{gib(total)} is available; lower it (or --max-model-len / --max-batch), or free memory")
    return (f"memory: weights {gib(weights)} + KV cache {gib(settings.kv_bytes)} ({settings.kv_setting}) + engine "
            f"{gib(RUNTIME_BYTES)}, {gib(available)} available")
