"""`ats ablate`: the paper's ablations (smoothing type, alpha, head) on one feature cache."""

from __future__ import annotations

from pathlib import Path

from ..checks import check_positive_int
from . import options


def add_parser(sub) -> None:
    """Add `ats ablate` to `sub`, the sub-command parsers of `ats`."""
    from ..evaluation.tasks import KNOWN_SPECS
    from ..workflows.configs import ABLATIONS

    p = sub.add_parser("ablate", help="ATS ablations: smoothing type, alpha, head (one feature cache, shared runs)")
    options.add_model(p)
    options.add_data(p)
    options.add_training(p, exclude=("loss_type", "alpha"))
    p.add_argument("--ablations", default=",".join(ABLATIONS), help="comma-separated: " + ", ".join(ABLATIONS))
    p.add_argument("--tasks", default="mmlu,triviaqa,truthfulqa_mc1", help="comma-separated: " + ", ".join(KNOWN_SPECS))
    options.add_number(p, "--task-limit", int, check_positive_int, default=None,
                       help="examples per task (MMLU: per subject)")
    options.add_overwrite(p)
    p.add_argument("--out", type=options.out_folder("--out"), required=True,
                   help="ablation folder (heads, eval, tables, ablations.json, figure)")
    p.set_defaults(run=run, resumes=True)  # a rerun reuses finished steps


def run(args) -> int:
    """Run `ats ablate` with the parsed `args`; returns the exit code."""
    from ..evaluation.tasks import build_tasks
    from ..workflows.ablate import ablation_plan, run_ablations
    from ..workflows.pipeline import prepare_features

    out = Path(args.out)
    options.check_model(args.model)
    ablation_plan(args.ablations)
    tasks = options.split_names([args.tasks], "", option="--tasks")
    build_tasks(tasks, args.task_limit)  # task specs and files checked before the model loads
    data = options.data_config(args)
    training = options.training_config(args)
    backbone = options.backbone_from_args(args)
    train_store, val_store = prepare_features(backbone, args.features or out / "features", data,
                                              overwrite=args.overwrite, progress=not args.quiet)
    summary = run_ablations(backbone, train_store, val_store, out, tasks=tasks, task_limit=args.task_limit,
                            ablations=args.ablations, training=training, seed=args.seed, overwrite=args.overwrite,
                            progress=not args.quiet)
    for ablation, table in summary["tables"].items():
        print(f"\n## {ablation}\n{table}")
    print(f"\nall numbers: {out / 'ablations.json'}")
    return 0
