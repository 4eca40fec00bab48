"""A CLI that answers at once: no torch on import, the parser replayed from its record, identical to the built one."""

import argparse
import json
import os
import subprocess
import sys
import time

import pytest

from ats.cli import parser_cache
from ats.cli.main import build_parser


def _python(code: str, cache) -> str:
    env = {**os.environ, "ATS_CACHE": str(cache), "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def test_import_of_the_cli_loads_no_torch(tmp_path):
    loaded = _python("import sys, ats.cli.main; print(sorted(m for m in ('torch', 'transformers', 'sklearn') "
                     "if m in sys.modules))", tmp_path)
    assert loaded.strip() == "[]"


def test_help_and_argument_errors_with_a_saved_record_load_no_torch(tmp_path):
    code = ("import sys, contextlib, io\nfrom ats.cli.main import main\ncodes, err = [], io.StringIO()\n"
            "for argv in (['--help'], ['train', '--help'], ['eval', '--head', 'bogus', '--out', 'x'],\n"
            "             ['train', '--lr', '0', '--out', 'x'], ['ablate', '--warmup-ratio', '2', '--out', 'x']):\n"
            "    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):\n"
            "        try:\n            codes.append(main(argv))\n"
            "        except SystemExit as e:\n            codes.append(e.code)\n"
            "print(*codes, 'torch' in sys.modules)\nprint(err.getvalue().splitlines()[-2:])")
    _python(code, tmp_path)  # first run: builds the parser (imports torch) and saves its record
    assert list((tmp_path / "cli").glob("parser-*.json"))
    codes, errors = _python(code, tmp_path).splitlines()
    assert codes.split() == ["0", "0", "2", "2", "2", "False"]
    assert errors == str(["ats: error: lr: expected a number > 0, got 0.0",
                          "ats: error: warmup_ratio: expected a value in [0.0, 1.0], got 2.0"])


def test_replayed_parser_equals_the_built_one(tmp_path, monkeypatch):
    monkeypatch.setenv("ATS_CACHE", str(tmp_path))
    built = build_parser()
    saved = build_parser(cached=True)  # builds and saves the record
    replayed = build_parser(cached=True)  # replays it
    assert [p.name for p in (tmp_path / "cli").iterdir()] == [parser_cache.cache_file(parser_cache.source_key()).name]
    assert replayed.format_help() == built.format_help() == saved.format_help()
    built_subs, replayed_subs = _subparsers(built), _subparsers(replayed)
    assert list(replayed_subs) == list(built_subs)
    for name, sub in built_subs.items():
        assert replayed_subs[name].format_help() == sub.format_help(), name
    argv = ["eval", "--calibrator", "temperature", "--calibrator", "vector", "--lr", "0.01", "--head", "linear",
            "--bf16", "--out", "o"]
    a, b = vars(built.parse_args(argv)), vars(replayed.parse_args(argv))
    assert a.pop("run").__module__ == "ats.cli.eval" and isinstance(b.pop("run"), parser_cache.LazyFunction)
    assert a == b and b["calibrator"] == ["temperature", "vector"] and b["lr"] == 0.01 and b["bf16"] is True


def test_train_help_states_the_head_default_the_command_resolves(tmp_path, monkeypatch):
    """--head, --loss, --lr and --data parse to None and `ats train` picks them from --on: --help names those
    defaults, not 'automatic', in the built parser and in the replayed record alike."""
    from ats.model.heads import HeadConfig
    from ats.training.config import ANSWER_LR
    from ats.workflows.answer_methods import DEFAULT_ANSWER_METHOD

    monkeypatch.setenv("ATS_CACHE", str(tmp_path))
    build_parser(cached=True)  # builds and saves the record
    for parser in (build_parser(), build_parser(cached=True)):
        train = _subparsers(parser)["train"]
        assert train.parse_args(["--out", "x"]).head_type is None
        text = " ".join(train.format_help().split())
        assert (f"the paper's) (default: {HeadConfig.head_type} on instructions; on answers --method decides "
                f"({DEFAULT_ANSWER_METHOD} by default))") in text
        assert "(default: automatic)" not in text.split("--head {")[-1].split("--max-scale")[0]
        # --loss parses to the instruction loss, which --on answers replaces by the answer loss
        assert "(default: selective on instructions, answer-log on answers)" in text
        assert f"(default: on instructions from the number of optimizer steps, {ANSWER_LR:g} on answers)" in text
        assert "(default: alpaca_gpt4; giving --data implies --on instructions)" in text


def test_a_damaged_or_foreign_record_is_rebuilt(tmp_path, monkeypatch):
    monkeypatch.setenv("ATS_CACHE", str(tmp_path))
    calls = []

    def define(parser):
        calls.append(1)
        parser.add_argument("--n", type=int, default=3, choices=(1, 2, 3))

    path = parser_cache.cache_file(parser_cache.source_key())
    path.parent.mkdir(parents=True)
    path.write_text("{not json")
    assert parser_cache.cached_parser(argparse.ArgumentParser, define).parse_args(["--n", "2"]).n == 2
    assert calls == [1] and json.loads(path.read_text())[0]["kwargs"]["$dict"]["choices"] == {"$tuple": [1, 2, 3]}
    assert parser_cache.cached_parser(argparse.ArgumentParser, define).parse_args([]).n == 3
    assert calls == [1]  # replayed, not rebuilt
    path.write_text(json.dumps([{"on": 0, "call": "add_argument", "args": ["--n"], "kwargs": {"$bogus": 1}}]))
    assert parser_cache.cached_parser(argparse.ArgumentParser, define).parse_args([]).n == 3 and calls == [1, 1]


def test_a_parser_that_cannot_be_recorded_is_built_and_not_saved(tmp_path, monkeypatch):
    monkeypatch.setenv("ATS_CACHE", str(tmp_path))

    def define(parser):
        parser.add_argument("--x", type=lambda s: s.upper())  # a lambda has no importable name

    assert parser_cache.cached_parser(argparse.ArgumentParser, define).parse_args(["--x", "a"]).x == "A"
    assert not (tmp_path / "cli").exists()


def test_the_record_key_changes_with_any_source_file(tmp_path, monkeypatch):
    package = tmp_path / "ats"
    (package / "cli").mkdir(parents=True)
    (package / "cli" / "a.py").write_text("x = 1\n")
    monkeypatch.setattr(parser_cache, "PACKAGE", package)
    monkeypatch.setattr(parser_cache, "STARTED", time.time() + 60)  # as if the process started after the edits
    first = parser_cache.source_key()
    (package / "cli" / "a.py").write_text("x = 2\n")
    assert parser_cache.source_key() != first


def test_no_record_is_read_or_written_when_a_source_file_changed_after_the_process_started(tmp_path, monkeypatch):
    """Its loaded modules may be older than the files: a record built from them would be stored under the new
    files' key (seen: a test session running while the CLI's defaults were edited)."""
    package = tmp_path / "ats"
    package.mkdir()
    (package / "a.py").write_text("x = 1\n")
    monkeypatch.setattr(parser_cache, "PACKAGE", package)
    monkeypatch.setenv("ATS_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(parser_cache, "STARTED", time.time() - 60)
    assert parser_cache.source_key() is None
    parser = parser_cache.cached_parser(argparse.ArgumentParser, lambda p: p.add_argument("--n", type=int, default=4))
    assert parser.parse_args([]).n == 4 and not (tmp_path / "cache").exists()


@pytest.mark.parametrize("argv", [["bogus"], ["train", "--head", "bogus", "--out", "x"], ["serve", "--port", "x"]])
def test_argument_errors_exit_2(argv, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("ATS_CACHE", str(tmp_path))
    from ats.cli.main import main

    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2 and "error:" in capsys.readouterr().err
