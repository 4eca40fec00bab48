"""The CLI's errors: one line, exit status 2, nothing half-written."""

from pathlib import Path

import pytest

from ats.cli import main

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


@pytest.mark.parametrize("name, content, line", [
    ("data.jsonl", b'{"instruction": "a", "output": "b"}\n{"instruction": "caf\xe9", "output": "b"}\n', 2),
    ("data.json", b'[{"instruction": "a",\n  "output": "\xff"}]', 2),
])
def test_cli_data_file_not_utf8_names_file_and_line(tmp_path, capsys, name, content, line):
    data = tmp_path / name
    data.write_bytes(content)
    out = tmp_path / "run"
    code, err = _run_cli(["train", "--data", str(data), "--out", str(out)], capsys)
    bad = 0xE9 if name.endswith("l") else 0xFF
    assert code == 2 and err == [f"ats: error: {data}:{line}: not UTF-8 text (byte 0x{bad:02x})"], err
    assert not out.exists() or not any(p.is_file() for p in out.rglob("*"))


def test_a_broken_official_config_is_named_not_taken_for_a_missing_calibrator(tmp_path, capsys):
    folder = tmp_path / "official"
    folder.mkdir()
    (folder / "config.json").write_text('{"calibration_type": "transformer",')
    code, err = _run_cli(["convert", str(folder), str(tmp_path / "out")], capsys)
    assert code == 2 and err == [f"ats: error: {folder / 'config.json'}:1: invalid JSON (Expecting property name "
                                 f"enclosed in double quotes)"], err
    (folder / "config.json").unlink()
    (folder / "config.json").mkdir()  # a folder named config.json is no official layout
    code, err = _run_cli(["convert", str(folder), str(tmp_path / "out")], capsys)
    assert code == 2 and len(err) == 1 and "calibrator_config.json" in err[0], err  # not a file: no official layout


def test_missing_calibrator_folder_and_bad_mc_file(tmp_path, capsys):
    bad = tmp_path / "q.jsonl"
    bad.write_text('{"question": "2+2?", "choices": ["3", "4"], "answer": 5}\n')
    code, err = _run_cli(["eval", "--tasks", f"mc:{bad}", "--out", str(tmp_path / "o")], capsys)
    assert code == 2 and len(err) == 1 and "q.jsonl" in err[0] and "answer" in err[0], err




@pytest.mark.parametrize("argv, message", [
    (["train", "--model", "/no/such/dir"], "--model /no/such/dir: no such file or folder"),
    (["train", "--alpha", "1.5"], "alpha: expected a value in [0.0, 1.0], got 1.5"),
    (["train", "--lr", "0"], "lr: expected a number > 0, got 0.0"),
    (["train", "--head", "linear", "--batch-size", "6", "--micro-batch-size", "4"], "multiple of micro_batch_size"),
    (["demo", "--size", "tiny"], "lacks mmlu/test.jsonl"),
    (["eval", "--tasks", "mmlu", "--device", "bogus"], "--device bogus: not a device (cpu, cuda, cuda:1, mps, ...)"),
    (["eval", "--tasks", ""], "--tasks '': no names given"),
    (["eval", "--tasks", " , "], "--tasks ' , ': no names given"),
    (["eval", "--tasks", "mmlu", "--calibrator", " "], "--calibrator: expected a non-empty value, got ' '"),
    (["eval", "--tasks", "mmlu", "--task-limit", "0"], "--task-limit: expected a positive integer, got 0"),
    (["ablate", "--task-limit", "-3"], "--task-limit: expected a positive integer, got -3"),
    (["certify", "--calibrator", ""], "--calibrator: expected a non-empty value, got ''"),
    (["certify", "--calibrator", "x", "--start-coverage", "1"], "--start-coverage: expected a value in [0, 1), got 1"),
    (["train", "--device", "cuda:7"], "--device cuda:7: this torch is built without CUDA; use cpu"),
])
def test_bad_options_fail_before_the_model_loads_and_write_nothing(tmp_path, capsys, monkeypatch, argv, message):
    """The model given is a folder whose config.json is not JSON: had it been loaded first, the error would name it;
    the option's own error shows that the options were checked before any model loaded."""
    unloadable = tmp_path / "model"
    unloadable.mkdir()
    (unloadable / "config.json").write_text("{not json")
    data = tmp_path / "data"  # ATS_DATA_DIR without the task files (`ats demo` checks them first)
    (data / "alpaca_gpt4").mkdir(parents=True)
    (data / "alpaca_gpt4" / "alpaca_gpt4_1k.json").write_text('[{"instruction": "a", "input": "", "output": "b"}]')
    monkeypatch.setenv("ATS_DATA_DIR", str(data))
    out = tmp_path / "never"
    model = [] if "--model" in argv else ["--model", str(unloadable)]
    code, err = _run_cli([*argv, *model, "--out", str(out)], capsys)
    assert code == 2 and len(err) == 1 and message in err[0] and "config.json" not in err[0], err
    assert not out.exists()


