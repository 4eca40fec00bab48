"""`ats train --on answers` beyond the ATS heads, on the tiny model folder and the tiny QA pool (conftest):
Thermometer trained on the answers (the default of `ats train`), a head with the top-label term on instruction
tokens, and the refusals (unknown spec, '+tokens' without features, --head with --method, --online with answers, the
answer options with instruction data), each in one line before anything loads."""

from __future__ import annotations

import json

import pytest

from ats.cli import main

from helpers import make_tiny_backbone

POOL = ["--on", "answers", "--pool-size", "3", "--mmlu-pool", "0", "--epochs", "1", "--batch-size", "4",
        "--micro-batch-size", "4"]


@pytest.fixture(scope="module")
def model_dir(tokenizer, tmp_path_factory):
    folder = tmp_path_factory.mktemp("answers") / "tiny-model"
    backbone = make_tiny_backbone(tokenizer)
    backbone.model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def one_error(capsys) -> str:
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1, lines
    return lines[0]


def test_refusals_come_before_anything_loads(model_dir, tmp_path, capsys):
    base = ["train", "--model", str(model_dir), *POOL]
    assert main([*base, "--method", "linear+tokens", "--out", str(tmp_path / "a")]) == 2
    assert "--token-features" in one_error(capsys)
    assert main([*base, "--method", "thermometer+tokens", "--out", str(tmp_path / "a")]) == 2
    assert "unknown spec 'thermometer+tokens'" in one_error(capsys)
    assert main([*base, "--method", "bayes", "--out", str(tmp_path / "a")]) == 2
    assert "--method: unknown spec 'bayes'" in one_error(capsys)
    assert main(["train", "--model", str(model_dir), "--data", "alpaca_gpt4", "--method", "thermometer", "--out",
                 str(tmp_path / "a")]) == 2
    assert "only with --on answers" in one_error(capsys)
    assert main(["train", "--model", str(model_dir), "--on", "answers", "--data", "alpaca_gpt4", "--out",
                 str(tmp_path / "a")]) == 2
    assert "--data alpaca_gpt4 is instruction data" in one_error(capsys)
    assert main(["train", "--model", str(model_dir), "--data", "answers", "--out", str(tmp_path / "a")]) == 2
    assert "are --on answers" in one_error(capsys)
    assert main(["train", "--model", str(model_dir), "--on", "instructions", "--loss", "answer-log", "--out",
                 str(tmp_path / "a")]) == 2
    assert "--loss answer-log scores answers" in one_error(capsys)
    assert main([*base, "--head", "linear", "--method", "thermometer", "--out", str(tmp_path / "a")]) == 2
    assert "give one" in one_error(capsys)
    assert main([*base, "--online", "--out", str(tmp_path / "a")]) == 2
    assert "--online: instruction data only" in one_error(capsys)
    assert not (tmp_path / "a").exists()


