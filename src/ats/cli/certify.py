"""`ats certify --model M --calibrator DIR --target-risk 0.1 --delta 0.1`: the lowest confidence threshold at which
the calibrator's served answers are wrong at most `--target-risk` of the time, with probability at least 1 -
`--delta`, certified on free-form questions of the QA pool the calibrator never trained on, answered as `ats serve`
answers them, and saved in DIR/threshold.json, where `ats serve`, `ats generate` and the vLLM route read and check it
(docs/method.md, "A certified answer-or-abstain threshold")."""

from __future__ import annotations

from functools import partial
from pathlib import Path

from ..checks import check_number, check_positive_int
from ..confidence import ANSWER_MAX_TOKENS
from ..evaluation.start_coverage import DEFAULT_START_COVERAGE
from . import options

UNIT = partial(check_number, low=0, high=1, low_open=True, high_open=True)
CHOOSE = "choose"  # --start-coverage choose: chosen on selection answers


def start_or_choose(text: str) -> float | None:
    """--start-coverage's text: None for `CHOOSE`, else the number."""
    return None if text == CHOOSE else float(text)


start_or_choose.__name__ = f"'{CHOOSE}' or number"  # argparse's "invalid 'choose' or number value: 'x'"


def check_start(flag: str, value: float | None) -> float | None:
    """A start coverage in [0, 1), or None (chosen)."""
    return None if value is None else check_number(flag, value, low=0, high=1, high_open=True)


def add_parser(sub) -> None:
    """Add `ats certify` to `sub`, the sub-command parsers of `ats`."""
    from ..workflows.answer_pool import FREE_FORM

    p = sub.add_parser("certify", help="certify an answer-or-abstain threshold of a calibrator on held-out answers",
                       description="Answer free-form questions of the QA pool that the calibrator never trained on "
                                   "(its training record says which) as `ats serve` answers a chat request, and save "
                                   "in the calibrator's folder (threshold.json) the lowest confidence threshold whose "
                                   "error rate among answered questions is at most --target-risk with probability "
                                   ">= 1 - --delta (Clopper-Pearson bounds, fixed-sequence testing). The guarantee "
                                   "holds for questions drawn like those, asked alone and answered in that format, by "
                                   "this calibrator and backbone. The answers are saved beside it after every batch "
                                   "(certify_answers.json): a rerun goes on from them, and another target risk "
                                   "reuses them.")
    options.add_model(p)
    p.add_argument("--calibrator", type=options.nonempty("--calibrator"), required=True,
                   help="a saved calibrator folder (the threshold is saved in it)")
    options.add_number(p, "--target-risk", float, UNIT, default=0.1,
                       help="the highest error rate allowed among answered questions (default: 0.1)")
    options.add_number(p, "--delta", float, UNIT, default=0.1,
                       help="the probability allowed that the true risk is above --target-risk (default: 0.1)")
    options.add_number(p, "--size", int, check_positive_int, default=300,
                       help="certification questions per task (default: 300)")
    p.add_argument("--tasks", default=",".join(FREE_FORM),
                   help=f"free-form pool tasks to certify on, comma-separated, of {', '.join(FREE_FORM)} (default: "
                        "both)")
    options.add_number(p, "--max-tokens", int, check_positive_int, default=ANSWER_MAX_TOKENS,
                       help=f"new tokens at most per answer, as a served request's max_tokens (default: "
                            f"{ANSWER_MAX_TOKENS}, as ats generate)")
    options.add_number(p, "--prior-error", float, UNIT, default=None,
                       help="the error rate expected, to say at once whether --target-risk is reachable (default: "
                            f"estimated on the selection answers with --start-coverage {CHOOSE}, else on the first "
                            "answers)")
    options.add_number(p, "--start-coverage", start_or_choose, check_start, default=DEFAULT_START_COVERAGE,
                       help="start the certification sequence at the first threshold that answers at least this "
                            "fraction of the questions, so that a few wrong answers among the most confident cannot "
                            "end it; the guarantee is the same, and no threshold answering fewer is certified "
                            f"(default: {DEFAULT_START_COVERAGE:g}, chosen on one model's served answers, never "
                            f"reported; 0: from the fewest answers that can certify; {CHOOSE}: chosen for this "
                            "calibrator and --target-risk on its served answers to other held-out questions, "
                            "--selection-size per task, before any certification answer is judged)")
    options.add_number(p, "--selection-size", int, check_positive_int, default=None,
                       help=f"with --start-coverage {CHOOSE}: selection questions per task, after the certification "
                            "ones (default: --size)")
    options.add_number(p, "--pool-size", int, check_positive_int, default=None,
                       help="only for a calibrator trained on answers before its record named its questions: the "
                            "--pool-size it was trained with")
    options.add_overwrite(p)
    p.set_defaults(run=run, resumes=True)  # a rerun reuses finished steps


