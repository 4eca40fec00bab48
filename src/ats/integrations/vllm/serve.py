"""`ats serve --engine vllm`: vLLM's own OpenAI-compatible server on an export of the model and calibrator, made on
the fly under the cache and reused while they are the same (`export_for_vllm`'s fingerprint).

The server is vLLM's (`python -m vllm.entrypoints.openai.api_server`; the `vllm` script is not used because vLLM
built for CPUs installs under another distribution name and the script fails there): its logprobs and
top_logprobs are the calibrated ones, its sampling temperature applies on top. What it does not return is ats's
`ats` field per choice (sequence and answer confidence, tau): that is `ats serve`'s own engine; the
answer-or-abstain decision of a certified threshold is made by the client (`abstain.AnswerDecider`).
"""

from __future__ import annotations

import logging
import os
import re
import sys
from collections.abc import Sequence
from pathlib import Path

from ...calibrators import Calibrator, load_calibrator
from ...evaluation.threshold import read_threshold
from ...model.backbone import cache_dir
from . import CALIBRATOR_FOLDER
from .export import export_for_vllm

logger = logging.getLogger(__name__)

SERVER_MODULE = "vllm.entrypoints.openai.api_server"


def export_cache(model: str, calibrator: Calibrator | None) -> Path:
    """Where `ats serve --engine vllm` keeps the export of `model` with `calibrator`: one folder per pair under
    `$ATS_CACHE/vllm` (`~/.cache/ats/vllm`), named by the model and the calibrator's digest."""
    slug = re.sub(r"[^A-Za-z0-9._-]+", "_", Path(model).name or model).strip("_") or "model"
    return cache_dir() / "vllm" / f"{slug}-{'none' if calibrator is None else calibrator.digest()}"


def server_argv(export: Path, *, served_model_name: str, host: str, port: int, dtype: str | None = None,
                max_model_len: int | None = None, max_num_seqs: int | None = None,
                vllm_args: Sequence[str] = ()) -> list[str]:
    """The command line of vLLM's OpenAI server for `export`, ats serve's options in vLLM's spelling, then
    `vllm_args` (vLLM's own options, passed through last so they win). The API key goes in the environment
    (VLLM_API_KEY), not on a command line that every user of the machine can read."""
    argv = [sys.executable, "-m", SERVER_MODULE, "--model", str(export), "--served-model-name", served_model_name,
            "--host", host, "--port", str(port)]
    for flag, value in (("--dtype", dtype), ("--max-model-len", max_model_len), ("--max-num-seqs", max_num_seqs)):
        if value is not None:
            argv += [flag, str(value)]
    return argv + list(vllm_args)


def serve_with_vllm(model: str, calibrator: str | Path | None, *, served_model_name: str, host: str, port: int,
                    api_key: str | None = None, dtype: str | None = None, revision: str | None = None,
                    max_model_len: int | None = None, max_num_seqs: int | None = None,
                    vllm_args: Sequence[str] = (), export: str | Path | None = None) -> None:
    """Export (or reuse the export of) `model` with `calibrator`, then run vLLM's server on it until it exits.

    Args:
        model: the base model as `load_backbone` takes it.
        calibrator: a saved calibrator (folder, Hub id) or None / "none".
        served_model_name: the model id clients send.
        host, port, api_key, dtype, max_model_len, max_num_seqs: the server's options.
        revision: the Hub revision of `model`.
        vllm_args: vLLM's own server options, passed through.
        export: where to write the export (default: `export_cache`).

    Returns:
        Nothing: this process becomes vLLM's server (exec), so signals and the exit status are the server's own.

    Raises:
        ATSError: a calibrator vLLM cannot run or made for another model (before anything starts).
    """
    loaded = None if calibrator is None or str(calibrator) == "none" else load_calibrator(calibrator)
    folder = export_for_vllm(model, loaded, export or export_cache(model, loaded), revision=revision,
                             overwrite=export is None, threshold_from=None if loaded is None else calibrator)
    argv = server_argv(folder, served_model_name=served_model_name, host=host, port=port, dtype=dtype,
                       max_model_len=max_model_len, max_num_seqs=max_num_seqs, vllm_args=vllm_args)
    logger.info("starting vLLM's OpenAI server on %s (calibrated by %s): http://%s:%d/v1", folder,
                "none" if loaded is None else loaded.label, host, port)
    threshold = read_threshold(folder / CALIBRATOR_FOLDER)
    if threshold is not None:
        logger.info("the calibrator's certified threshold %s (target risk %g) travels with the export; vLLM's "
                    "responses do not carry the answer-or-abstain field: clients decide with "
                    "ats.integrations.vllm.abstain.AnswerDecider.from_export(%r)", threshold.threshold,
                    threshold.target_risk, str(folder))
    env = dict(os.environ, **({"VLLM_API_KEY": api_key} if api_key else {}))
    for handler in logging.getLogger("ats").handlers:
        handler.flush()
    os.execve(argv[0], argv, env)