@pytest.mark.parametrize("command", ["train", "eval", "ablate"])
def test_an_empty_out_is_refused_not_the_working_folder(tmp_path, capsys, monkeypatch, command):
    monkeypatch.chdir(tmp_path)
    code, err = _run_cli([command, "--tasks", "mmlu", "--out", ""] if command != "train" else
                         [command, "--out", ""], capsys)
    assert code == 2 and err == ["ats: error: --out: expected a non-empty value, got ''"], err
    assert list(tmp_path.iterdir()) == []


def test_a_file_where_the_vllm_export_folder_belongs_is_named(tmp_path, capsys):
    from ats.errors import ATSError
    from ats.integrations.vllm.export import export_for_vllm

    afile = tmp_path / "afile"
    afile.write_text("mine")
    for overwrite in ([], ["--overwrite"]):
        code, err = _run_cli(["export", "--calibrator", "none", *overwrite, str(afile)], capsys)
        assert code == 2 and err == [f"ats: error: OUT {afile}: a file, not a folder"], err
        code, err = _run_cli(["export", "--calibrator", "none", *overwrite, str(afile / "out")], capsys)
        assert code == 2 and err == [f"ats: error: OUT {afile / 'out'}: {afile} is a file, not a folder"], err
    with pytest.raises(ATSError, match=rf"^{afile}: a file, not a vLLM export folder; choose another OUT$"):
        export_for_vllm("smollm2-135m-instruct", None, afile, overwrite=True)  # the library refuses it too
    assert afile.read_text() == "mine"


def test_certify_needs_a_calibrator_folder(capsys):
    code, err = _run_cli(["certify", "--calibrator", "None"], capsys)
    assert code == 2 and err == ["ats: error: --calibrator None: this command needs a saved calibrator folder (ats "
                                 "train makes one)"], err


@pytest.mark.parametrize("command", ["train", "eval"])
def test_an_out_under_a_file_or_on_a_file_is_refused_as_parsed(tmp_path, capsys, command):
    afile = tmp_path / "afile"
    afile.write_text("mine")
    extra = ["--tasks", "mmlu"] if command == "eval" else []
    for out, message in ((afile, f"--out {afile}: a file, not a folder"),
                         (afile / "run", f"--out {afile / 'run'}: {afile} is a file, not a folder")):
        code, err = _run_cli([command, *extra, "--out", str(out)], capsys)
        assert code == 2 and err == [f"ats: error: {message}"], err
    assert afile.read_text() == "mine"


@pytest.mark.parametrize("argv, resumes", [
    (["train", "--out", "o"], True), (["eval", "--tasks", "mmlu", "--out", "o"], True),
    (["certify", "--calibrator", "c"], True), (["ablate", "--out", "o"], True), (["demo", "--out", "o"], True),
    (["generate", "--calibrator", "none", "hi"], False), (["serve", "--calibrator", "none"], False),
    (["export", "--calibrator", "none", "o"], False), (["convert", "a", "b"], False),
    (["calibration-report", "r"], False), (["lm-eval", "--tasks", "arc_easy"], False),
])
def test_an_interrupt_promises_a_continuation_only_where_a_rerun_reuses_finished_steps(argv, resumes):
    from ats.cli.main import build_parser, interrupted_message

    message = interrupted_message(build_parser().parse_args(argv))
    assert message == ("ats: interrupted; finished work is kept, run the same command again to continue" if resumes
                       else "ats: interrupted")
    assert interrupted_message(None) == "ats: interrupted"  # before the command is known