def run(args) -> int:
    """Run `ats certify` with the parsed `args`; returns the exit code."""
    from ..errors import ATSError
    from ..hub import is_repo_id
    from ..workflows.answer_pool import FREE_FORM

    if args.selection_size is not None and args.start_coverage is not None:
        raise ATSError(f"--selection-size {args.selection_size}: only with --start-coverage {CHOOSE} (selection "
                       "questions choose the start)")
    options.check_model(args.model)
    if is_repo_id(args.calibrator) and not Path(args.calibrator).exists():
        raise ATSError(f"--calibrator {args.calibrator}: a Hub id; the threshold is saved in the calibrator's folder, "
                       f"so make a local copy first (ats convert {args.calibrator} DIR)")
    folder = options.calibrator_folder(args.calibrator)
    names = tuple(options.split_names([args.tasks], "", option="--tasks"))
    unknown = [n for n in names if n not in FREE_FORM]
    if unknown:
        raise ATSError(f"--tasks: unknown {', '.join(unknown)}; certified answers are free-form, of "
                       f"{', '.join(FREE_FORM)}")

    from ..workflows.certify import certify  # the library loads once the options are checked

    backbone = options.backbone_from_args(args)
    calibrator = options.load_calibrator_folder(folder, backbone)
    done = certify(backbone, calibrator, folder, target_risk=args.target_risk, delta=args.delta, size=args.size,
                   names=names, max_tokens=args.max_tokens, pool_size=args.pool_size, prior_error=args.prior_error,
                   start_coverage=args.start_coverage, selection_size=args.selection_size, overwrite=args.overwrite,
                   progress=not args.quiet)
    threshold = done.threshold
    where = folder / "threshold.json"
    if done.early is not None and done.reused:
        print(done.early)
    at = (f"at {100 * done.start_coverage:g}% of them" if done.start_coverage else
          "at the fewest answers that can certify")
    how = (f"chosen on served answers to other questions: --start-coverage {CHOOSE}" if done.start_chosen else
           f"--start-coverage {done.start_coverage:g}")
    start = f"the sequence started {at} ({how})"
    if threshold.threshold is None:
        print(f"no threshold certified: on {threshold.n} held-out served answers, {start}, fixed-sequence testing "
              f"certifies no threshold keeping the error rate <= {threshold.target_risk:g} with probability >= "
              f"{1 - threshold.delta:g}; the calibrator abstains always "
              f"({'reused' if done.reused else 'saved to'} {where})")
    else:
        print(f"answer when the confidence is >= {threshold.threshold:.4f}: on {threshold.n} held-out served answers "
              f"it answers {100 * threshold.coverage:.1f}% with error rate {threshold.risk:.3f} (upper "
              f"{100 * (1 - threshold.delta):g}% bound {threshold.bound:.3f} <= {threshold.target_risk:g}); "
              f"{'reused' if done.reused else 'saved to'} {where}")
    smallest = ("no target risk below 1" if done.smallest_risk is None else
                f"the smallest target risk these answers certify at delta {threshold.delta:g} is "
                f"{done.smallest_risk:.4f}")
    print(f"{smallest}, {start}")
    return 0
