"""How the evidence moves with training data: ATS, the top-label head and the global control trained on Alpaca-
cleaned subsets of growing size, at the learning rates the main evidence run selected on held-out data.

    ATS_DATA_DIR=../shared/data python benchmarks/data_scaling.py --out runs/scaling   # after benchmarks/evidence.py

Reads the chosen learning rates from benchmarks/results/evidence/results.json; writes
benchmarks/results/evidence/scaling.md and scaling.json.
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


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="runs/scaling")
    p.add_argument("--sizes", default="alpaca_cleaned:2000,alpaca_cleaned:5000,alpaca_cleaned:10000")
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--mmlu", type=int, default=10)
    p.add_argument("--triviaqa", type=int, default=500)
    p.add_argument("--bootstrap", type=int, default=1000)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--evidence", default=str(RESULTS / "results.json"))
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    from ats.evaluation.report import TASK_LABELS, cell, markdown_table
    from ats.io import atomic_file, write_json
    from ats.model.backbone import load_backbone
    from ats.training.config import TrainingConfig
    from ats.workflows.evidence import ScalingPlan, run_scaling

    evidence = json.loads(Path(args.evidence).read_text())
    lrs = {name: record["chosen_lr"] for name, record in evidence["selection"].items()}
    sizes = tuple((s.split(":")[0], int(s.split(":")[1])) for s in args.sizes.split(","))
    plan = ScalingPlan(sizes=sizes, lrs=lrs, training=TrainingConfig(epochs=args.epochs, batch_size=2,
                                                                    micro_batch_size=1),
                       task_limit={"mmlu": args.mmlu, "triviaqa": args.triviaqa, "truthfulqa_mc1": None},
                       bootstrap=args.bootstrap)
    start = time.time()
    results = run_scaling(load_backbone("smollm2-135m-instruct"), args.out, plan)
    minutes = (time.time() - start) / 60
    rows = []
    for size, r in results.items():
        for method in ("uncalibrated", *plan.methods):
            row = [size, str(r["train_response_tokens"]), method, cell(r["token_level"][method], "ece", ci=False)]
            for task in plan.tasks:
                summary = r["tasks"][task][method]
                pair = summary.get("paired", {}).get("ats", {}).get("ece")
                row += [cell(summary, "ece"), "-" if pair is None else
                        f"{pair['diff']:+.3f} [{pair['ci'][0]:+.3f}, {pair['ci'][1]:+.3f}]"
                        + (" *" if pair["excludes_zero"] else "")]
            rows.append(row)
    header = ["data", "train tokens", "method", "val token ECE"]
    for task in plan.tasks:
        header += [f"{TASK_LABELS.get(task, task)} ECE", "ats - method"]
    command = "ATS_DATA_DIR=../shared/data python " + " ".join([os.path.relpath(sys.argv[0])] + sys.argv[1:])
    text = "\n".join([
        "# Evidence vs. training data size", "", f"Command: `{command}` ({minutes:.0f} min).",
        f"Learning rates (selected on held-out data by the main run): {json.dumps(lrs)}.", "",
        markdown_table(header, rows, text_columns=3), "",
        "`ats - method`: ECE difference with a paired bootstrap 95% interval (* = excludes 0).",
    ])
    RESULTS.mkdir(parents=True, exist_ok=True)
    with atomic_file(RESULTS / "scaling.md") as f:
        f.write(text + "\n")
    write_json(RESULTS / "scaling.json", {"command": command, "minutes": minutes, "results": results})
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
