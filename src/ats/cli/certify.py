"""`ats certify --model M --calibrator DIR --target-risk 0.1 --delta 0.1`: the lowest confidence threshold at which
the calibrator's answers are wrong at most `--target-risk` of the time, with probability at least 1 - `--delta`,
certified on labelled answers of the QA pool the calibrator never saw and saved in DIR/threshold.json, where `ats
serve` and `ats generate` read it (docs/method.md, "A certified answer-or-abstain threshold")."""

from __future__ import annotations

from functools import partial
from pathlib import Path

from ..checks import check_nonnegative_int, check_number, check_positive_int
from . import options

UNIT = partial(check_number, low=0, high=1, low_open=True, high_open=True)


def add_parser(sub) -> None:
    """Add `ats certify` to `sub`, the sub-command parsers of `ats`."""
    from ..workflows.answer_pool import FREE_FORM, AnswerPool, pool_names

    pool = AnswerPool()
    p = sub.add_parser("certify", help="certify an answer-or-abstain threshold of a calibrator on held-out answers",
                       description="Run the backbone on questions of the QA pool that `ats train --on answers` does "
                                   "not train on, and save in the calibrator's folder (threshold.json) the lowest "
                                   "confidence threshold whose error rate among answered questions is at most "
                                   "--target-risk with probability >= 1 - --delta (Clopper-Pearson bounds, "
                                   "fixed-sequence testing). The guarantee holds for questions like those.")
    options.add_model(p)
    p.add_argument("--calibrator", required=True, help="a saved calibrator folder (the threshold is saved in it)")
    options.add_number(p, "--target-risk", float, UNIT, default=0.1,
                       help="the highest error rate allowed among answered questions (default: 0.1)")
    options.add_number(p, "--delta", float, UNIT, default=0.1,
                       help="the probability allowed that the true risk is above --target-risk (default: 0.1)")
    options.add_number(p, "--size", int, check_positive_int, default=300,
                       help="held-out questions per pool task (MMLU validation: per subject; default: 300)")
    p.add_argument("--tasks", default=",".join(FREE_FORM),
                   help=f"pool tasks to certify on, comma-separated, of {', '.join(pool_names(1))} (default: the "
                        "free-form ones, whose confidence is what ats serve reports)")
    options.add_number(p, "--pool-size", int, check_positive_int, default=pool.pool_size,
                       help=f"the training pool's questions per task, left out (default: {pool.pool_size}, as ats "
                            "train)")
    options.add_number(p, "--mmlu-pool", int, check_nonnegative_int, default=pool.mmlu_per_subject,
                       help=f"the training pool's MMLU validation questions per subject, left out (default: "
                            f"{pool.mmlu_per_subject})")
    options.add_overwrite(p)
    p.set_defaults(run=run)


def run(args) -> int:
    """Run `ats certify` with the parsed `args`; returns the exit code."""
    from ..errors import ATSError
    from ..hub import is_repo_id

    options.check_model(args.model)
    if is_repo_id(args.calibrator) and not Path(args.calibrator).exists():
        raise ATSError(f"--calibrator {args.calibrator}: a Hub id; the threshold is saved in the calibrator's folder, "
                       f"so make a local copy first (ats convert {args.calibrator} DIR)")
    folder = options.calibrator_folder(args.calibrator)
    names = tuple(options.split_names([args.tasks], ""))

    from ..workflows.answer_pool import AnswerPool, held_out_tasks  # the library loads once the options are checked

    pool = AnswerPool(pool_size=args.pool_size, mmlu_per_subject=args.mmlu_pool)
    held_out_tasks(pool, args.size, names=names)  # unknown task names and data files fail before the model loads
    from ..workflows.certify import certify

    backbone = options.backbone_from_args(args)
    calibrator = options.load_calibrator_folder(folder, backbone)
    threshold, reused = certify(backbone, calibrator, folder, alpha=args.target_risk, delta=args.delta, pool=pool,
                                size=args.size, names=names, overwrite=args.overwrite, progress=not args.quiet)
    where = folder / "threshold.json"
    if threshold.threshold is None:
        print(f"no threshold certified: on {threshold.n} held-out answers no confidence level keeps the error rate "
              f"<= {threshold.alpha:g} with probability >= {1 - threshold.delta:g}; the calibrator abstains always "
              f"({'reused' if reused else 'saved to'} {where})")
    else:
        print(f"answer when the confidence is >= {threshold.threshold:.4f}: on {threshold.n} held-out answers it "
              f"answers {100 * threshold.coverage:.1f}% with error rate {threshold.risk:.3f} (upper "
              f"{100 * (1 - threshold.delta):g}% bound {threshold.bound:.3f} <= {threshold.alpha:g}); "
              f"{'reused' if reused else 'saved to'} {where}")
    return 0
