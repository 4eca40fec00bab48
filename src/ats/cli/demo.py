"""`ats demo`: the README's main job, end to end on the embedded model and local data."""

from __future__ import annotations

import sys
import time
from pathlib import Path

from ..errors import ATSError
from ..model.embedded import DEFAULT_MODEL
from . import options

# What the demo reads from ATS_DATA_DIR (the layout of ../shared/data/README.md).
DEMO_FILES = ("mmlu/test.jsonl", "mmlu/dev.jsonl", "triviaqa/validation.jsonl", "truthfulqa/mc_task.json")
# The demo's wall time where it was timed and, measured in that same run by `forward_throughput` (the number the demo
# prints, so estimate and reference are one measurement), SmolLM2's forward speed there: 5.5 min from a fresh clone on
# 2 idle Intel Xeon cores (2026-12-05). The reference was once the extraction benchmark's speed, a different
# measurement (429 tokens/s where forward_throughput reads far more), and the estimate came out 2-3x short.
REFERENCE = {"demo": (330.0, 832.0)}


def add_parser(sub) -> None:
    """Add `ats demo` to `sub`, the sub-command parsers of `ats`."""
    from ..workflows.configs import SIZES

    p = sub.add_parser("demo", help="the end-to-end demo on the embedded model and local data")
    p.add_argument("--out", type=options.out_folder("--out"), default="runs/demo")
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--size", default="demo", choices=list(SIZES),
                   help="tiny: a smoke run; demo: about 5.5 min where SmolLM2's forward pass runs at 830 tokens/s "
                        "(it prints its estimate for this machine at the start); benchmark: 1,000 examples, an hour "
                        "or more")
    options.add_overwrite(p)
    p.set_defaults(run=run, resumes=True)  # a rerun reuses finished steps


def run(args) -> int:
    """Train ATS on the embedded chat model, fit the controls and every baseline on the same data, evaluate all.

    `args`: the parsed options; returns the exit code.
    """
    from ..workflows.configs import SIZES

    options.check_model(args.model)
    check_data(SIZES[args.size].data)

    from ..evaluation.evaluate import format_paired  # the library loads once the options are checked
    from ..evaluation.report import format_table, token_table
    from ..model.backbone import load_backbone
    from ..workflows.experiment import run_experiment

    start = time.time()
    backbone = load_backbone(args.model, device=options.device(None))
    if args.size in REFERENCE and args.model == "smollm2-135m-instruct":
        seconds, reference = REFERENCE[args.size]
        speed = forward_throughput(backbone)
        print(f"[ats] SmolLM2's forward pass runs at {speed:.0f} tokens/s here: the demo takes about "
              f"{seconds * reference / speed / 60:.0f} min ({seconds / 60:.0f} min at {reference:.0f} tokens/s)",
              file=sys.stderr, flush=True)
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


def forward_throughput(backbone, rows: int = 2, length: int = 256) -> float:
    """Tokens per second of the bare forward pass on `rows` x `length` random tokens (after one warm-up pass): the
    machine's speed, from which the demo's duration is estimated (its work is mostly such passes)."""
    import torch

    ids = torch.randint(0, backbone.vocab_size, (rows, length), generator=torch.Generator().manual_seed(0))
    ids = ids.to(backbone.device)
    backbone.forward(ids[:, :32])
    start = time.perf_counter()
    backbone.forward(ids)
    return rows * length / (time.perf_counter() - start)


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
