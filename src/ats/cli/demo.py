"""`ats demo`: the README's main job, end to end on the embedded model and local data."""

from __future__ import annotations

import time
from pathlib import Path

from ..errors import ATSError
from ..model.embedded import DEFAULT_MODEL
from . import options

# What the demo reads from ATS_DATA_DIR (the layout of ../shared/data/README.md).
DEMO_FILES = ("mmlu/test.jsonl", "mmlu/dev.jsonl", "triviaqa/validation.jsonl", "truthfulqa/mc_task.json")


def add_parser(sub) -> None:
    """Add `ats demo` to `sub`, the sub-command parsers of `ats`."""
    from ..workflows.plans import SIZES

    p = sub.add_parser("demo", help="the end-to-end demo on the embedded model and local data")
    p.add_argument("--out", default="runs/demo")
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--size", default="demo", choices=list(SIZES),
                   help="tiny: a smoke run of a few minutes; demo: about 10 min on 2 CPU cores; benchmark: ~1 h")
    options.add_overwrite(p)
    p.set_defaults(run=run)


def run(args) -> int:
    """Train ATS on the embedded chat model, fit the controls and every baseline on the same data, evaluate all.

    `args`: the parsed options; returns the exit code.
    """
    from ..workflows.plans import SIZES

    options.check_model(args.model)
    check_data(SIZES[args.size].data)

    from ..evaluation.evaluate import format_paired  # the library loads once the options are checked
    from ..evaluation.report import format_table, token_table
    from ..model.backbone import load_backbone
    from ..workflows.experiment import run_experiment

    start = time.time()
    backbone = load_backbone(args.model, device=options.device(None))
    result = run_experiment(backbone, args.out, SIZES[args.size], overwrite=args.overwrite, progress=not args.quiet,
                            bootstrap=200)
    print("Token-level calibration on the held-out split:\n" + token_table(result.token_level))
    print("\nTask-level calibration (95% bootstrap intervals):\n" + format_table(result.tasks))
    paired = format_paired(result.tasks)
    if paired:
        print("\n" + paired)
    out = Path(args.out) / "eval"
    print(f"\nfigures: {out / 'figures'}; table: {out / 'results.md'}; total {(time.time() - start) / 60:.1f} min")
    return 0


def check_data(source: str) -> None:
    """Before the model loads: with ATS_DATA_DIR set, every file the demo reads must be there (one-line error naming
    the missing ones); unset, the data sets come from the Hugging Face Hub.

    Raises:
        ATSError: if ATS_DATA_DIR is not a folder or lacks a file the demo reads.
    """
    from ..sources import data_dir
    from ..training.data import KNOWN_SOURCES

    root = data_dir()
    if root is None:
        return
    needed = ((KNOWN_SOURCES[source][0],) if source in KNOWN_SOURCES else ()) + DEMO_FILES
    missing = [name for name in needed if not (root / name).is_file()]
    if missing:
        raise ATSError(f"ATS_DATA_DIR={root} lacks {', '.join(missing)} (the demo reads the layout of "
                       f"../shared/data/README.md; unset ATS_DATA_DIR to read the Hugging Face Hub instead)")
