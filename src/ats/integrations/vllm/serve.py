"""`ats serve --engine vllm`: vLLM's own OpenAI-compatible server on an export of the model and calibrator, made on
the fly under the cache and reused while they are the same (`export_for_vllm`'s fingerprint).

The server is vLLM's (`python -m vllm.entrypoints.launchers.api_server.entry`; the `vllm` script is not used
because vLLM built for CPUs installs under another distribution name and the script fails there): its logprobs and
top_logprobs are the calibrated ones, its sampling temperature applies on top. ats's layer in it
(`middleware.ATSMiddleware`, vLLM's `--middleware`) adds each choice's `ats` decision fields (answer confidence,
answered, threshold, target risk, delta, whether the request is in the certified format), plain and streamed,
refuses the chat roles `ats serve` refuses, and serves the playground page at `/`.

Before anything starts: the vLLM version (`compat.check_version`), the engine setup read with vLLM's own parser
(`compat.setup_refusal`: hidden-state speculative decoders, quantization, pipeline parallelism, the pooling
runner, LoRA), and on CPUs the attention head sizes (`compat.head_size_refusal`), the settings a shared machine
needs and the memory they ask for (`cpu`).
"""

from __future__ import annotations

import logging
import os
import re
import sys
from collections.abc import Sequence
from pathlib import Path

from ...calibrators import Calibrator, load_calibrator
from ...errors import ATSError
from ...evaluation.threshold import read_threshold
from ...model.backbone import cache_dir
from ...serving.api_errors import MAX_REQUEST_BYTES
from . import CALIBRATOR_FOLDER
from .compat import check_version, cpu_attention_head_sizes, head_size_refusal, setup_refusal
from .export import attention_head_sizes, calibration_attention, export_for_vllm
from .middleware import EXPORT_ENV, MAX_REQUEST_BYTES_ENV, MODEL_NAME_ENV

logger = logging.getLogger(__name__)

SERVER_MODULE = "vllm.entrypoints.launchers.api_server.entry"  # vLLM's server (its openai.api_server is deprecated)
MIDDLEWARE = "ats.integrations.vllm.middleware.ATSMiddleware"


def given_options(argv: Sequence[str]) -> dict:
    """The options of vLLM's server command line `argv` (after `-m MODULE`) that it sets, read by vLLM's own parser
    (its spellings: `--gpu-memory-utilization=0.5`, `-tp 2`, `--speculative-config.method eagle`): dest -> value.

    Raises:
        ATSError: a command line vLLM's parser refuses (its message).
    """
    import argparse

    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from .surface import locate

    make_arg_parser = locate("make_arg_parser")  # moved to vllm.entrypoints.common in 0.33

    def refuse(message: str):
        raise ATSError(f"vLLM's options: {message}")

    parser = make_arg_parser(FlexibleArgumentParser(prog="vllm"))
    parser.error = refuse  # one line instead of argparse's usage and exit
    for action in parser._actions:  # parse only what is given: no defaults in the namespace
        action.default = argparse.SUPPRESS
    return vars(parser.parse_args(list(argv)))


def check_setup(options: dict) -> None:
    """Refuse in one line an engine setup the calibrated model cannot serve (`compat.setup_refusal`), and vLLM
    options that the one-process server `ats serve --engine vllm` runs would ignore."""
    count = options.get("api_server_count")
    if count is not None and count != 1:
        raise ATSError(f"vLLM's options: --api-server-count {count}: ats serve --engine vllm runs vLLM's one-process "
                       f"server ({SERVER_MODULE}), which would ignore it, and ats's layer (the decisions, their "
                       f"monitor, the shutdown guard) lives in that process; run several servers behind a load "
                       f"balancer")
    speculative = options.get("speculative_config") or {}
    reason = setup_refusal(
        speculative_method=options.get("spec_method") or (speculative.get("method")
                                                          if isinstance(speculative, dict) else None),
        quantization=options.get("quantization"), pipeline_parallel_size=options.get("pipeline_parallel_size", 1),
        runner=options.get("runner"), lora=bool(options.get("enable_lora")))
    if reason is not None:
        raise ATSError(f"vLLM's options: {reason}")


def export_cache(model: str, calibrator: Calibrator | None) -> Path:
    """Where `ats serve --engine vllm` keeps the export of `model` with `calibrator`: one folder per pair under
    `$ATS_CACHE/vllm` (`~/.cache/ats/vllm`), named by the model and the calibrator's digest."""
    slug = re.sub(r"[^A-Za-z0-9._-]+", "_", Path(model).name or model).strip("_") or "model"
    return cache_dir() / "vllm" / f"{slug}-{'none' if calibrator is None else calibrator.digest()}"


def server_argv(export: Path, *, served_model_name: str, host: str, port: int, dtype: str | None = None,
                max_model_len: int | None = None, max_num_seqs: int | None = None,
                shutdown_timeout: int | None = None, vllm_args: Sequence[str] = ()) -> list[str]:
    """The command line of vLLM's OpenAI server for `export`, ats serve's options in vLLM's spelling, then
    `vllm_args` (vLLM's own options, passed through last so they win). The API key goes in the environment
    (VLLM_API_KEY), not on a command line that every user of the machine can read."""
    argv = [sys.executable, "-m", SERVER_MODULE, "--model", str(export), "--served-model-name", served_model_name,
            "--host", host, "--port", str(port), "--middleware", MIDDLEWARE]
    for flag, value in (("--dtype", dtype), ("--max-model-len", max_model_len), ("--max-num-seqs", max_num_seqs),
                        ("--shutdown-timeout", shutdown_timeout)):
        if value is not None:
            argv += [flag, str(value)]
    return argv + list(vllm_args)


