"""Serving fixtures: a tiny model saved as a model folder, a calibrator away from identity, a real server process.

The tiny Llama has untied output embeddings scaled up, so that greedy text varies and top-1 probabilities sit around
0.3-0.9 (calibration visibly moves them). The in-process backbone is loaded from the same folder as the server's, so
both compute with the same weights and names. (This conftest cannot import the root one: both are modules named
`conftest`; shared builders live in tests/helpers.py.)
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ats.calibrators.ats import ATSCalibrator
from ats.model.backbone import load_backbone

from helpers import calibrator_for, make_tiny_backbone
from server_process import API_KEY, MODEL_NAME, Server


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """One torch thread here: these tests run many small operations, which two threads on a shared 2-core machine
    slow down tenfold (spinning OpenMP workers); restored afterwards."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def model_dir(tokenizer, tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("serving") / "tiny-model"
    backbone = make_tiny_backbone(tokenizer, tie_word_embeddings=False, output_scale=60.0)
    backbone.model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def backbone(model_dir):
    return load_backbone(str(model_dir))


@pytest.fixture(scope="session")
def calibrator(backbone) -> ATSCalibrator:
    return calibrator_for(backbone)


@pytest.fixture(scope="session")
def head_dir(calibrator, tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("serving") / "head"
    calibrator.save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def server(model_dir, head_dir, tmp_path_factory):
    """The calibrated server (API key required), shared by the serving tests."""
    log = tmp_path_factory.mktemp("serving") / "server.log"
    srv = Server(["--model", str(model_dir), "--calibrator", str(head_dir), "--served-model-name", MODEL_NAME,
                  "--max-batch", "8"], log, api_key=API_KEY)
    yield srv
    srv.stop()
    log_text = log.read_text()  # every bad request above got its 4xx: no 500, no traceback
    assert "Traceback" not in log_text and '" 500 ' not in log_text, log_text[-3000:]


@pytest.fixture()
def client(server):
    import openai

    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)
