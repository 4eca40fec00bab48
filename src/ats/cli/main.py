"""`ats` command line: thin argument parsing over the library, one module per command.

    ats train    --model M --out DIR        (Thermometer on the model's own answers to a labelled QA pool)
    ats train    --model M --data alpaca_gpt4 --head transformer --loss selective --alpha 0.5 --out DIR   (the paper)
    ats eval     --model M --calibrator DIR|temperature|... --tasks mmlu,triviaqa,truthfulqa_mc1 --out DIR
    ats certify  --model M --calibrator DIR --target-risk 0.1 --delta 0.1   (answer-or-abstain threshold)
    ats generate --model M --calibrator DIR "prompt"
    ats serve    --model M --calibrator DIR --port 8000      (OpenAI-compatible, calibrated logprobs)
    ats serve    --engine vllm --model M --calibrator DIR    (the same in vLLM's server; docs/vllm.md)
    ats export   --engine vllm --model M --calibrator DIR OUT   (a folder vLLM loads as the calibrated model)
    ats ablate   --out DIR
    ats demo     --out DIR         (the README's main job)

    accelerate launch --num_processes N -m ats train ...   (or torchrun --nproc_per_node N -m ats train ...):
    extraction and head training on N processes (docs/scaling.md)

Every user error prints one line `ats: error: ...` and exits with status 2; nothing half-written is left behind.
Progress goes to stderr (`-q` silences it); results go to stdout.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from ..errors import ATSError, OptionError
from . import ablate, calibration_report, certify, convert, demo, eval, export, generate, lmeval, serve, train

# A command is one module: `add_parser(sub)` adds its options (from the torch-free configs and name tables) and
# `run(args)` does the work, importing torch, transformers and the library inside. So `--help` and argument errors
# answer without them (tests/cli/test_startup.py).
COMMANDS = (train, eval, certify, generate, ablate, demo, serve, export, lmeval, calibration_report, convert)


class OneLineParser(argparse.ArgumentParser):
    """argparse's parser whose errors are one line that points at --help (argparse prints the whole usage first: 20
    lines for `ats train`, the error last); its sub-parsers are of this class too."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    """The `ats` parser: -q/--quiet and one sub-command per module in `COMMANDS`."""
    parser = OneLineParser(prog="ats", description="Adaptive Temperature Scaling for causal LMs")
    parser.add_argument("-q", "--quiet", action="store_true", help="no progress bars or progress messages")
    sub = parser.add_subparsers(dest="command", required=True)
    for command in COMMANDS:
        command.add_parser(sub)
    return parser


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever sys.stderr is when a message is logged (so redirection after start-up is followed)."""

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, _value) -> None:
        pass


def _configure_output(quiet: bool) -> None:
    handler = _StderrHandler()
    handler.setFormatter(logging.Formatter("[ats] %(message)s"))
    library = logging.getLogger("ats")
    library.handlers[:] = [handler]
    library.setLevel(logging.WARNING if quiet else logging.INFO)
    if quiet:
        os.environ["TQDM_DISABLE"] = "1"
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # vLLM's start-up notes, unless the user chose
        os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"  # read when huggingface_hub / transformers load
        if "transformers" in sys.modules or "huggingface_hub" in sys.modules:  # loaded already (main() in-process)
            from transformers.utils import logging as hf_logging

            hf_logging.disable_progress_bar()


def main(argv: list[str] | None = None) -> int:
    """Parse `argv` (None: sys.argv), run the sub-command and return its exit code: an `ATSError`, an option's
    failed check (`OptionError`) or an `OSError` is printed as one line and gives 2, an interrupt gives 130; argparse's
    own errors (unknown option, bad choice, not a number) exit with 2 as argparse does."""
    parser = build_parser()
    args = None
    try:
        args = parser.parse_args(argv)
        _configure_output(args.quiet)
        return args.run(args)
    except (ATSError, OptionError) as err:
        print(f"ats: error: {err}", file=sys.stderr)
        return 2
    except OSError as err:  # a full disk, a read-only folder, an unreadable file
        where = f"{err.filename}: " if getattr(err, "filename", None) else ""
        print(f"ats: error: {where}{err.strerror or err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(interrupted_message(args), file=sys.stderr)
        return 130


def interrupted_message(args: argparse.Namespace | None) -> str:
    """What an interrupted command says: that a rerun continues only where it does (a command whose parser sets
    `resumes`: its finished steps are saved and reused)."""
    if getattr(args, "resumes", False):
        return "ats: interrupted; finished work is kept, run the same command again to continue"
    return "ats: interrupted"
