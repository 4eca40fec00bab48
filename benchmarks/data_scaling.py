"""How the evidence moves with training data: ATS, the top-label head and the global control trained on Alpaca-
cleaned subsets of growing size, at the learning rates and training options the main evidence run selected on
held-out data, all evaluated in one shared pass over the same task questions as the main run.

    ATS_DATA_DIR=../shared/data python benchmarks/data_scaling.py --out runs/scaling   # after benchmarks/evidence.py

Reads the chosen learning rates and the training / packing options from benchmarks/results/evidence/results.json;
writes benchmarks/results/evidence/scaling.md and scaling.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent / "results" / "evidence"


def pair_cell(summary: dict, reference: str) -> str:
    """`reference - this method` ECE with its paired interval, or "-" when there is none."""
    pair = summary.get("paired", {}).get(reference, {}).get("ece")
    if pair is None:
        return "-"
    return (f"{pair['diff']:+.3f} [{pair['ci'][0]:+.3f}, {pair['ci'][1]:+.3f}]"
            + (" *" if pair["excludes_zero"] else ""))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="runs/scaling")
    p.add_argument("--sizes", default="alpaca_cleaned:2000,alpaca_cleaned:5000",
                   help="comma-separated source:examples")
    p.add_argument("--methods", default="ats,selective-temperature",
                   help="comma-separated methods of the main run's selection (ats, ats-top-label, selective-temperature, "
                        "selective-linear)")
    p.add_argument("--bootstrap", type=int, default=1000)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--evidence", default=str(RESULTS / "results.json"),
                   help="the main run's results (learning rates, options, task sizes)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    from paper_table import machine  # this script's folder, first on sys.path
    from protocols.evidence import ScalingPlan, run_scaling, size_tag

    from ats.evaluation.report import TASK_LABELS, cell, markdown_table
    from ats.io import atomic_file, write_json
    from ats.model.backbone import load_backbone
    from ats.training.config import TrainingConfig
    from ats.training.data import DataConfig

    evidence = json.loads(Path(args.evidence).read_text())
    methods = tuple(args.methods.split(","))
    lrs = {name: evidence["selection"][name]["chosen_lr"] for name in methods}
    main_plan = evidence["plan"]
    sizes = tuple((s.split(":")[0], int(s.split(":")[1])) for s in args.sizes.split(","))
    tasks = tuple(t for t in ("mmlu", "triviaqa", "truthfulqa_gen") if t in evidence["tasks"])
    data = DataConfig(**{**main_plan["data"], "source": "alpaca_cleaned", "limit": None})
    plan = ScalingPlan(sizes=sizes, methods=methods, lrs=lrs, data=data,
                       training=TrainingConfig(**{**main_plan["training"], "lr": None}), tasks=tasks,
                       task_limit={t: main_plan["task_limit"][t] for t in tasks}, bootstrap=args.bootstrap,
                       seed=main_plan["seed"])
    start = time.time()
    results = run_scaling(load_backbone("smollm2-135m-instruct"), args.out, plan)
    minutes = (time.time() - start) / 60

    rows = []
    main_tag = "alpaca_gpt4-1000 (main run)"
    for method in ("uncalibrated", *methods):  # the main run's rows, on the same questions (not paired across runs)
        row = [main_tag, str(evidence["train_response_tokens"]), method,
               cell(evidence["token_level"][method], "ece", ci=False)]
        for task in tasks:
            summary = evidence["tasks"][task][method]
            row += [cell(summary, "ece"), cell(summary, "auroc", ci=False), pair_cell(summary, "ats")]
        rows.append(row)
    for source, limit in sizes:
        tag = size_tag(source, limit)
        size = results["sizes"][tag]
        for method in ("uncalibrated", *methods):
            name = method if method == "uncalibrated" else f"{method}@{tag}"
            row = [tag, str(size["train_response_tokens"]), method, cell(size["token_level"][method], "ece", ci=False)]
            for task in tasks:
                summary = results["tasks"][task][name]
                row += [cell(summary, "ece"), cell(summary, "auroc", ci=False), pair_cell(summary, f"ats@{tag}")]
            rows.append(row)
    header = ["data", "train tokens", "method", "val token ECE"]
    for task in tasks:
        label = TASK_LABELS.get(task, task)
        header += [f"{label} ECE", f"{label} AUROC", "ats - method"]
    command = "ATS_DATA_DIR=../shared/data python " + " ".join([os.path.relpath(sys.argv[0])] + sys.argv[1:])
    text = "\n".join([
        "# Evidence vs. training data size", "",
        f"Command: `{command}` ({minutes:.0f} min; {machine()}).", "",
        f"Learning rates (selected on held-out data by the main run, not re-tuned): {json.dumps(lrs)}; training "
        f"and packing options as the main run. Tasks and questions as the main run: {json.dumps(plan.task_limit)} "
        "(MMLU: per subject). Every size's heads ran in one pass over the same questions, so the paired "
        "differences within a size are on identical examples. The main run's rows are copied from results.json "
        "(same questions, other run).", "",
        markdown_table(header, rows, text_columns=3), "",
        "`ats - method`: ECE of the same size's ATS head minus this method, paired bootstrap 95% interval "
        "(* = excludes 0). Val token ECE: held-out split of that size's own training data.",
    ])
    RESULTS.mkdir(parents=True, exist_ok=True)
    with atomic_file(RESULTS / "scaling.md") as f:
        f.write(text + "\n")
    write_json(RESULTS / "scaling.json", {"command": command, "minutes": minutes, "lrs": lrs, **results})
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
