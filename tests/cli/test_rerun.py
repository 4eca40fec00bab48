"""`ats train` as a user runs it (real subprocesses, the embedded SmolLM2): a rerun never returns a stale result, bad
input gives one line and exit status 2, and training is bitwise reproducible across processes. (Options checked before
any model loads: tests/cli/test_errors.py.)"""

from __future__ import annotations

import hashlib
import json
import os
import resource
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

FIRST = ["--head", "linear", "--max-length", "64", "--epochs", "1", "--lr", "1e-3"]
OTHER = ["--head", "mlp", "--alpha", "0.9", "--max-length", "128", "--epochs", "3", "--lr", "1e-2"]


def ats(*argv, env=None, limit_file_size=None):
    def limits():
        if limit_file_size is not None:  # a full disk: writes past this size fail with EFBIG
            resource.setrlimit(resource.RLIMIT_FSIZE, (limit_file_size, limit_file_size))

    proc = subprocess.run([sys.executable, "-m", "ats", "-q", *argv], capture_output=True, text=True,
                          env={**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})}, preexec_fn=limits, timeout=600)
    return proc.returncode, proc.stdout, [line for line in proc.stderr.splitlines() if line.strip()]


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def records(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "a24.json"
    data = json.loads((Path(os.environ["ATS_DATA_DIR"]) / "alpaca_gpt4" / "alpaca_gpt4_1k.json").read_text())
    path.write_text(json.dumps(data[:24]))
    return path


@pytest.fixture(scope="module")
def first_run(records, tmp_path_factory):
    out = tmp_path_factory.mktemp("run") / "s1"
    code, stdout, err = ats("train", "--data", str(records), "--out", str(out), *FIRST)
    assert code == 0, err
    assert f"head saved to {out / 'head'}" in stdout
    return out


def test_same_options_reuse_and_say_so(records, first_run):
    weights = first_run / "head" / "model.safetensors"
    before = sha(weights)
    code, stdout, err = ats("train", "--data", str(records), "--out", str(first_run), *FIRST)
    assert code == 0 and f"head reused from {first_run / 'head'}" in stdout
    assert sha(weights) == before


def test_other_options_are_refused_by_name_before_any_work(records, first_run):
    weights = first_run / "head" / "model.safetensors"
    before = sha(weights)
    files = sorted(p for p in first_run.rglob("*") if p.is_file())
    code, _, err = ats("train", "--data", str(records), "--out", str(first_run), *OTHER)
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith(f"ats: error: {first_run / 'features' / 'train'}: features made with other options: ")
    assert "data.max_length 64 -> 128" in err[0] and "--overwrite" in err[0] and "--out" in err[0]
    # same data, other head and training options: the head is refused, naming every difference
    code, _, err = ats("train", "--data", str(records), "--out", str(first_run), *OTHER[:-6], "--max-length", "64",
                       *OTHER[-4:])
    assert code == 2 and len(err) == 1, err
    for change in ("head_type 'linear' -> 'mlp'", "training.alpha 0.5 -> 0.9", "training.epochs 1 -> 3",
                   "training.lr 0.001 -> 0.01"):
        assert change in err[0]
    assert sha(weights) == before and sorted(p for p in first_run.rglob("*") if p.is_file()) == files


def test_overwrite_retrains_with_the_new_options(records, first_run, tmp_path):
    out = tmp_path / "copy"
    code, _, err = ats("train", "--data", str(records), "--out", str(out), *FIRST)
    assert code == 0, err
    code, stdout, err = ats("train", "--data", str(records), "--out", str(out), *OTHER, "--overwrite")
    assert code == 0, err
    config = json.loads((out / "head" / "calibrator_config.json").read_text())
    assert config["head"]["head_type"] == "mlp" and config["training"]["alpha"] == 0.9
    assert config["training"]["epochs"] == 3 and config["training"]["lr"] == 0.01
    meta = json.loads((out / "features" / "train" / "meta.json").read_text())
    assert meta["max_length"] == 128


def test_training_is_bitwise_reproducible_across_processes(records, first_run, tmp_path):
    # another process, another hash seed, the same seed and data: the same bytes
    out = tmp_path / "again"
    code, _, err = ats("train", "--data", str(records), "--out", str(out), *FIRST, env={"PYTHONHASHSEED": "3"})
    assert code == 0, err
    assert sha(out / "head" / "model.safetensors") == sha(first_run / "head" / "model.safetensors")


def test_calibrator_mistakes_get_one_line(first_run, tmp_path):
    code, _, err = ats("generate", "--calibrator", str(first_run), "hello")  # the run folder, not the head
    assert code == 2 and err == [f"ats: error: {first_run}: a run folder, not a calibrator; the head is in "
                                 f"{first_run / 'head'}"]
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "calibrator_config.json").write_text((first_run / "head" / "calibrator_config.json").read_text())
    (broken / "model.safetensors").write_bytes((first_run / "head" / "model.safetensors").read_bytes()[:40])
    code, _, err = ats("generate", "--calibrator", str(broken), "hello")
    assert code == 2 and len(err) == 1 and "corrupt or truncated safetensors" in err[0], err
    other = tmp_path / "other"
    other.mkdir()
    config = json.loads((first_run / "head" / "calibrator_config.json").read_text())
    (other / "calibrator_config.json").write_text(json.dumps({**config, "base_model": "gemma3-270m"}))
    (other / "model.safetensors").write_bytes((first_run / "head" / "model.safetensors").read_bytes())
    code, _, err = ats("generate", "--calibrator", str(other), "hello")
    assert code == 2 and len(err) == 1 and "trained for base model 'gemma3-270m'" in err[0], err


def test_a_full_disk_gives_one_line_and_no_half_written_file(records, tmp_path):
    out = tmp_path / "full"
    code, _, err = ats("train", "--data", str(records), "--out", str(out), *FIRST, limit_file_size=200_000)
    assert code == 2 and len(err) == 1 and "File too large" in err[0], err
    leftovers = [p for p in out.rglob("*") if p.is_file() and (p.name.endswith(".tmp") or p.suffix == ".safetensors")]
    assert leftovers == []
