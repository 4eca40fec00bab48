"""Shared fixtures: a tiny tokenizer and a tiny random Llama built here (most tests), tiny data files written here,
and the real embedded SmolLM2 (tests marked `slow` only).

Nothing outside the repository is read: the tokenizer is a byte-level BPE trained on the tiny data's text, with
SmolLM2's special tokens and chat template (so prompts, chat templates and label masks look realistic while forward
passes take milliseconds), and ATS_DATA_DIR points, for the whole session, to small files in every layout that
`ats.sources` reads (`helpers.write_tiny_data`). A test that needs the real data sets asks for `shared_data`, which
skips (saying why) when they are not there.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from ats.model.backbone import Backbone, load_backbone

from helpers import make_tiny_backbone, make_tiny_tokenizer, write_tiny_data

REPO = Path(__file__).resolve().parents[1]
# the real data sets, for the few tests that ask for `shared_data`: ATS_DATA_DIR as set before the tests started, else
# the development copy beside the repository
REAL_DATA = Path(os.environ.get("ATS_DATA_DIR") or REPO.parent / "shared" / "data")


def pytest_collection_modifyitems(config, items):
    """Every test that loads the embedded SmolLM2 through its fixture is `slow` (`-m "not slow"` skips them)."""
    for item in items:
        if "smollm2" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="session")
def tiny_data(tmp_path_factory) -> Path:
    """Small data files in every ATS_DATA_DIR layout (Alpaca, MMLU, TriviaQA, TruthfulQA, the QA pool)."""
    return write_tiny_data(tmp_path_factory.mktemp("data"))


@pytest.fixture(scope="session", autouse=True)
def _offline_env(tiny_data):
    """Tests never touch the network, and read data from the tiny files written above."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ["ATS_DATA_DIR"] = str(tiny_data)
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


@pytest.fixture()
def shared_data(monkeypatch) -> Path:
    """The real data sets (ATS_DATA_DIR as set outside the tests, or ../shared/data), read through ATS_DATA_DIR for
    this test only; skips, saying why, when they are not there."""
    if not (REAL_DATA / "alpaca_gpt4").is_dir():
        pytest.skip(f"needs the real data sets: set ATS_DATA_DIR to a copy of ../shared/data ({REAL_DATA} has none)")
    monkeypatch.setenv("ATS_DATA_DIR", str(REAL_DATA))
    return REAL_DATA


@pytest.fixture(scope="session")
def smollm2() -> Backbone:
    """The real embedded SmolLM2-135M-Instruct (dequantized once, then cached as safetensors); `slow` tests only."""
    return load_backbone("smollm2-135m-instruct")


@pytest.fixture(scope="session")
def tokenizer():
    """The tiny byte-level BPE tokenizer with a chat template (no embedded model needed)."""
    return make_tiny_tokenizer()


@pytest.fixture(scope="session")
def tiny_backbone(tokenizer) -> Backbone:
    return make_tiny_backbone(tokenizer)
