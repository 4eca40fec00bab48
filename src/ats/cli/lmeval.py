"""`ats lm-eval ARGS...`: lm-evaluation-harness's own command line with the `ats` model registered, then the
calibration report of the multiple-choice tasks it ran.

    ats lm-eval --model ats --model_args pretrained=smollm2-135m-instruct,calibrator=runs/smol/head \\
        --tasks arc_easy --device cpu --log_samples --output_path results/

Every argument goes to lm-eval unchanged (`lm_eval --help` lists them; `ats lm-eval ls tasks` works too). With
`--log_samples --output_path DIR`, each samples file the run wrote for a multiple-choice task is read back and
`calibration_<date>/` is written beside it (as `ats calibration-report` does).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

from ..errors import ATSError
from .options import check_model

logger = logging.getLogger(__name__)


def add_parser(sub) -> None:
    """Add `ats lm-eval` to `sub`, the sub-command parsers of `ats`."""
    p = sub.add_parser("lm-eval", add_help=False, prefix_chars="\0",  # every argument, -h included, is lm-eval's
                       help="lm-evaluation-harness with the `ats` model (--model ats --model_args pretrained=M,"
                            "calibrator=DIR|none), then calibration reports of its multiple-choice tasks")
    p.add_argument("lm_eval_args", nargs=argparse.REMAINDER, help="lm-eval's arguments")
    p.set_defaults(run=run)


def _known(argv: list[str]) -> argparse.Namespace:
    """The few lm-eval arguments this command reads itself (the rest are lm-eval's alone)."""
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--model", "-M", default=None)
    p.add_argument("--model_args", "-a", nargs="+", action="extend", default=[])
    p.add_argument("--output_path", "-o", default=None)
    p.add_argument("--log_samples", "-s", action="store_true")
    known, _ = p.parse_known_args(argv)
    return known


def model_args(values: list[str]) -> dict[str, str]:
    """`--model_args` as lm-eval reads it: a JSON object, or key=value items separated by commas or spaces.

    `values`: the option's words; returns {key: value} (values as strings; a later key wins).
    """
    out: dict[str, str] = {}
    for value in values:
        try:
            parsed = json.loads(value)
        except json.JSONDecodeError:
            parsed = None
        if isinstance(parsed, dict):
            out.update({k: str(v) for k, v in parsed.items()})
            continue
        for item in value.split(","):
            key, sep, val = item.partition("=")
            if sep:
                out[key.strip()] = val.strip()
    return out


def check_ats_model(known: argparse.Namespace) -> None:
    """For `--model ats`: refuse a missing model or an unusable calibrator before lm-eval indexes its tasks and
    loads anything.

    `known`: the lm-eval arguments read here (--model, --model_args); raises `ATSError` naming the bad one.
    """
    if known.model != "ats":
        return
    from ..integrations.lm_eval_model import check_calibrator
    from ..model.embedded import DEFAULT_MODEL

    given = model_args(known.model_args)
    check_model(given.get("pretrained", DEFAULT_MODEL), option="pretrained=")
    check_calibrator(given.get("calibrator"))


def new_sample_files(output_path: Path, since: float) -> list[Path]:
    """The samples files lm-eval wrote under `output_path` (a folder, or a results .json in one) since `since` (a
    `time.time()` value), sorted."""
    root = output_path.parent if output_path.suffix == ".json" else output_path
    if not root.is_dir():
        return []
    return sorted(p for p in root.rglob("samples_*.jsonl") if p.stat().st_mtime >= since)


def _raised_in(err: BaseException, folder: str) -> bool:
    """Whether `err` was raised by code under `folder` (a path fragment such as "lm_eval/config/")."""
    frame = err.__traceback__
    while frame is not None and frame.tb_next is not None:
        frame = frame.tb_next
    return frame is not None and folder in Path(frame.tb_frame.f_code.co_filename).as_posix()


def run(args) -> int:
    """Run `ats lm-eval` with the parsed `args`; returns the exit code."""
    try:
        from lm_eval.__main__ import cli_evaluate
    except ImportError:
        raise ATSError("lm-eval is not installed: pip install 'ats[lm-eval]'") from None

    argv = list(args.lm_eval_args)
    listing = not argv or argv[0] in ("ls", "validate") or "-h" in argv or "--help" in argv  # no model runs
    known = _known(argv)
    if not listing:  # lm-eval's help and listings answer without torch
        check_ats_model(known)
        from ..integrations import lm_eval_model  # noqa: F401  registers the `ats` model with lm-eval
    if known.model == "vllm":  # calibrated models exported by `ats export --engine vllm` (docs/vllm.md)
        from ..integrations.vllm import alias_vllm_distribution

        alias_vllm_distribution()
    output_path = Path(known.output_path) if known.output_path else None
    start = time.time() - 1.0  # file times may be rounded down
    saved = sys.argv
    sys.argv = ["lm-eval", *argv]
    try:
        cli_evaluate()
    except ValueError as err:  # lm-eval's refusal of its arguments (an unknown task, a bad seed): one line
        if not _raised_in(err, "lm_eval/config/"):
            raise
        raise ATSError(f"lm-eval: {err}") from None
    finally:
        sys.argv = saved
        if known.model == "vllm":  # before exit, not from vLLM's exit hook (shut_down_engines)
            from ..integrations.vllm import shut_down_engines

            shut_down_engines()
    if listing:
        return 0
    from ..integrations.calibration_report import calibration_report, format_report
    from ..integrations.lm_eval_samples import SAMPLES_NAME, NotMultipleChoice, read_samples

    if output_path is None or not known.log_samples:
        print("\nats: add --log_samples --output_path DIR for the calibration report of multiple-choice tasks",
              file=sys.stderr)
        return 0
    runs: dict[tuple[Path, str], list] = {}
    for path in new_sample_files(output_path, start):
        try:
            samples = read_samples(path)
        except NotMultipleChoice:
            logger.info("%s: not a multiple-choice task; no calibration report", path.name)
            continue
        match = SAMPLES_NAME.match(path.name)
        runs.setdefault((path.parent, match["date"] if match else "run"), []).append(samples)
    for (folder, date), files in runs.items():
        out = folder / f"calibration_{date}"
        print("\n" + format_report(calibration_report(files, out)))
        print(f"\nresults: {out / 'calibration.json'}, {out / 'calibration.md'}, figures in {out / 'figures'}")
    return 0
