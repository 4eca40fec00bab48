"""`ats export --engine vllm` and `ats serve --engine vllm` as a user runs them: the folder, and one-line refusals
with exit status 2 before anything is written (the running server: test_vllm_server.py)."""

from __future__ import annotations

import json

import torch

from ats.calibrators import build_calibrator
from ats.cli.main import main
from ats.integrations.vllm import CONFIG_KEY

from vllm_helpers import calibrators


def test_export_command_writes_the_folder(tiny_models, tmp_path, capsys):
    folder, backbone = tiny_models["llama"]
    head = calibrators(backbone, tmp_path, ["linear"])["linear"]
    assert main(["export", "--engine", "vllm", "--model", str(folder), "--calibrator", str(head),
                 str(tmp_path / "out")]) == 0
    record = json.loads((tmp_path / "out" / "config.json").read_text())[CONFIG_KEY]
    assert record["method"] == "ats" and record["base_architecture"] == "LlamaForCausalLM"
    assert str(tmp_path / "out") in capsys.readouterr().out


def test_export_and_serve_refuse_in_one_line(tiny_models, tmp_path, capsys):
    folder, _ = tiny_models["llama"]
    histogram = build_calibrator("histogram").fit(lambda: iter([(torch.randn(64, 8), torch.randint(0, 8, (64,)))]))
    histogram.save_pretrained(tmp_path / "histogram")
    cases = [(["export", "--model", str(folder), "--calibrator", str(tmp_path / "histogram"), str(tmp_path / "o")],
              "maps the top-1 confidence, not the logits"),
             (["export", "--model", str(tmp_path / "missing"), "--calibrator", "none", str(tmp_path / "o")],
              "no such file or folder"),
             (["serve", "--model", str(folder), "--calibrator", "none", "--", "--enforce-eager"],
              "options after -- go to vLLM's server; add --engine vllm"),
             (["serve", "--engine", "vllm", "--model", str(folder), "--calibrator", "none", "--threads", "2"],
              "--threads: an option of ats's own engine")]
    for argv, message in cases:
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.startswith("ats: error: ") and message in err and err.count("\n") == 1, err
    assert not (tmp_path / "o").exists()
