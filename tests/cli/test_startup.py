"""A CLI that answers at once: `--help` and argument errors import no torch, transformers or sklearn, in a fresh
process (as right after `pip install` or an edit: there is no cache of any kind)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import ats
from ats.cli.main import COMMANDS, build_parser

HEAVY = ("torch", "transformers", "sklearn")
# each: (argv, exit code, the one line of stderr, or None to check only the code)
ARGUMENT_ERRORS = [
    (["bogus"], 2, None),
    (["train", "--lr", "0", "--out", "x"], 2, "ats: error: lr: expected a number > 0, got 0.0"),
    (["ablate", "--warmup-ratio", "2", "--out", "x"], 2,
     "ats: error: warmup_ratio: expected a value in [0.0, 1.0], got 2.0"),
    (["eval", "--epochs", "0", "--out", "x"], 2, "ats: error: epochs: expected an integer >= 1, got 0"),
    (["train", "--lr", "abc", "--out", "x"], 2,
     "ats train: error: argument --lr: invalid float value: 'abc' (see ats train --help)"),  # not 20 lines of usage
    (["train", "--epochs", "1.5", "--out", "x"], 2,
     "ats train: error: argument --epochs: invalid int value: '1.5' (see ats train --help)"),
    (["eval", "--head", "bogus", "--out", "x"], 2, None),
    (["train", "--loss", "bogus", "--out", "x"], 2, None),
    (["serve", "--port", "x"], 2, None),
    (["train"], 2, "ats train: error: the following arguments are required: --out (see ats train --help)"),
    # checks that commands make before they import the library
    (["generate", "--calibrator", "none", "--max-new-tokens", "0", "hi"], 2,
     "ats: error: --max-new-tokens: expected a positive integer, got 0"),
    (["serve", "--calibrator", "none", "--port", "70000"], 2,
     "ats: error: --port: expected a value in [1, 65535], got 70000"),
    (["train", "--pool-size", "0", "--out", "x"], 2, "ats: error: --pool-size: expected a positive integer, got 0"),
    (["train", "--batch-size", "6", "--micro-batch-size", "4", "--out", "x"], 2,
     "ats: error: batch_size 6 must be a multiple of micro_batch_size 4"),
    (["train", "--model", "./no/model", "--out", "x"], 2, None),
    (["eval", "--calibrator", "platt", "--out", "x"], 2, None),
    (["eval", "--tasks", "mmlu,bogus", "--out", "x"], 2, None),
    (["generate", "--calibrator", "no/such/folder/x", "hi"], 2, None),
    (["certify", "--calibrator", "x", "--start-coverage", "chose"], 2,
     "ats certify: error: argument --start-coverage: invalid 'choose' or number value: 'chose' (see ats certify "
     "--help)"),
    (["certify", "--calibrator", "x", "--start-coverage", "1"], 2,
     "ats: error: --start-coverage: expected a value in [0, 1), got 1.0"),
    (["certify", "--calibrator", "x", "--selection-size", "2"], 2,
     "ats: error: --selection-size 2: only with --start-coverage choose (selection questions choose the start)"),
    (["calibration-report", "no/such/samples.jsonl"], 2, "ats: error: no/such/samples.jsonl: no such file or folder"),
]


def _fresh(code: str, cwd=None) -> str:
    """stdout of `code` run by a fresh Python (nothing imported yet, the `ats` package under test) in folder `cwd`."""
    path = os.pathsep.join([str(Path(ats.__file__).parents[1]), os.environ.get("PYTHONPATH", "")])
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=cwd,
                          env={**os.environ, "PYTHONPATH": path}).stdout


def _subcommands() -> list[str]:
    action = next(a for a in build_parser()._actions if a.dest == "command")
    return list(action.choices)


def test_import_of_the_cli_loads_no_torch_transformers_or_sklearn():
    loaded = _fresh(f"import json, sys, ats.cli.main; print(json.dumps([m for m in {HEAVY!r} if m in sys.modules]))")
    assert json.loads(loaded) == []


def test_help_of_every_command_and_argument_errors_load_no_torch_transformers_or_sklearn(tmp_path):
    """`ats --help`, `ats COMMAND --help` for every command and every kind of argument error: the exit code and the
    message, none of the heavy libraries in sys.modules afterwards, and nothing written."""
    runs = [["--help"], *([name, "--help"] for name in _subcommands()), *(argv for argv, _, _ in ARGUMENT_ERRORS)]
    code = f"""
