"""The vLLM internals ats reaches into, where each lives in the releases read (0.32 to 0.34), and a check of the
installed vLLM against them: each is imported and its signature, fields and source read, so that a vLLM that moved
or changed one is named in one line ("vllm.x:Y.z: no parameter 'w' (what ats does with it)") instead of failing as a
traceback inside vLLM.

    python -m ats.integrations.vllm.surface        # every internal: where it was found, or what is wrong

`compat` runs the check for a vLLM outside the tested window that the user asked to try (`ATS_VLLM_ANY_VERSION=1`);
`locate` hands ats the internals that moved between releases (the first place listed that exists). The table is
kept whole by a test: every vLLM name ats's modules import is in it.
"""

from __future__ import annotations

import importlib
import inspect
import re
from dataclasses import dataclass, fields, is_dataclass

from ...errors import ATSError


@dataclass(frozen=True)
class Internal:
    """One vLLM internal ats uses.

    Attributes:
        where: "module:Qualified.name" places it may live, newest layout first ("module:" is the module itself).
        params: parameters its signature must have; any other parameter without a default is a problem too (ats
            would not pass it).
        fields: names a class (or object) must hold: attributes, dataclass fields, or `self.NAME` its source assigns.
        reads: strings its source must contain (a behaviour ats relies on, e.g. a hook it honours).
        optional: absent in some releases, where ats does without it (present, it must still match).
        use: what ats does with it (the end of a problem's line).
    """

    where: tuple[str, ...]
    use: str
    params: tuple[str, ...] = ()
    fields: tuple[str, ...] = ()
    reads: tuple[str, ...] = ()
    optional: bool = False

    @property
    def name(self) -> str:
        """The internal's last name (what `locate` takes)."""
        return self.where[0].rsplit(":", 1)[1].rsplit(".", 1)[-1] or self.where[0].rstrip(":")


