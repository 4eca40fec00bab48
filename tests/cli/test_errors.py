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


def test_missing_calibrator_folder_and_bad_mc_file(tmp_path, capsys):
    bad = tmp_path / "q.jsonl"
    bad.write_text('{"question": "2+2?", "choices": ["3", "4"], "answer": 5}\n')
    code, err = _run_cli(["eval", "--tasks", f"mc:{bad}", "--out", str(tmp_path / "o")], capsys)
    assert code == 2 and len(err) == 1 and "q.jsonl" in err[0] and "answer" in err[0], err


