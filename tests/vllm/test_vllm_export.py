"""`export_for_vllm`: the folder it writes (config record, linked weights, the calibrator beside them), reuse and
refusal of an earlier export, and one-line refusals of calibrators vLLM cannot run or made for another model."""

from __future__ import annotations

import json
import os

import pytest
import torch

from ats.calibrators import build_calibrator, load_calibrator
from ats.calibrators.ats import ATSCalibrator
from ats.calibrators.thermometer import Thermometer
from ats.errors import ATSError
from ats.integrations.vllm import ARCHITECTURE, CONFIG_KEY
from ats.integrations.vllm.export import export_for_vllm, read_export

from vllm_helpers import perturbed


@pytest.fixture(scope="module")
def llama(tiny_models):
    return tiny_models["llama"]


def test_export_writes_config_links_weights_and_saves_the_calibrator(llama, tmp_path):
    folder, backbone = llama
    cal = perturbed(ATSCalibrator.for_backbone(backbone, head_type="linear"), seed=0)
    out = export_for_vllm(str(folder), cal, tmp_path / "out")
    config = json.loads((out / "config.json").read_text())
    base = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == [ARCHITECTURE]
    assert {k: v for k, v in config.items() if k not in ("architectures", CONFIG_KEY)} == \
        {k: v for k, v in base.items() if k != "architectures"}
    assert read_export(out) == config[CONFIG_KEY]
    assert config[CONFIG_KEY]["base_architecture"] == "LlamaForCausalLM"
    assert config[CONFIG_KEY]["base_model"] == backbone.name and config[CONFIG_KEY]["revision"] == backbone.revision
    assert os.path.islink(out / "model.safetensors")
    assert (out / "model.safetensors").resolve() == (folder / "model.safetensors").resolve()
    assert (out / "tokenizer.json").read_text() == (folder / "tokenizer.json").read_text()
    again = load_calibrator(out / "calibrator", backbone=backbone)
    torch.testing.assert_close(again.head.proj.weight, cal.head.proj.weight, rtol=0, atol=0)


def test_export_copies_when_asked_and_reuses_or_refuses_a_rerun(llama, tmp_path):
    folder, backbone = llama
    temperature = build_calibrator("temperature")
    temperature.temperature = 1.3
    out = export_for_vllm(str(folder), temperature, tmp_path / "out", copy=True)
    assert not os.path.islink(out / "model.safetensors")
    assert (out / "model.safetensors").read_bytes() == (folder / "model.safetensors").read_bytes()
    stamp = (out / "config.json").stat().st_mtime_ns
    assert export_for_vllm(str(folder), temperature, out, copy=True) == out  # the same: reused, not rewritten
    assert (out / "config.json").stat().st_mtime_ns == stamp
    other = build_calibrator("temperature")
    other.temperature = 2.0
    with pytest.raises(ATSError, match=r"vLLM export made with other options: calibrator"):
        export_for_vllm(str(folder), other, out, copy=True)
    export_for_vllm(str(folder), other, out, copy=True, overwrite=True)
    assert load_calibrator(out / "calibrator").temperature == 2.0


def test_export_refuses_what_vllm_cannot_run(llama, tmp_path):
    folder, backbone = llama
    histogram = build_calibrator("histogram").fit(lambda: iter([(torch.randn(64, 8), torch.randint(0, 8, (64,)))]))
    with pytest.raises(ATSError, match=r"maps the top-1 confidence, not the logits.*`ats serve`"):
        export_for_vllm(str(folder), histogram, tmp_path / "h")
    assert not (tmp_path / "h").exists()


def test_thermometer_exports_with_its_record_saying_one_temperature_per_prompt(llama, tmp_path):
    folder, backbone = llama
    thermometer = Thermometer(hidden_size=backbone.hidden_size)
    thermometer.fitted = True
    assert read_export(export_for_vllm(str(folder), thermometer, tmp_path / "t"))["per_prompt"] is True
    assert read_export(export_for_vllm(str(folder), None, tmp_path / "n"))["per_prompt"] is False


def test_export_refuses_a_calibrator_of_another_model(llama, tiny_models, tmp_path):
    folder, _ = llama
    _, qwen = tiny_models["qwen2"]
    cal = ATSCalibrator.for_backbone(qwen, head_type="linear")
    with pytest.raises(ATSError, match=r"trained for base model .*tiny-qwen2.*not .*tiny-llama"):
        export_for_vllm(str(folder), cal, tmp_path / "x")
    assert not (tmp_path / "x").exists()


def test_export_refuses_an_export_and_an_unknown_architecture(llama, tmp_path):
    folder, _ = llama
    out = export_for_vllm(str(folder), None, tmp_path / "none")
    with pytest.raises(ATSError, match="already a calibrated export"):
        export_for_vllm(str(out), None, tmp_path / "twice")
    odd = tmp_path / "odd"
    odd.mkdir()
    for item in folder.iterdir():
        os.symlink(item, odd / item.name) if item.name != "config.json" else None
    (odd / "config.json").write_text(json.dumps({**json.loads((folder / "config.json").read_text()),
                                                 "architectures": ["NoSuchModelForCausalLM"]}))
    with pytest.raises(ATSError, match="architecture 'NoSuchModelForCausalLM' is not one vLLM supports"):
        export_for_vllm(str(odd), None, tmp_path / "y")
