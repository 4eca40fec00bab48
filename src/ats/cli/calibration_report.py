"""`ats calibration-report`: ECE, adaptive ECE, Brier, AUROC and reliability diagrams of lm-eval sample files."""

from __future__ import annotations

from pathlib import Path

from ..checks import check_nonnegative_int, check_positive_int
from ..errors import ATSError
from . import options


def add_parser(sub) -> None:
    """Add `ats calibration-report` to `sub`, the sub-command parsers of `ats`."""
    p = sub.add_parser("calibration-report",
                       help="calibration of lm-eval multiple-choice runs from their --log_samples files (any model)")
    p.add_argument("samples", nargs="+",
                   help="samples_<task>_<date>.jsonl files, or folders searched for them; two files of one task "
                        "are also compared question by question (paired bootstrap, first file minus the other)")
    p.add_argument("--out", type=options.out_folder("--out"), default=None,
                   help="output folder (default: a `calibration` folder beside the first file)")
    p.add_argument("--label", action="append", default=None,
                   help="a name per file for the tables (repeatable, in file order; default: model and calibrator "
                        "from lm-eval's results file beside it)")
    p.add_argument("--task", default=None, help="task name (default: from each file's name)")
    p.add_argument("--target-delimiter", default=None,
                   help="the task's target_delimiter, stripped from each continuation to get the choice whose length "
                        "acc_norm divides by (default: from lm-eval's results file, else ' ')")
    p.add_argument("--filter", default=None, help="which of lm-eval's filters to read (default: none)")
    options.add_number(p, "--n-bins", int, check_positive_int, default=15,
                       help="equal-width ECE bins (the top bin includes 1.0)")
    options.add_number(p, "--bootstrap", int, check_nonnegative_int, default=1000,
                       help="bootstrap resamples for 95%% intervals (0: none)")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(run=run)


def sample_files(items: list[str]) -> list[Path]:
    """The files named in `items`, and every samples_*.jsonl under the folders named, in order.

    Raises:
        ATSError: if an item does not exist or a folder holds no samples file.
    """
    files: list[Path] = []
    for item in items:
        path = Path(item).expanduser()
        if path.is_dir():
            found = sorted(path.rglob("samples_*.jsonl"))
            if not found:
                raise ATSError(f"{path}: no lm-eval samples files (samples_*.jsonl) in this folder")
            files += found
        elif path.is_file():
            files.append(path)
        else:
            raise ATSError(f"{path}: no such file or folder")
    return files


def run(args) -> int:
    """Run `ats calibration-report` with the parsed `args`; returns the exit code."""
    files = sample_files(args.samples)
    if args.label is not None and len(args.label) != len(files):
        raise ATSError(f"--label: {len(args.label)} label(s) for {len(files)} file(s)")

    from ..integrations.calibration_report import calibration_report, format_report  # once the options are checked
    from ..integrations.lm_eval_samples import read_samples

    labels = args.label or [None] * len(files)
    read = [read_samples(f, task=args.task, delimiter=args.target_delimiter, label=label, filter_name=args.filter)
            for f, label in zip(files, labels)]
    out = Path(args.out) if args.out else files[0].parent / "calibration"
    report = calibration_report(read, out, n_bins=args.n_bins, bootstrap=args.bootstrap, seed=args.seed)
    print(format_report(report))
    print(f"\nresults: {out / 'calibration.json'}, {out / 'calibration.md'}, figures in {out / 'figures'}")
    return 0