INTERNALS: tuple[Internal, ...] = (
    Internal(("vllm:ModelRegistry",), "registers and resolves the calibrated architecture",
             fields=("register_model", "get_supported_archs", "resolve_model_cls")),
    Internal(("vllm.model_executor.models:ModelRegistry",), "resolves the export's base architecture",
             fields=("resolve_model_cls",)),
    Internal(("vllm.model_executor.models.registry:_ModelRegistry.resolve_model_cls",),
             "the base model's class from its architecture name", params=("architectures", "model_config")),
    Internal(("vllm.plugins:",), "the entry point group vLLM loads `register` from", reads=("vllm.general_plugins",)),
    Internal(("vllm.config:VllmConfig",), "reads the engine's setup",
             fields=("model_config", "cache_config", "parallel_config", "scheduler_config", "speculative_config",
                     "lora_config")),
    Internal(("vllm.config:ModelConfig",), "the export's record, dtype, length, quantization, runner, logprobs mode",
             fields=("hf_config", "model", "revision", "dtype", "max_model_len", "quantization", "runner_type",
                     "logprobs_mode")),
    Internal(("vllm.config:CacheConfig",), "builds the calibration layers without the base's sliding window",
             fields=("sliding_window", "cache_dtype")),
    Internal(("vllm.config:ParallelConfig",), "tensor-parallel heads, pipeline parallelism refused",
             fields=("tensor_parallel_size", "pipeline_parallel_size")),
    Internal(("vllm.config:SchedulerConfig",), "sizes Thermometer's prompt-length buffer",
             fields=("max_num_batched_tokens",)),
    Internal(("vllm.config:SpeculativeConfig",), "refuses drafters that read hidden states", fields=("method",)),
    Internal(("vllm.compilation.backends:set_model_tag",), "compiles the calibration layers as graphs of their own",
             params=("tag",)),
    Internal(("vllm.compilation.decorators:support_torch_compile",), "compiles the calibration layers",
             params=("dynamic_arg_dims",)),
    Internal(("vllm.model_executor.models.llama:LlamaDecoderLayer",), "the transformer head's layer",
             params=("vllm_config", "prefix", "config"), fields=("get_quant_config", "input_layernorm", "self_attn",
                                                                 "post_attention_layernorm", "mlp")),
    Internal(("vllm.model_executor.models.llama:LlamaDecoderLayer.forward",), "runs the transformer head's layer",
             params=("positions", "hidden_states", "residual")),
    Internal(("vllm.model_executor.models.llama:LlamaForCausalLM.forward",), "runs the base model",
             params=("input_ids", "positions", "intermediate_tensors", "inputs_embeds")),
    Internal(("vllm.model_executor.models.llama:LlamaForCausalLM.compute_logits",),
             "the base model's logits of the sampled rows, before calibration", params=("hidden_states",)),
    Internal(("vllm.model_executor.models.llama:LlamaForCausalLM",), "embeds tokens and loads the base weights",
             fields=("embed_input_ids", "load_weights")),
    Internal(("vllm.model_executor.layers.attention:Attention",), "keeps Thermometer's temperature in the KV cache",
             params=("num_heads", "head_size", "scale", "num_kv_heads", "cache_config", "prefix")),
    Internal(("vllm.v1.engine.input_processor:InputProcessor._validate_params",),
             "refuses prompt logprobs for a Thermometer export", params=("params", "supported_tasks")),
    Internal(("vllm.v1.engine.input_processor:InputProcessor",), "reads the served model's record",
             fields=("model_config",)),
    Internal(("vllm.exceptions:VLLMValidationError",), "the refusal of prompt logprobs (a 400)",
             params=("message", "parameter")),
    Internal(("vllm.sampling_params:SamplingParams",), "sees prompt logprobs asked for", fields=("prompt_logprobs",)),
    Internal(("vllm.v1.worker.gpu_model_runner:GPUModelRunner._init_model_kwargs",),
             "the V1 runner hands Thermometer each token's prompt length (vLLM 0.34 has no V1 runner)",
             params=("num_reqs",), optional=True),
    Internal(("vllm.v1.worker.gpu_model_runner:GPUModelRunner",), "the V1 runner's batch and query offsets",
             fields=("get_model", "input_batch", "query_start_loc"), optional=True),
    Internal(("vllm.v1.worker.gpu_input_batch:InputBatch",), "the V1 runner's requests and prompt lengths",
             fields=("num_reqs", "num_prompt_tokens"), optional=True),
    Internal(("vllm.v1.worker.gpu.model_states:resolve_model_state_cls",),
             "the V2 runner takes the model's own state class (Thermometer's)", reads=("get_model_state_cls",)),
    Internal(("vllm.v1.worker.gpu.model_states.default:DefaultModelState.prepare_inputs",),
             "the V2 runner hands Thermometer each token's prompt length", params=("input_batch", "req_states")),
    Internal(("vllm.v1.worker.gpu.model_states.default:DefaultModelState",), "the V2 model state's model",
             fields=("model",)),
    Internal(("vllm.v1.worker.gpu.input_batch:InputBatch",), "the V2 runner's requests and query offsets",
             fields=("num_reqs", "query_start_loc_np", "idx_mapping_np")),
    Internal(("vllm.v1.worker.gpu.states:RequestState",), "the V2 runner's prompt lengths", fields=("prompt_len",)),
    Internal(("vllm.entrypoints.common.cli_args:make_arg_parser",  # 0.33 on
              "vllm.entrypoints.launchers.cli_args:make_arg_parser"),
             "reads `ats serve --engine vllm`'s vLLM options with vLLM's parser"),
    Internal(("vllm.utils.argparse_utils:FlexibleArgumentParser",), "vLLM's parser class"),
    Internal(("vllm.entrypoints.launchers.api_server.entry:",), "the server `ats serve --engine vllm` runs (python -m)",
             reads=('__name__ == "__main__"',)),
    Internal(("vllm.platforms:current_platform",), "CPU settings only on CPUs", fields=("is_cpu",)),
    Internal(("vllm.v1.attention.backends.cpu_attn:CPUAttentionBackend",),
             "refuses head sizes vLLM's CPU attention does not run (it checks none)",
             fields=("get_supported_head_sizes",)),
    Internal(("vllm.envs:",), "the CPU settings `ats serve --engine vllm` makes",
             reads=("VLLM_CPU_NUM_OF_RESERVED_CPU", "VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_KVCACHE_SPACE")),
    Internal(("vllm.entrypoints.launchers.api_server.app_state:",),
             "where the middleware finds the engine client (the app's state)", reads=("state.engine_client = ",)),
    Internal(("vllm.engine.protocol:EngineClient",),
             "sees the engine stopped, to end the requests vLLM's shutdown leaves unanswered", fields=("errored",)),
    Internal(("vllm.v1.engine.async_llm:AsyncLLM",), "the server's engine client, to see its shutdown begin",
             fields=("engine_core",)),
    Internal(("vllm.v1.engine.core_client:MPClient",),
             "sees the drain begin (its shutdown detaches the finalizer), to answer /health and new requests 503",
             fields=("_finalizer",), reads=("self._finalizer.detach()",)),
    Internal(("vllm:LLM",), "shuts lm-eval's engines down before exit", fields=("llm_engine",)),
    Internal(("vllm.v1.engine.llm_engine:LLMEngine",), "the engine core to shut down", fields=("engine_core",)),
    Internal(("vllm.v1.engine.core_client:SyncMPClient",), "the engine core's shutdown and its output thread",
             fields=("shutdown",), reads=("EngineCoreOutputQueueThread",)),
)

