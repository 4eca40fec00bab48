"""The Hub: a repo id resolved from a local snapshot (HF_HUB_CACHE + HF_HUB_OFFLINE=1, as snapshot_download lays it
out), local folders first, one line for a missing id; the folder and model card that push_to_hub uploads."""

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

import ats.hub
from ats.calibrators import load_calibrator
from ats.calibrators.ats import ATSCalibrator, ATSConfig
from ats.errors import ATSError
from ats.hub import is_repo_id, resolve_folder
from ats.model.heads import HeadConfig

COMMIT = "0123456789abcdef0123456789abcdef01234567"
TRAINING = {"loss_type": "selective", "lr": 0.001, "optimizer_steps": 120, "alpha": 0.5}


def tiny_calibrator(seed: int = 0) -> ATSCalibrator:
    config = ATSConfig(head=HeadConfig(head_type="linear", hidden_size=8), hidden_size=8, vocab_size=11,
                       base_model="HuggingFaceTB/SmolLM2-135M-Instruct", revision="abc123", training=dict(TRAINING))
    calibrator = ATSCalibrator(config)
    with torch.no_grad():
        calibrator.head.proj.weight.copy_(torch.randn(1, 8, generator=torch.Generator().manual_seed(seed)))
    return calibrator


def snapshot(cache, repo_id: str, files_from) -> None:
    """The cache layout snapshot_download writes: models--owner--name/refs/main -> snapshots/<commit>/files."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(COMMIT)
    shutil.copytree(files_from, repo / "snapshots" / COMMIT)


def _load_offline(cache, *loads) -> list[str]:
    """Each (cwd, name) of `loads` loaded in one fresh interpreter with only the Hub cache `cache` (offline): per load,
    the calibrator's class and digest (and from_pretrained's digest for an ATS head) or "error: ...". One process
    for all loads: the Hub settings are read at import, and each interpreter costs seconds."""
    code = ("import os, sys\nfrom ats.calibrators import load_calibrator\n"
            "from ats.calibrators.ats import ATSCalibrator\nfrom ats.errors import ATSError\n"
            "for cwd, name in %r:\n"
            "    os.chdir(cwd)\n"
            "    try:\n        c = load_calibrator(name)\n"
            "    except ATSError as e:\n        print('error:', e)\n        print('--')\n        continue\n"
            "    print(type(c).__name__, c.digest())\n"
            "    if isinstance(c, ATSCalibrator) and c.name == 'ats':\n"
            "        print(ATSCalibrator.from_pretrained(name).digest())\n"
            "    print('--')\n") % [(str(cwd), name) for cwd, name in loads]
    env = {**os.environ, "HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    return [block.strip() for block in out.split("--\n")[:-1]]


@pytest.fixture(scope="module")
def offline_loads(tmp_path_factory) -> dict:
    """One Hub cache with an ats head and an official-layout head, loaded offline in one fresh interpreter (the Hub
    settings are read at import; each interpreter costs seconds): an id from the cache, the same id where a local
    folder of that name exists, a missing id, the official head. The saved calibrators and the answers by name."""
    from test_official import write_official  # the official-layout writer of the official-head tests

    root = tmp_path_factory.mktemp("hub")
    cache, work, local = root / "hub", root / "work", root / "local"
    work.mkdir()
    hub_head, local_head = tiny_calibrator(seed=1), tiny_calibrator(seed=2)
    hub_head.save_pretrained(root / "saved")
    snapshot(cache, "someone/ats-tiny", root / "saved")
    local_head.save_pretrained(local / "someone" / "ats-tiny")  # in `local`, a folder of the same name wins
    official = write_official(root / "official")
    snapshot(cache, "jxie/ATS-calibration-tiny", official)
    answers = _load_offline(cache, (work, "someone/ats-tiny"), (local, "someone/ats-tiny"),
                            (work, "someone/not-there"), (work, "jxie/ATS-calibration-tiny"))
    return {"hub_head": hub_head, "local_head": local_head, "official": official,
            **dict(zip(("from_hub", "from_local", "missing", "official_answer"), answers))}


def test_hub_id_resolves_from_a_local_snapshot_and_local_folders_come_first(offline_loads):
    got = offline_loads
    # load_calibrator, then from_pretrained
    assert got["from_hub"].split() == ["ATSCalibrator", got["hub_head"].digest(), got["hub_head"].digest()]
    assert got["from_local"].split()[1] == got["local_head"].digest()
    missing = got["missing"]
    assert missing.startswith("error: someone/not-there: no such folder, and not in the Hugging Face cache")
    assert "\n" not in missing and "HF_HUB_OFFLINE=1" in missing


def test_official_head_resolves_from_the_hub_cache(offline_loads):
    official = load_calibrator(offline_loads["official"]).digest()
    assert offline_loads["official_answer"].split() == ["OfficialATSCalibrator", official]


@pytest.mark.parametrize("name, expected", [("owner/name", True), ("jxie/ATS-calibration-Llama-2-7b-chat-hf", True),
                                            ("runs/smol/head", False), ("./a/b", False), ("/abs/x", False),
                                            ("~/x/y", False), ("head", False), ("a/../b", False)])
def test_repo_id_shape(name, expected):
    assert is_repo_id(name) is expected


def test_a_missing_local_path_is_returned_for_the_callers_error(tmp_path):
    assert resolve_folder(tmp_path / "nope") == tmp_path / "nope"
    with pytest.raises(ATSError, match="calibrator_config.json: file not found"):
        load_calibrator(tmp_path / "nope")


def test_save_for_hub_writes_config_weights_and_the_model_card(tmp_path):
    calibrator = tiny_calibrator()
    evidence = {"held-out tokens": {"ece": 0.0123, "brier": 0.2}, "MMLU": {"ece": 0.067}}
    folder = calibrator.save_for_hub(tmp_path / "up", "someone/ats-tiny", datasets=["vicgalle/alpaca-gpt4"],
                                     evidence=evidence)
    assert sorted(p.name for p in folder.iterdir()) == ["README.md", "calibrator_config.json", "model.safetensors"]
    assert load_calibrator(folder).digest() == calibrator.digest()
    card = (folder / "README.md").read_text()
    front = card.split("---\n")[1]
    assert "base_model: HuggingFaceTB/SmolLM2-135M-Instruct\n" in front and "library_name: ats\n" in front
    assert "datasets:\n- vicgalle/alpaca-gpt4\n" in front
    assert "load_calibrator('someone/ats-tiny', backbone=backbone)" in card
    assert "- revision: abc123\n" in card and "- hidden size: 8\n" in card
    assert "| lr | 0.001 |" in card and "| optimizer_steps | 120 |" in card and "| loss_type | selective |" in card
    assert "| | brier | ece |\n|---|---:|---:|\n| held-out tokens | 0.2 | 0.0123 |\n| MMLU |  | 0.067 |" in card


def test_card_without_evidence_or_backbone_says_so():
    card = ats.hub.model_card({"type": "temperature", "label": "temperature", "repo_id": "a/b"})
    assert "base_model" not in card.split("---\n")[1]
    assert "- not recorded" in card and "No evaluation numbers were recorded" in card


def test_push_to_hub_uploads_the_saved_folder(tmp_path, monkeypatch):
    seen = {}

    def fake_upload(folder, repo_id, **options):  # the real one needs the network and a token
        seen.update(files=sorted(p.name for p in folder.iterdir()), repo_id=repo_id, options=options,
                    config=json.loads((folder / "calibrator_config.json").read_text()))
        return "https://huggingface.co/someone/ats-tiny/commit/1"

    monkeypatch.setattr(ats.hub, "upload_folder", fake_upload)
    url = tiny_calibrator().push_to_hub("someone/ats-tiny", datasets=["vicgalle/alpaca-gpt4"], private=True)
    assert url.endswith("/commit/1") and seen["repo_id"] == "someone/ats-tiny"
    assert seen["files"] == ["README.md", "calibrator_config.json", "model.safetensors"]
    assert seen["options"]["private"] is True and seen["config"]["type"] == "ats"


def test_push_to_hub_refuses_a_bad_repo_id(tmp_path):
    with pytest.raises(ATSError, match="'not a repo' is not a Hub repo id"):
        ats.hub.upload_folder(tmp_path, "not a repo")


def test_run_record_reads_the_data_and_held_out_numbers_of_a_head_folder(tmp_path):
    head = tmp_path / "head"
    tiny_calibrator().save_pretrained(head)
    (head / "fingerprint.json").write_text(json.dumps({"features": {"data": {
        "source": "alpaca_gpt4", "records": 1000, "val_fraction": 0.1, "seed": 0}}, "kind": "head"}))
    (head / "training_history.json").write_text(json.dumps({"steps": [], "epochs": [
        {"epoch": 0, "n": 900, "ece": 0.2, "brier": 0.3},
        {"epoch": 1, "n": 900, "ece": 0.0123, "brier": 0.19, "nll": 1.5, "objective": 3.0}]}))
    record = ats.hub.run_record(head)
    assert record == {"datasets": ["alpaca_gpt4 (1000 records, 0.1 held out, seed 0)"],
                      "evidence": {"held-out tokens (epoch 1, 900 tokens)": {"ece": 0.0123, "brier": 0.19,
                                                                             "nll": 1.5}}}
    card = (load_calibrator(head).save_for_hub(tmp_path / "up", "a/b", **record) / "README.md").read_text()
    assert "- alpaca_gpt4 (1000 records, 0.1 held out, seed 0)" in card
    assert "| held-out tokens (epoch 1, 900 tokens) | 0.19 | 0.0123 | 1.5 |" in card
    assert ats.hub.run_record(tmp_path) == {"datasets": [], "evidence": {}}