def test_thermometer_and_the_token_term_train_on_answers(model_dir, tmp_path, capsys):
    base = ["-q", "train", "--model", str(model_dir), *POOL[2:]]  # no --on: answers are the default
    out = tmp_path / "thermo"
    assert main([*base, "--out", str(out)]) == 0  # no --method: Thermometer, the default
    config = json.loads((out / "head" / "calibrator_config.json").read_text())
    assert config["type"] == "thermometer"
    record = config["history"][0]
    assert record["data"] == "answers" and record["loss_type"] == "answer-log" and record["token_weight"] == 0.0
    history = json.loads((out / "head" / "training_history.json").read_text())  # as an instruction head's folder
    assert len(history["steps"]) >= 1 and "loss" in history["steps"][0]
    assert json.loads((out / "head" / "fingerprint.json").read_text())["training"]["data"] == "answers"
    printed = capsys.readouterr().out
    assert "| sciq | 3 |" in printed and "nan" not in printed  # AUROC of an all-wrong task is shown as "-"
    assert main([*base, "--method", "thermometer", "--out", str(out)]) == 0  # the same settings: reused
    assert f"head reused from {out / 'head'}" in capsys.readouterr().out
    # instruction features from `ats train`, then a linear head with the token term read from them
    instr = tmp_path / "instr"
    assert main(["-q", "train", "--model", str(model_dir), "--data", "alpaca_gpt4", "--limit", "8", "--max-length",
                 "48", "--epochs", "1", "--batch-size", "2", "--micro-batch-size", "2", "--head", "linear", "--out",
                 str(instr)]) == 0
    out = tmp_path / "tokens"
    args = [*base, "--method", "linear+tokens", "--token-features", str(instr / "features"), "--out", str(out)]
    assert main([*args, "--token-weight", "0.5"]) == 0
    config = json.loads((out / "head" / "calibrator_config.json").read_text())
    assert config["head"]["head_type"] == "linear"
    assert {k: config["training"][k] for k in ("token_weight", "token_max", "token_window", "data")} == {
        "token_weight": 0.5, "token_max": 64, "token_window": 512, "data": "answers"}
    capsys.readouterr()
    assert main([*args, "--token-weight", "1.0"]) == 2  # another weight: refused, naming it
    assert "made with other options: training.token_weight 0.5 -> 1.0" in one_error(capsys)


def test_a_probe_fits_on_answers_and_is_reused_and_answers_refuse_several_processes(model_dir, tmp_path, capsys,
                                                                                    monkeypatch):
    from ats.calibrators import load_calibrator
    from ats.model.backbone import load_backbone
    from ats.training.answers import AnswerSet, score_answers

    out = tmp_path / "probe"
    args = ["-q", "train", "--model", str(model_dir), "--pool-size", "6", "--mmlu-pool", "0", "--method", "probe",
            "--out", str(out)]
    assert main(args) == 0
    config = json.loads((out / "head" / "calibrator_config.json").read_text())
    assert config["type"] == "probe" and config["training"]["data"] == "answers"
    assert [q["name"] for q in config["training"]["questions"]] == config["training"]["tasks"]
    chosen, settings = config["selection"]["chosen"], config["selection"]["settings"]
    # the one-standard-error rule, by hand: the smallest setting within one standard error of the lowest loss
    lowest = min(settings, key=lambda s: s["left_out_log_loss"])
    folds = list(lowest["per_fold_log_loss"].values())
    mean = sum(folds) / len(folds)
    error = (sum((f - mean) ** 2 for f in folds) / (len(folds) - 1) / len(folds)) ** 0.5
    near = [s for s in settings if s["left_out_log_loss"] <= lowest["left_out_log_loss"] + error]
    assert chosen == min(near, key=lambda s: (len(s["layers"]) * len(s["views"]), s["c"]))
    assert settings[0]["layers"] == [] and len(settings) == 1 + 5 * 3 * 3  # the confidence alone, then the grid
    assert set(chosen["per_fold_log_loss"]) == set(config["training"]["tasks"])  # each pool task left out once
    printed = capsys.readouterr().out
    assert "probe" in printed and "| sciq | 6 |" in printed
    history = json.loads((out / "head" / "training_history.json").read_text())
    assert history["selection"]["chosen"] == chosen and (out / "head" / "fingerprint.json").is_file()
    # the table's probe confidence is the saved probe's on the cached answers
    backbone = load_backbone(str(model_dir))
    probe = load_calibrator(out / "head", backbone)
    sciq = AnswerSet.load(out / "answers" / "sciq")
    conf, _ = score_answers(probe, sciq, backbone.logits)
    assert conf.shape == (6,) and ((conf > 0) & (conf < 1)).all()
    assert main(args) == 0 and f"head reused from {out / 'head'}" in capsys.readouterr().out
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert main(args) == 2
    assert "--on answers trains on one process (WORLD_SIZE=2)" in one_error(capsys)
