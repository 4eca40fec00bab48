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


# --- every calibrator type, fitted (or set) for the serving model, each behind its own server ------------------------

def _official_head(folder: Path, hidden_size: int) -> Path:
    """A head in the layout of the paper's released heads (config.json + calibration_head.safetensors), random."""
    import json

    from safetensors.torch import save_file

    heads, kv_heads, inter = 4, 2, 2 * hidden_size
    d = hidden_size // heads
    g = torch.Generator().manual_seed(7)

    def rand(*shape, scale=0.2):
        return torch.randn(*shape, generator=g) * scale

    attn = "transformer.self_attn."
    state = {attn + "q_proj.weight": rand(hidden_size, hidden_size),
             attn + "k_proj.weight": rand(kv_heads * d, hidden_size),
             attn + "v_proj.weight": rand(kv_heads * d, hidden_size),
             attn + "o_proj.weight": rand(hidden_size, hidden_size),
             "transformer.mlp.gate_proj.weight": rand(inter, hidden_size),
             "transformer.mlp.up_proj.weight": rand(inter, hidden_size),
             "transformer.mlp.down_proj.weight": rand(hidden_size, inter),
             "transformer.input_layernorm.weight": 1 + rand(hidden_size, scale=0.1),
             "transformer.post_attention_layernorm.weight": 1 + rand(hidden_size, scale=0.1),
             "linear_head.weight": rand(1, hidden_size, scale=0.05), "linear_head.bias": torch.tensor([0.3])}
    config = {"calibration_type": "transformer", "in_features": hidden_size, "intermediate_size": inter,
              "num_attention_heads": heads, "num_key_value_heads": kv_heads, "feature_key": "hidden_states",
              "normalize_logits": False, "base_model_name_or_path": "tiny", "max_position_embeddings": 4096}
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    save_file(state, str(folder / "calibration_head.safetensors"), metadata={"format": "pt"})
    return folder


@pytest.fixture(scope="session")
def calibrator_folders(backbone, head_dir, tmp_path_factory) -> dict[str, Path]:
    """One saved calibrator of every type for the serving model, away from identity: fitted on the model's own
    logits over a few texts (temperature, binning, isotonic), or set by hand (vector, Thermometer, the constant
    control, the paper's layout); "ats" is the transformer head of the other serving tests."""
    from ats.calibrators import build_calibrator
    from ats.calibrators.thermometer import Thermometer

    root = tmp_path_factory.mktemp("calibrators")
    tok = backbone.tokenizer
    texts = ["The quick brown fox jumps over the lazy dog. " * 3, "Calibration is about knowing what you know. " * 3,
             "Paris is the capital of France, and Rome the capital of Italy. " * 2]
    chunks = []
    with torch.no_grad():
        for text in texts:
            ids = torch.tensor([tok(text)["input_ids"]])
            hidden, _ = backbone.forward(ids)
            chunks.append((backbone.logits(hidden)[0, :-1].float(), ids[0, 1:]))

    def data():
        return iter(chunks)

    made = {name: build_calibrator(name).fit(data) for name in ("scaling-binning", "histogram", "isotonic")}
    temperature = build_calibrator("temperature")
    temperature.temperature = 1.7
    made["temperature"] = temperature
    g = torch.Generator().manual_seed(3)
    vector = build_calibrator("vector")
    vector.scale = 1 + 0.3 * torch.randn(backbone.vocab_size, generator=g)
    vector.bias = 0.5 * torch.randn(backbone.vocab_size, generator=g)
    made["vector"] = vector
    thermometer = Thermometer(hidden_size=backbone.hidden_size, mlp_hidden=16)
    with torch.no_grad():
        for p in thermometer.net.parameters():
            p.copy_(0.5 * torch.randn(p.shape, generator=g))
    thermometer.fitted = True
    made["thermometer"] = thermometer
    constant = ATSCalibrator.for_backbone(backbone, head_type="constant", method="selective-temperature")
    with torch.no_grad():
        constant.head.tau.fill_(-0.04)  # tau = gain * -0.04 = -0.32: one temperature of about 1.4
    made["selective-temperature"] = constant
    made["probe"] = hand_probe(backbone, g)
    folders = {}
    for name, calibrator in made.items():
        calibrator.save_pretrained(root / name)
        folders[name] = root / name
    folders["ats"] = head_dir
    folders["ats-official"] = _official_head(root / "ats-official", backbone.hidden_size)
    return folders


def hand_probe(backbone, g: torch.Generator):
    """A correctness probe set by hand: layer 0's three views and the confidence's logit, random weights, a
    temperature of 1.3 for the tokens."""
    from ats.calibrators.probe import VIEWS, CorrectnessProbe

    probe = CorrectnessProbe(layers=[0], views=list(VIEWS), c=1.0, hidden_size=backbone.hidden_size,
                             base_model=backbone.name, revision=backbone.revision)
    d = len(VIEWS) * backbone.hidden_size + 1
    probe.set_weights(0.3 * torch.randn(d, generator=g), 0.2, 0.1 * torch.randn(d, generator=g),
                      1 + torch.rand(d, generator=g))
    probe.temperature = 1.3
    return probe


@pytest.fixture(scope="session")
def calibrator_servers(model_dir, calibrator_folders, tmp_path_factory):
    """A server per calibrator type (and one uncalibrated, "none"), started together."""
    logs = tmp_path_factory.mktemp("calibrator-servers")
    folders = {**calibrator_folders, "none": "none"}
    servers = {name: Server(["--model", str(model_dir), "--calibrator", str(folder), "--served-model-name",
                             MODEL_NAME, "--max-batch", "4"], logs / f"{name}.log", wait=False)
               for name, folder in folders.items()}
    try:
        for server in servers.values():
            server.wait(timeout=300)
        yield servers
    finally:
        for server in servers.values():
            server.stop()
