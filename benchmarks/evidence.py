"""Issue 12's evidence: per-token ATS against the global control, the shallow control and every baseline, with model
selection on held-out instruction data only, paired bootstrap differences, token-level calibration and the
token-vs-task trade-off of the training objectives. On the embedded SmolLM2-135M-Instruct.

    ATS_DATA_DIR=../shared/data python benchmarks/evidence.py --out runs/evidence      # hours on 2 CPU cores
    ATS_DATA_DIR=../shared/data python benchmarks/evidence.py --smoke --out /tmp/ev    # minutes: the pipeline only

Writes benchmarks/results/evidence/ (results.md, results.json, figures/). The work folder (--out) keeps features,
heads, baselines and per-task results; a rerun with the same options reuses them, with other options refuses them.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent / "results" / "evidence"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="runs/evidence")
    p.add_argument("--results", default=str(RESULTS))
    p.add_argument("--data", default="alpaca_gpt4")
    p.add_argument("--limit", type=int, default=None, help="instruction examples (default: all)")
    p.add_argument("--max-length", type=int, default=1024)
    p.add_argument("--pack", type=int, default=2048)
    p.add_argument("--lr-grid", default="3e-4,1e-3,3e-3")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=2)
    p.add_argument("--micro-batch-size", type=int, default=1)
    p.add_argument("--fit-tokens", type=int, default=30000)
    p.add_argument("--mmlu", type=int, default=20, help="MMLU test questions per subject")
    p.add_argument("--mmlu-subjects", default=None, help="comma-separated MMLU subjects (default: all 57)")
    p.add_argument("--triviaqa", type=int, default=1000)
    p.add_argument("--truthfulqa", type=int, default=None, help="TruthfulQA MC1 questions (default: all 817)")
    p.add_argument("--truthfulqa-gen", type=int, default=400,
                   help="TruthfulQA free-form questions (0: leave the task out)")
    p.add_argument("--tradeoff", default="selective-a0.1,selective-a0.3,selective-a0.7,selective-a0.9,nll",
                   help="trade-off heads trained at the lr chosen for ats (TRADEOFF of protocols/evidence.py)")
    p.add_argument("--bootstrap", type=int, default=1000)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--smoke", action="store_true", help="tiny sizes: checks the pipeline, not the method")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.smoke:
        args.limit, args.max_length, args.pack, args.lr_grid, args.epochs = 40, 256, 512, "1e-3,3e-3", 1
        args.mmlu, args.triviaqa, args.truthfulqa, args.bootstrap, args.fit_tokens = 1, 20, 20, 50, 3000
        args.truthfulqa_gen = 10
        args.mmlu_subjects = "anatomy,astronomy,marketing"
    from paper_table import machine  # this script's folder, first on sys.path
    from protocols.evidence import CRITERION, EvidencePlan, run_evidence, selection_table

    from ats.evaluation.evaluate import format_paired
    from ats.evaluation.report import task_tables, token_table
    from ats.io import atomic_file, write_json
    from ats.model.backbone import load_backbone
    from ats.training.config import TrainingConfig
    from ats.training.data import DataConfig

    extra = ("truthfulqa_gen",) if args.truthfulqa_gen else ()
    plan = EvidencePlan(
        data=DataConfig(source=args.data, limit=args.limit, max_length=args.max_length, pack=args.pack),
        training=TrainingConfig(epochs=args.epochs, batch_size=args.batch_size, micro_batch_size=args.micro_batch_size),
        lr_grid=tuple(float(x) for x in args.lr_grid.split(",")), fit_tokens=args.fit_tokens,
        tradeoff=tuple(t for t in args.tradeoff.split(",") if t),
        tasks=("mmlu", "triviaqa", "truthfulqa_mc1", *extra),
        task_limit={"mmlu": args.mmlu, "triviaqa": args.triviaqa, "truthfulqa_mc1": args.truthfulqa,
                    "truthfulqa_gen": args.truthfulqa_gen or None},
        mmlu_subjects=args.mmlu_subjects.split(",") if args.mmlu_subjects else None, bootstrap=args.bootstrap)
    start = time.time()
    backbone = load_backbone("smollm2-135m-instruct")
    result = run_evidence(backbone, args.out, plan)
    minutes = (time.time() - start) / 60
    results = Path(args.results)
    (results / "figures").mkdir(parents=True, exist_ok=True)
    for figure in [*(Path(args.out) / "eval" / "figures").glob("*"), *Path(args.out).glob("tradeoff.*")]:
        shutil.copy2(figure, results / "figures" / figure.name)
    command = "ATS_DATA_DIR=../shared/data python " + " ".join([os.path.relpath(sys.argv[0])] + sys.argv[1:])
    sections = [
        ("Model selection (declared before any task was run)",
         f"Criterion: {CRITERION}.\n\n{selection_table(result['selection'])}"),
        ("Token-level calibration on the held-out instruction split", token_table(result["token_level"])),
        ("Tasks (95% bootstrap intervals)", task_tables(result["tasks"])),
        ("Paired differences on the same questions", format_paired(result["tasks"])),
    ]
    text = "\n".join([
        "# Evidence: per-token ATS vs. the global control, the shallow control and the baselines",
        "",
        f"Command: `{command}`",
        f"Machine: {machine()}. Wall time: {minutes:.0f} min.",
        f"Data: {json.dumps(plan.data.to_dict())}; {result['train_sequences']} training sequences, "
        f"{result['train_response_tokens']} training response tokens, {result['val_response_tokens']} held-out.",
        f"Training (every head): {json.dumps(plan.training.to_dict())}, lr from the grid {list(plan.lr_grid)}.",
        f"Tasks: {json.dumps(plan.task_limit)} (MMLU: per subject, test split); bootstrap {plan.bootstrap}.",
        f"Baselines fit on a fixed subset of {plan.fit_tokens} training tokens; fit seconds "
        f"{json.dumps(result['fit_seconds'])}.",
        "",
        *(line for title, body in sections for line in (f"## {title}", "", body, "")),
        "Figures: `figures/<task>.png|pdf` (reliability diagrams), `figures/tradeoff.png|pdf` (held-out token ECE vs "
        "task ECE, one point per objective / alpha).",
    ])
    with atomic_file(results / "results.md") as f:
        f.write(text + "\n")
    write_json(results / "results.json", {"command": command, "machine": machine(), "minutes": minutes, **result})
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
