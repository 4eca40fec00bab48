"""`ats train --on answers` as a user runs it (real subprocesses, the embedded SmolLM2, a tiny pool): the head is
trained on the backbone's own answers with an answer loss, reused on a rerun, refused with other settings, and a
token loss is refused in one line."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow

TINY = ["--on", "answers", "--pool-size", "3", "--mmlu-pool", "0", "--head", "linear", "--epochs", "1",
        "--batch-size", "4", "--micro-batch-size", "4"]


def ats(*argv):
    proc = subprocess.run([sys.executable, "-m", "ats", "-q", "train", *argv], capture_output=True, text=True,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"}, timeout=600)
    return proc.returncode, proc.stdout, [line for line in proc.stderr.splitlines() if line.strip()]


@pytest.fixture()
def data_dir(shared_data):
    """The real data sets (the `shared_data` fixture sets ATS_DATA_DIR to them for this test: the subprocesses inherit
    it); the pool's multiple-choice sets and TriviaQA must be there, else the test skips saying which is missing."""
    missing = [name for name in ("qa_pool", "triviaqa") if not (shared_data / name).is_dir()]
    if missing:
        pytest.skip(f"the answer pool reads {', '.join(missing)} from the real data sets, absent in {shared_data}")
    return shared_data


def test_train_on_answers_reuse_and_refusals(data_dir, tmp_path):
    out = tmp_path / "run"
    code, stdout, err = ats(*TINY, "--out", str(out))
    assert code == 0, err
    assert f"head saved to {out / 'head'}" in stdout and "| sciq | 3 |" in stdout
    config = json.loads((out / "head" / "calibrator_config.json").read_text())
    assert config["training"]["loss_type"] == "answer-log" and config["training"]["data"] == "answers"
    assert config["head"]["head_type"] == "linear"
    assert sorted(p.name for p in (out / "answers").iterdir()) == ["boolq", "nq_open", "sciq", "social_iqa",
                                                                   "triviaqa_pool", "winogrande"]
    code, stdout, err = ats(*TINY, "--out", str(out))  # the same settings: reused
    assert code == 0 and f"head reused from {out / 'head'}" in stdout
    code, _, err = ats(*TINY, "--lr", "3e-3", "--out", str(out))  # other settings: refused, nothing written
    assert code == 2 and len(err) == 1 and "made with other options: training.lr" in err[0] and "--overwrite" in err[0]
    code, _, err = ats(*TINY, "--loss", "top-label", "--out", str(tmp_path / "other"))
    assert code == 2 and len(err) == 1 and "token loss" in err[0]
    assert not (tmp_path / "other").exists()