# the dests of vLLM's server options that ats sets or reads
SERVER_OPTIONS = ("middleware", "served_model_name", "host", "port", "dtype", "max_model_len", "max_num_seqs",
                  "tensor_parallel_size", "pipeline_parallel_size", "quantization", "runner", "enable_lora",
                  "speculative_config", "spec_method", "kv_cache_memory_bytes", "shutdown_timeout",
                  "api_server_count")


def _error_line(error: Exception) -> str:
    """"Type: the message's first line"."""
    return f"{type(error).__name__}: {(str(error).splitlines() or [''])[0]}"


def _resolve(place: str):
    """The object at "module:Qualified.name" (the module for "module:"); raises ImportError or AttributeError."""
    module_name, _, qualname = place.partition(":")
    obj = importlib.import_module(module_name)
    for part in filter(None, qualname.split(".")):
        obj = getattr(obj, part)
    return obj


def _find(internal: Internal):
    """(place, object) for the first place of `internal` that exists, or (None, why the last one failed)."""
    why = ""
    for place in internal.where:
        try:
            return place, _resolve(place)
        except Exception as error:  # noqa: BLE001 (a vLLM module may fail to import in any way: that is the finding)
            why = _error_line(error)
    return None, why


def _source(obj) -> str:
    """The source of a module, class or function (of an object: its class's), or "" where Python has none."""
    try:
        return inspect.getsource(obj if inspect.ismodule(obj) or inspect.isclass(obj) or callable(obj) else type(obj))
    except (OSError, TypeError):
        return ""


def _holds(obj, name: str) -> bool:
    """Whether `obj` (a class, or an object and its class) holds `name`: attribute, dataclass field, or assigned as
    `self.name` in its class's source or a base class's."""
    cls = obj if inspect.isclass(obj) else type(obj)
    if hasattr(obj, name) or (is_dataclass(cls) and name in {f.name for f in fields(cls)}):
        return True
    pattern = re.compile(rf"\bself\.{re.escape(name)}\s*(?::[^=\n]+)?=[^=]")
    return any(pattern.search(_source(base)) for base in cls.__mro__ if base.__module__.startswith("vllm"))


