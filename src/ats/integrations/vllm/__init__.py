"""Calibrated models inside vLLM: an exported folder that vLLM loads as one model, its forward running the base
model and the calibrator, its `compute_logits` returning calibrated logits (docs/vllm.md).

    ats export --engine vllm --model M --calibrator C OUT      # the folder (`export_for_vllm`)
    python -m vllm.entrypoints.openai.api_server --model OUT   # or LLM(OUT), lm-eval --model vllm
    ats serve --engine vllm --model M --calibrator C           # both in one command

Installing ats registers the calibrated architecture with vLLM: the entry point `vllm.general_plugins` calls
`register` in every vLLM process, which names the class lazily (the module below imports vLLM only when vLLM loads
it). vLLM's logits processors see logits only, never hidden states, so the calibration lives in the model.
"""

from __future__ import annotations

ARCHITECTURE = "ATSCalibratedForCausalLM"  # the `architectures` entry of an exported config.json
CONFIG_KEY = "ats_calibration"  # the exported config.json's record: base architecture, calibrator folder, identity
CALIBRATOR_FOLDER = "calibrator"  # the calibrator inside an export, saved as `save_pretrained` writes it


def register() -> None:
    """vLLM's plugin hook: register the calibrated architecture (lazily, by module path)."""
    from vllm import ModelRegistry

    if ARCHITECTURE not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model(ARCHITECTURE, "ats.integrations.vllm.model:ATSCalibratedForCausalLM")


__all__ = ["ARCHITECTURE", "CALIBRATOR_FOLDER", "CONFIG_KEY", "register"]
