"""`ats eval`: evaluate calibrators (saved folders, or baselines and controls fitted on --data) on tasks."""

from __future__ import annotations

from pathlib import Path

from ..checks import check_nonnegative_int, check_positive_int
from ..errors import ATSError
from . import options


def add_parser(sub) -> None:
    """Add `ats eval` to `sub`, the sub-command parsers of `ats`."""
    from ..calibrators import REGISTRY
    from ..evaluation.tasks import KNOWN_SPECS

    p = sub.add_parser("eval", help="evaluate calibrators on MMLU / TriviaQA / TruthfulQA / your own MC sets")
    options.add_model(p)
    options.add_data(p)
    options.add_training(p, exclude=("save_every",))
    p.add_argument("--calibrator", type=options.nonempty("--calibrator"), action="append", default=None,
                   help="a saved calibrator folder, or a name to fit on --data: " + ", ".join(REGISTRY)
                        + " (repeatable or comma-separated; ATS-family names train with the head options)")
    p.add_argument("--tasks", default="mmlu,triviaqa,truthfulqa_mc1", help="comma-separated: " + ", ".join(KNOWN_SPECS))
    options.add_number(p, "--task-limit", int, check_positive_int, default=None,
                       help="examples per task (MMLU: per subject)")
    options.add_number(p, "--bootstrap", int, check_nonnegative_int, default=0,
                       help="bootstrap resamples for confidence intervals and paired differences (e.g. 1000)")
    p.add_argument("--reference", action="append", default=None,
                   help="method(s) compared with every other by paired differences (default: ats)")
    options.add_overwrite(p)
    p.add_argument("--out", type=options.out_folder("--out"), required=True)
    p.set_defaults(run=run, resumes=True)  # a rerun reuses finished steps


def run(args) -> int:
    """Run `ats eval` with the parsed `args`; returns the exit code."""
    from ..evaluation.tasks import build_task, resolve

    out = Path(args.out)
    names = options.split_names(args.calibrator, "none", option="--calibrator")
    specs = options.split_names([args.tasks], "", option="--tasks")
    options.check_model(args.model)
    folders = options.calibrator_folders(names)
    for spec in specs:
        resolve(spec)  # an unknown task fails before the library loads
    to_fit = [n for n in names if folders[n] is None and n != "none"]
    data = options.data_config(args) if to_fit else None
    training = options.training_config(args) if to_fit else None

    from ..calibrators.base import Uncalibrated  # the library loads once the options are checked
    from ..evaluation.evaluate import evaluate, results_markdown
    from ..workflows.pipeline import fit_calibrators, prepare_features

    tasks = [build_task(t, limit=args.task_limit) for t in specs]  # task files read here, before the model loads
    backbone = options.backbone_from_args(args)
    calibrators: dict = {"uncalibrated": Uncalibrated()}
    for name in names:
        if folders[name] is not None:
            calibrator = options.load_calibrator_folder(folders[name], backbone)
            label = calibrator.label if calibrator.label not in calibrators else Path(name).name
            calibrators[label] = calibrator
    known = [*calibrators, *to_fit]
    unknown = [r for r in args.reference or () if r not in known]  # the default, ats, is skipped where absent
    if unknown:
        raise ATSError(f"--reference {unknown[0]!r}: not a method of this evaluation ({', '.join(known)})")
    if to_fit:
        train_store, val_store = prepare_features(backbone, args.features or out / "features", data,
                                                  overwrite=args.overwrite, progress=not args.quiet)
        calibrators.update(fit_calibrators(backbone, train_store, out / "calibrators", tuple(to_fit),
                                           val_store=val_store, training=training, overwrite=args.overwrite,
                                           progress=not args.quiet))
    results = evaluate(backbone, calibrators, tasks, out, bootstrap=args.bootstrap,
                       references=tuple(args.reference or ["ats"]), overwrite=args.overwrite,
                       progress=not args.quiet)
    print(results_markdown(results))
    print(f"\nresults: {out / 'results.json'}, {out / 'results.md'}, figures in {out / 'figures'}")
    return 0