def _signature_problem(obj, params: tuple[str, ...]) -> str | None:
    """What keeps ats's call with `params` from working on `obj`'s signature (a missing or a new required
    parameter), or None."""
    try:
        signature = inspect.signature(obj)
    except (TypeError, ValueError):
        return "no signature to read"
    given = signature.parameters
    missing = [p for p in params if p not in given]
    if missing:
        return f"no parameter {missing[0]!r}"
    kinds = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    extra = [n for n, p in given.items() if p.default is p.empty and p.kind not in kinds
             and n not in params and n not in ("self", "cls")]
    return f"a new required parameter {extra[0]!r}" if extra else None


def check(internal: Internal) -> tuple[str | None, str | None]:
    """(where it was found or None, what is wrong or None) for one internal of the installed vLLM."""
    place, found = _find(internal)
    if place is None:
        return None, None if internal.optional else f"not found ({found})"
    if internal.params and (problem := _signature_problem(found, internal.params)):
        return place, problem
    missing = [name for name in internal.fields if not _holds(found, name)]
    if missing:
        return place, f"holds no {missing[0]!r}"
    text = _source(found) if internal.reads else ""
    unread = [s for s in internal.reads if s not in text]
    return place, f"its source no longer has {unread[0]!r}" if unread else None


def server_option_problems() -> list[str]:
    """The server options ats sets or reads that vLLM's own parser no longer has (one line each)."""
    try:
        from vllm.utils.argparse_utils import FlexibleArgumentParser

        parser = locate("make_arg_parser")(FlexibleArgumentParser(prog="vllm"))
    except Exception as error:  # noqa: BLE001 (whatever stops vLLM's parser stops ats serve --engine vllm)
        return [f"vLLM's server options could not be read ({_error_line(error)})"]
    dests = {action.dest for action in parser._actions}
    return [f"vLLM's server has no option {name!r} (ats serve --engine vllm sets or reads it)"
            for name in SERVER_OPTIONS if name not in dests]


def problems(internals: tuple[Internal, ...] | None = None, *, options: bool = True) -> list[str]:
    """What the installed vLLM lacks of what ats uses, one line each (empty: everything is where ats expects it).

    Args:
        internals: the internals to check (default: all of ats's).
        options: also check the server options ats sets or reads (builds vLLM's argument parser).
    """
    lines = []
    for internal in INTERNALS if internals is None else internals:
        place, problem = check(internal)
        if problem is not None:
            lines.append(f"{place or ' | '.join(internal.where)}: {problem} ({internal.use})")
    if options and locate("make_arg_parser", required=False) is not None:
        lines += server_option_problems()
    return lines


def locate(name: str, *, required: bool = True):
    """The installed vLLM's internal called `name` (the first entry of `INTERNALS` with that last name, at the first
    of its places that exists): how ats reaches the internals that moved between releases.

    Raises:
        ATSError: `required` and vLLM has it at none of the places ats knows (one line naming them).
        ValueError: `name` is not in the table (a mistake in ats).
    """
    internal = next((i for i in INTERNALS if i.name == name), None)
    if internal is None:
        raise ValueError(f"{name!r} is not in surface.INTERNALS")
    place, found = _find(internal)
    if place is not None:
        return found
    if not required:
        return None
    raise ATSError(f"vLLM has no {name} at {' or '.join(internal.where)} ({internal.use}); "
                   f"`python -m ats.integrations.vllm.surface` lists what else moved")


def main() -> int:
    """Print every internal with where it was found or what is wrong; exit status 1 when anything is wrong."""
    from .compat import installed_version

    print(f"vLLM {installed_version()}: the internals ats uses")
    wrong = 0
    for internal in INTERNALS:
        place, problem = check(internal)
        wrong += problem is not None
        status = problem or ("ok" if place else "absent (optional)")
        print(f"- {place or internal.where[0]}: {status}")
    option_lines = server_option_problems() if locate("make_arg_parser", required=False) is not None else []
    print("\n".join(f"- {line}" for line in option_lines) or "- server options: ok")
    return 1 if wrong or option_lines else 0


if __name__ == "__main__":
    raise SystemExit(main())
