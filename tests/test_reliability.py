"""Reliability: one-line errors from the CLI with nothing half-written, NaN detection, safe paths, no pickle."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ats.ats import ATSCalibrator
from ats.cli import main
from ats.data import load_instructions, tokenize_instructions
from ats.errors import ATSError
from ats.features import FeatureStore, extract_features
from ats.training import TrainingConfig, latest_checkpoint, train_ats

SRC = Path(__file__).resolve().parents[1] / "src" / "ats"


def _run_cli(argv, capsys):
    code = main(["-q", *argv])
    err = capsys.readouterr().err.strip().splitlines()
    return code, err


@pytest.mark.parametrize("argv, message", [
    (["eval", "--tasks", "mmlu,bogus"], "unknown task 'bogus'"),
    (["eval", "--calibrator", "platt", "--tasks", "mmlu"], "--calibrator 'platt'"),
])
def test_cli_unknown_names_give_one_line_and_exit_2(tmp_path, capsys, argv, message):
    out = tmp_path / "out"
    code, err = _run_cli([*argv, "--out", str(out)], capsys)
    assert code == 2 and len(err) == 1 and err[0].startswith("ats: error:") and message in err[0], err
    assert not out.exists() or not any(out.rglob("*.json"))


def test_cli_bad_data_file_names_line_and_writes_nothing(tmp_path, capsys):
    data = tmp_path / "data.jsonl"
    data.write_text('{"instruction": "a", "output": "b"}\n{"instruction": "a", "output": 7}\n')
    out = tmp_path / "run"
    code, err = _run_cli(["train", "--data", str(data), "--out", str(out)], capsys)
    assert code == 2 and err == [f"ats: error: {data}:2: field 'output' must be a string, got int 7"]
    assert not out.exists() or not any(p.is_file() for p in out.rglob("*"))


def test_missing_calibrator_folder_and_bad_mc_file(tmp_path, capsys):
    bad = tmp_path / "q.jsonl"
    bad.write_text('{"question": "2+2?", "choices": ["3", "4"], "answer": 5}\n')
    code, err = _run_cli(["eval", "--tasks", f"mc:{bad}", "--out", str(tmp_path / "o")], capsys)
    assert code == 2 and len(err) == 1 and "q.jsonl" in err[0] and "answer" in err[0], err


def test_non_finite_loss_stops_with_place_and_keeps_checkpoint(tokenizer, tmp_path):
    """A backbone whose output layer yields NaN logits: training stops at once and says where."""
    from conftest import make_tiny_backbone

    backbone = make_tiny_backbone(tokenizer, seed=3)
    examples = tokenize_instructions(tokenizer, load_instructions("alpaca_gpt4", limit=6), max_length=48)[0]
    store = extract_features(backbone, examples, tmp_path / "f", progress=False)
    with torch.no_grad():
        backbone.model.lm_head.weight[5] = float("nan")  # logits are recomputed from h: NaN appears in the loss
    cal = ATSCalibrator.for_backbone(backbone, head_type="linear")
    with pytest.raises(ATSError, match=r"non-finite loss nan at epoch 0, step 0"):
        train_ats(cal, store, backbone, config=TrainingConfig(batch_size=2, micro_batch_size=2), out_dir=tmp_path / "r",
                  progress=False)
    assert latest_checkpoint(tmp_path / "r") is None  # nothing half-written in place of a good checkpoint


def test_paths_in_configs_cannot_escape_the_folder(tiny_backbone, tokenizer, tmp_path):
    examples = tokenize_instructions(tokenizer, load_instructions("alpaca_gpt4", limit=3), max_length=48)[0]
    extract_features(tiny_backbone, examples, tmp_path / "f", progress=False)
    outside = tmp_path / "secret.safetensors"
    (tmp_path / "f" / "shard-00000.safetensors").rename(outside)
    meta = json.loads((tmp_path / "f" / "meta.json").read_text())
    meta["shards"][0]["file"] = "../secret.safetensors"
    (tmp_path / "f" / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(ATSError, match="shard file missing"):  # resolved inside the folder, never outside it
        list(FeatureStore(tmp_path / "f").sequences())


def test_no_pickle_and_no_remote_code_by_default():
    sources = "\n".join(p.read_text() for p in SRC.rglob("*.py"))
    assert "import pickle" not in sources and "torch.load(" not in sources.replace("weights_only=True", "")
    assert "trust_remote_code: bool = False" in (SRC / "backbone.py").read_text()
    help_text = subprocess.run([sys.executable, "-m", "ats", "train", "--help"], capture_output=True, text=True).stdout
    assert "--trust-remote-code" in help_text
