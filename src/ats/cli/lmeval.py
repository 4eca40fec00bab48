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
import logging
import sys
import time
from pathlib import Path

from ..errors import ATSError
from ..integrations.calibration_report import calibration_report, format_report
from ..integrations.lm_eval_samples import SAMPLES_NAME, NotMultipleChoice, read_samples

logger = logging.getLogger(__name__)


def add_parser(sub) -> None:
    p = sub.add_parser("lm-eval", add_help=False, prefix_chars="\0",  # every argument, -h included, is lm-eval's
                       help="lm-evaluation-harness with the `ats` model (--model ats --model_args pretrained=M,"
                            "calibrator=DIR|none), then calibration reports of its multiple-choice tasks")
    p.add_argument("lm_eval_args", nargs=argparse.REMAINDER, help="lm-eval's arguments")
    p.set_defaults(run=run)


def _outputs(argv: list[str]) -> tuple[Path | None, bool]:
    """(lm-eval's --output_path, whether --log_samples) from its arguments."""
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--output_path", "-o", default=None)
    p.add_argument("--log_samples", "-s", action="store_true")
    known, _ = p.parse_known_args(argv)
    return (Path(known.output_path) if known.output_path else None), known.log_samples


def new_sample_files(output_path: Path, since: float) -> list[Path]:
    """The samples files lm-eval wrote under `output_path` (a folder, or a results .json in one) since `since`."""
    root = output_path.parent if output_path.suffix == ".json" else output_path
    if not root.is_dir():
        return []
    return sorted(p for p in root.rglob("samples_*.jsonl") if p.stat().st_mtime >= since)


def run(args) -> int:
    try:
        from lm_eval.__main__ import cli_evaluate
    except ImportError:
        raise ATSError("lm-eval is not installed: pip install 'ats[lm-eval]'") from None
    from ..integrations import lm_eval_model  # noqa: F401  registers the `ats` model with lm-eval

    argv = list(args.lm_eval_args)
    output_path, log_samples = _outputs(argv)
    start = time.time() - 1.0  # file times may be rounded down
    saved = sys.argv
    sys.argv = ["lm-eval", *argv]
    try:
        cli_evaluate()
    finally:
        sys.argv = saved
    if not argv or argv[0] in ("ls", "validate") or "-h" in argv or "--help" in argv:
        return 0
    if output_path is None or not log_samples:
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