import contextlib, io, json, sys
from ats.cli.main import main
results = []
for argv in {runs!r}:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            status = main(argv)
        except SystemExit as stop:
            status = stop.code
    results.append([status, out.getvalue(), err.getvalue().strip().splitlines()])
print(json.dumps({{"results": results, "loaded": [m for m in {HEAVY!r} if m in sys.modules]}}))
"""
    report = json.loads(_fresh(code, cwd=tmp_path))
    assert report["loaded"] == [] and list(tmp_path.iterdir()) == []
    helps, errors = report["results"][:-len(ARGUMENT_ERRORS)], report["results"][-len(ARGUMENT_ERRORS):]
    assert len(helps) == 1 + len(COMMANDS)
    for status, out, _ in helps:
        assert status == 0 and out.startswith(("usage: ats", "usage: lm-eval"))  # `ats lm-eval --help`: lm-eval's
    for (argv, expected, message), (status, _, lines) in zip(ARGUMENT_ERRORS, errors):
        assert status == expected and len(lines) == 1, (argv, lines)  # one line, whatever kind of error
        assert (lines[0] == message) if message else ("error:" in lines[0]), (argv, lines)


def test_train_help_states_the_head_default_the_command_resolves():
    """--head, --loss, --lr and --data parse to None and `ats train` picks them from --on: --help names those
    defaults, not 'automatic'."""
    from ats.model.heads import HeadConfig
    from ats.training.config import ANSWER_LR, DEFAULT_ANSWER_METHOD

    train = next(a for a in build_parser()._actions if a.dest == "command").choices["train"]
    assert train.parse_args(["--out", "x"]).head_type is None
    text = " ".join(train.format_help().split())
    assert (f"the paper's) (default: {HeadConfig.head_type} on instructions; on answers --method decides "
            f"({DEFAULT_ANSWER_METHOD} by default))") in text
    assert "(default: automatic)" not in text.split("--head {")[-1].split("--max-scale")[0]
    # --loss parses to the instruction loss, which --on answers replaces by the answer loss
    assert "(default: selective on instructions, answer-log on answers)" in text
    assert f"(default: on instructions from the number of optimizer steps, {ANSWER_LR:g} on answers)" in text
    assert "(default: alpaca_gpt4; giving --data implies --on instructions)" in text


def test_options_parse_to_checked_numbers():
    """A config option's value is converted and range-checked by argparse's `type=`: the parsed value is the
    number itself (int or float), and its bounds are accepted."""
    args = build_parser().parse_args(["eval", "--lr", "1e-2", "--alpha", "1", "--epochs", "3", "--warmup-ratio", "0",
                                      "--calibrator", "temperature", "--calibrator", "vector", "--bf16", "--out", "o"])
    assert (args.lr, args.alpha, args.epochs, args.warmup_ratio) == (0.01, 1.0, 3, 0.0)
    assert type(args.epochs) is int and type(args.alpha) is float
    assert args.calibrator == ["temperature", "vector"] and args.bf16 is True and args.run.__module__ == "ats.cli.eval"


@pytest.mark.parametrize("argv", [["bogus"], ["train", "--head", "bogus", "--out", "x"], ["serve", "--port", "x"]])
def test_argument_errors_exit_2(argv, capsys):
    from ats.cli.main import main

    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2 and "error:" in capsys.readouterr().err