def serve_with_vllm(model: str, calibrator: str | Path | None, *, served_model_name: str, host: str, port: int,
                    api_key: str | None = None, dtype: str | None = None, revision: str | None = None,
                    max_model_len: int | None = None, max_num_seqs: int | None = None,
                    shutdown_timeout: int | None = None, max_request_bytes: int = MAX_REQUEST_BYTES,
                    vllm_args: Sequence[str] = (), export: str | Path | None = None) -> None:
    """Export (or reuse the export of) `model` with `calibrator`, then run vLLM's server on it until it exits.

    Args:
        model: the base model as `load_backbone` takes it.
        calibrator: a saved calibrator (folder, Hub id) or None / "none".
        served_model_name: the model id clients send.
        host, port, api_key, dtype, max_model_len, max_num_seqs: the server's options.
        shutdown_timeout: the seconds requests in flight get to finish after SIGTERM (vLLM's --shutdown-timeout;
            those still running then end with a 503 or a stream's error event, `shutdown.until_engine_stops`).
        max_request_bytes: the largest request body accepted (ats's middleware, `serving.body_limit`).
        revision: the Hub revision of `model`.
        vllm_args: vLLM's own server options, passed through.
        export: where to write the export (default: `export_cache`).

    Returns:
        Nothing: this process becomes vLLM's server (exec), so signals and the exit status are the server's own.

    Raises:
        ATSError: a calibrator vLLM cannot run or made for another model (before anything starts).
    """
    check_version()
    loaded = None if calibrator is None or str(calibrator) == "none" else load_calibrator(calibrator)
    folder = Path(export or export_cache(model, loaded))
    argv = server_argv(folder, served_model_name=served_model_name, host=host, port=port, dtype=dtype,
                       max_model_len=max_model_len, max_num_seqs=max_num_seqs, shutdown_timeout=shutdown_timeout,
                       vllm_args=vllm_args)
    options = given_options(argv[3:])
    check_setup(options)
    export_for_vllm(model, loaded, folder, revision=revision, overwrite=export is None,
                    threshold_from=None if loaded is None else calibrator)
    env = dict(os.environ, **({"VLLM_API_KEY": api_key} if api_key else {}),
               **{EXPORT_ENV: str(folder), MODEL_NAME_ENV: served_model_name,
                  MAX_REQUEST_BYTES_ENV: str(max_request_bytes)})
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        env.update(cpu_environment(folder, loaded, options, env))
    logger.info("starting vLLM's OpenAI server on %s (calibrated by %s): http://%s:%d/v1", folder,
                "none" if loaded is None else loaded.label, host, port)
    threshold = read_threshold(folder / CALIBRATOR_FOLDER)
    if threshold is not None:
        logger.info("answer-or-abstain: each choice's `ats` field says answered when the answer confidence is >= %s "
                    "(certified: risk <= %g with probability >= %g)", threshold.threshold, threshold.target_risk,
                    1 - threshold.delta)
    for handler in logging.getLogger("ats").handlers:
        handler.flush()
    os.execve(argv[0], argv, env)


def cpu_environment(folder: Path, calibrator: Calibrator | None, options: dict, environ: dict) -> dict[str, str]:
    """The settings vLLM's CPU backend gets that the user did not make (`cpu.cpu_settings`, each logged), after
    checking that vLLM's CPU attention runs the model's head sizes (`compat.head_size_refusal`) and that the memory
    available now holds the model, its KV cache and the engine (`cpu.check_memory`).

    Raises:
        ATSError: a head size, memory or cores short, in one line naming the setting.
    """
    from transformers import AutoConfig

    from .cpu import DTYPE_BYTES, available_memory, check_memory, cpu_settings, weights_bytes

    config = AutoConfig.from_pretrained(str(folder))
    dtype = options.get("dtype", "auto")
    if dtype == "auto":
        dtype = str(getattr(config, "dtype", None) or getattr(config, "torch_dtype", None) or "float32")
    dtype_bytes = DTYPE_BYTES.get(dtype.removeprefix("torch."), 4)
    text = config.get_text_config()
    max_model_len = int(options.get("max_model_len") or getattr(text, "max_position_embeddings", None) or 2048)
    supported = cpu_attention_head_sizes()
    reason = head_size_refusal(attention_head_sizes(config, calibrator), supported) if supported else None
    if reason is not None:
        raise ATSError(f"{folder}: {reason}")
    added = calibration_attention(calibrator)
    head_width = 0 if added is None else added[0] * added[1]
    settings = cpu_settings(environ, options, folder=folder, config=config, dtype_bytes=dtype_bytes,
                            max_model_len=max_model_len, max_num_seqs=int(options.get("max_num_seqs", 256)),
                            tensor_parallel=int(options.get("tensor_parallel_size", 1)), head_width=head_width)
    for note in settings.notes:
        logger.info("vLLM on CPU: %s (set it to choose)", note)
    available, total = available_memory()
    logger.info("vLLM on CPU: %s", check_memory(settings, options, weights=weights_bytes(folder, dtype_bytes),
                                                 available=available, total=total))
    return settings.env
