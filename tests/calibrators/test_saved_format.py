"""Calibrator folders in the layout written before the calibrators became configs (issue 23) still load, compute
the same thing, and save back to the same bytes.

Each folder is written here by hand, the JSON config as `json.dumps(..., indent=2, sort_keys=True)` and the tensors by
safetensors' `save_file` (ATS heads with the metadata {"format": "pt"}, the others without), exactly as the code
before issue 23 wrote them; the expected outputs are computed from the formulas, not by the code under test.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import save_file

from ats.calibrators import load_calibrator
from ats.calibrators.thermometer_net import ThermometerNet
from ats.errors import ATSError


def write_old(folder, config: dict, tensors: dict | None = None, metadata: dict | None = None):
    """A calibrator folder as the code before issue 23 wrote it."""
    folder.mkdir(parents=True)
    (folder / "calibrator_config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    if tensors:
        save_file(tensors, str(folder / "model.safetensors"), metadata=metadata)
    return folder


def assert_saves_back_the_same(calibrator, folder, tmp_path):
    """Saving the loaded calibrator writes the same bytes (config, tensors and their metadata)."""
    again = tmp_path / (folder.name + "-again")
    calibrator.save_pretrained(again)
    assert (again / "calibrator_config.json").read_text() == (folder / "calibrator_config.json").read_text()
    weights = folder / "model.safetensors"
    assert (again / "model.safetensors").exists() == weights.exists()
    if weights.exists():
        assert (again / "model.safetensors").read_bytes() == weights.read_bytes()


X = torch.tensor([[[2.0, 0.5, -1.0], [0.0, 3.0, 1.0]]])  # (B=1, K=2, V=3) logits


def test_temperature_folder(tmp_path):
    folder = write_old(tmp_path / "temperature", {"type": "temperature", "max_passes": 20, "tol": 0.0001,
                                                  "temperature": 2.0})
    cal = load_calibrator(folder)
    assert torch.equal(cal.apply(X), X / 2.0)
    assert (cal.max_passes, cal.tol, cal.temperature) == (20, 1e-4, 2.0)
    assert_saves_back_the_same(cal, folder, tmp_path)


def test_temperature_options_missing_from_a_folder_take_the_one_default(tmp_path):
    # before issue 23 the load path had its own defaults (tol 1e-6 against the constructor's 1e-4)
    cal = load_calibrator(write_old(tmp_path / "t", {"type": "temperature", "temperature": 1.5}))
    assert (cal.max_passes, cal.tol) == (20, 1e-4)


def test_vector_folder(tmp_path):
    a, b = torch.tensor([1.0, 0.5, 2.0]), torch.tensor([0.0, 0.25, -1.0])
    folder = write_old(tmp_path / "vector", {"type": "vector", "batch_size": 250, "epochs": 2, "lr": 0.01, "seed": 0,
                                             "vocab_size": 3, "weight_decay": 0.0001}, {"bias": b, "scale": a})
    cal = load_calibrator(folder)
    assert torch.equal(cal.apply(X), X * a + b)
    assert_saves_back_the_same(cal, folder, tmp_path)


@pytest.mark.parametrize("kind", ["histogram", "scaling-binning"])
def test_binning_folders(kind, tmp_path):
    config = {"type": kind, "n_bins": 2, **({"temperature": 0.5} if kind == "scaling-binning" else {})}
    tensors = {"upper_edges": torch.tensor([0.5, 1.0], dtype=torch.float64),
               "values": torch.tensor([0.2, 0.9], dtype=torch.float64)}
    folder = write_old(tmp_path / kind, config, tensors)
    cal = load_calibrator(folder)
    assert cal.map_confidence(np.array([0.3, 0.5, 0.7, 1.0])).tolist() == [0.2, 0.2, 0.9, 0.9]
    assert torch.equal(cal.apply(X), X / 0.5 if kind == "scaling-binning" else X)
    assert_saves_back_the_same(cal, folder, tmp_path)


def test_isotonic_folder(tmp_path):
    tensors = {"x_thresholds": torch.tensor([0.2, 0.8], dtype=torch.float64),
               "y_thresholds": torch.tensor([0.1, 0.7], dtype=torch.float64)}
    folder = write_old(tmp_path / "isotonic", {"type": "isotonic"}, tensors)
    cal = load_calibrator(folder)
    assert cal.map_confidence(np.array([0.0, 0.5, 1.0])) == pytest.approx([0.1, 0.4, 0.7], abs=1e-12)
    assert cal.config() == {}
    assert_saves_back_the_same(cal, folder, tmp_path)


def test_uncalibrated_folder(tmp_path):
    folder = write_old(tmp_path / "none", {"type": "none"})
    cal = load_calibrator(folder)
    assert torch.equal(cal.apply(X), X) and cal.label == "uncalibrated"
    assert_saves_back_the_same(cal, folder, tmp_path)


def test_thermometer_folder(tmp_path):
    torch.manual_seed(5)
    state = {k: v.clone() for k, v in ThermometerNet(4, 2).state_dict().items()}
    history = [{"epoch": 0, "loss": 1.5, "nll": 1.25, "sequences": 3, "temperature": 1.125}]
    config = {"type": "thermometer", "batch_size": 8, "chunk_size": 1024, "epochs": 1, "fitted": True, "hidden_size": 4,
              "history": history, "lr": 0.001, "mlp_hidden": 2, "prior_alpha": 1.25, "prior_beta": 4.0,
              "prior_weight": 0.01, "seed": 7, "weight_decay": 0.0001}
    folder = write_old(tmp_path / "thermometer", config, state)
    cal = load_calibrator(folder)
    h = torch.randn(2, 4)  # (N, H): each row its own prompt
    z = torch.randn(2, 3)
    branches = [state[f"branches.{i}.2.weight"] @ F.relu(state[f"branches.{i}.0.weight"] @ h.T
                                                          + state[f"branches.{i}.0.bias"][:, None])
                + state[f"branches.{i}.2.bias"][:, None] for i in range(3)]  # 3 x (1, N)
    raw = state["final.weight"] @ torch.cat(branches) + state["final.bias"][:, None]  # (1, N)
    s = F.softplus(raw[0]).clamp(0.01, 100.0)  # (N,) 1/T
    torch.testing.assert_close(cal.apply(z, h), z * s[:, None])
    assert cal.history == history and cal.fitted and cal.seed == 7
    assert_saves_back_the_same(cal, folder, tmp_path)


def test_thermometer_folder_without_hidden_size_names_the_field(tmp_path):
    folder = write_old(tmp_path / "th", {"type": "thermometer", "fitted": True},
                       {k: v for k, v in ThermometerNet(4, 2).state_dict().items()})
    with pytest.raises(Exception, match="missing field 'hidden_size'"):
        load_calibrator(folder)


def ats_config(head: dict, **extra) -> dict:
    return {"type": "ats", "base_model": "unknown", "head": head, "hidden_size": 4, "library_version": "0.2.0",
            "max_scale": 10.0, "method": "ats", "revision": "unknown", "training": {}, "vocab_size": 3, **extra}


LINEAR = {"head_type": "linear", "hidden_size": 4, "intermediate_size": 256, "mlp_hidden": 8, "num_heads": 1,
          "rope_theta": 10000.0}


def test_ats_linear_head_folder(tmp_path):
    w, b = torch.tensor([[0.5, -1.0, 2.0, 0.25]]), torch.tensor([0.125])
    folder = write_old(tmp_path / "ats", ats_config(LINEAR), {"proj.bias": b, "proj.weight": w},
                       metadata={"format": "pt"})
    cal = load_calibrator(folder)
    h = torch.randn(1, 2, 4)  # (B, T, H)
    tau = (h @ w[0] + b).clamp(max=math.log(10.0))  # (B, T): s = exp(tau) clamped at max_scale
    torch.testing.assert_close(cal.apply(X, h), X * tau.exp()[..., None])
    assert not cal.head.training and cal.config_.head.head_type == "linear"
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        assert f.metadata() == {"format": "pt"}
    assert_saves_back_the_same(cal, folder, tmp_path)


def test_ats_head_with_loss_settings_beside_the_head_is_refused_naming_the_field(tmp_path):
    """Loss settings live in the training record; a config with them beside the head (the layout of 0.1, which no
    user has) is refused in one line, not guessed at."""
    config = ats_config(LINEAR, loss_type="selective")
    folder = write_old(tmp_path / "old-ats", config, {"proj.bias": torch.zeros(1), "proj.weight": torch.zeros(1, 4)},
                       metadata={"format": "pt"})
    with pytest.raises(ATSError, match="loss_type") as error:
        load_calibrator(folder)
    assert "\n" not in str(error.value)
