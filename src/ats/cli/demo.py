"""`ats demo`: the README's main job, end to end on the embedded model and local data."""

from __future__ import annotations

import os
import time
from pathlib import Path

from . import options


def add_parser(sub) -> None:
    """Add `ats demo` to `sub`, the sub-command parsers of `ats`."""
    from ..workflows.experiment import SIZES

    p = sub.add_parser("demo", help="the end-to-end demo on the embedded model and local data")
    p.add_argument("--out", default="runs/demo")
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--size", default="demo", choices=list(SIZES),
                   help="tiny: a smoke run of a few minutes; demo: about 10 min on 2 CPU cores; benchmark: ~1 h")
    options.add_overwrite(p)
    p.set_defaults(run=run)


def run(args) -> int:
    """Train ATS on the embedded chat model, fit the controls and every baseline on the same data, evaluate all.

    `args`: the parsed options; returns the exit code.
    """
    from ..evaluation.evaluate import format_paired
    from ..evaluation.report import format_table, token_table
    from ..model.backbone import load_backbone
    from ..sources import data_dir
    from ..workflows.experiment import SIZES, run_experiment

    options.check_model(args.model)
    start = time.time()
    if data_dir() is None and Path("../shared/data").is_dir():
        os.environ["ATS_DATA_DIR"] = str(Path("../shared/data").resolve())
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
