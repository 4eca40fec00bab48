"""Heads trained on the backbone's own answers (issue 21): run the protocol of `protocols/answers.py` and write
benchmarks/results/answers/<model>/ (results.json, results.md, figures).

    ATS_DATA_DIR=../shared/data python benchmarks/answers.py --model smollm2-135m-instruct --out runs/answers-smollm2

Every stage is saved as it ends and reused on a rerun with the same plan (resumable); `--render-only` rewrites the
markdown and figures from results.json.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from paper_table import machine  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--out", required=True)
    parser.add_argument("--pool-size", type=int, default=200)
    parser.add_argument("--mmlu-pool", type=int, default=2, help="MMLU validation questions per subject")
    parser.add_argument("--mmlu", type=int, default=3, help="reported MMLU test questions per subject")
    parser.add_argument("--triviaqa", type=int, default=300)
    parser.add_argument("--truthfulqa-mc1", type=int, default=300)
    parser.add_argument("--truthfulqa-gen", type=int, default=200)
    parser.add_argument("--lr-grid", default="3e-4,1e-3,3e-3")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--stages", default="select,loo,reported,tokens")
    parser.add_argument("--instruction-head", action="append", default=[], metavar="NAME=DIR",
                        help="a head trained elsewhere (e.g. the paper's ATS on instruction data), scored too")
    parser.add_argument("--token-features", default=None,
                        help="instruction features (train/ val/): train/ feeds the '+tokens' methods' token term, "
                        "val/ scores every head per token")
    parser.add_argument("--methods", default=None, metavar="NAME=SPEC,...",
                        help="the methods trained on answers (default: AnswerPlan's; SPEC: transformer, linear, mlp, "
                        "constant, thermometer, optionally +tokens)")
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--results", default=None, help="where the committed results go (default "
                        "benchmarks/results/answers/<model>)")
    parser.add_argument("--render-only", action="store_true")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="[%(asctime)s] %(message)s", datefmt="%H:%M:%S")
    logging.getLogger("fontTools").setLevel(logging.WARNING)  # its font subsetting logs every glyph at INFO

    import torch
    from protocols.answers import AnswerPlan, run_answers  # this script's folder, first on sys.path
    from protocols.answers_report import render

    from ats.calibrators import load_calibrator
    from ats.model.backbone import load_backbone

    if args.threads:
        torch.set_num_threads(args.threads)
    results_dir = Path(args.results or f"benchmarks/results/answers/{args.model}")
    out = Path(args.out)
    if not args.render_only:
        plan = AnswerPlan(pool_size=args.pool_size, mmlu_pool_per_subject=args.mmlu_pool,
                          reported={"mmlu": args.mmlu, "triviaqa": args.triviaqa,
                                    "truthfulqa_mc1": args.truthfulqa_mc1, "truthfulqa_gen": args.truthfulqa_gen},
                          lr_grid=tuple(float(x) for x in args.lr_grid.split(",")), epochs=args.epochs,
                          seeds=tuple(int(x) for x in args.seeds.split(",")),
                          **({"methods": dict(m.split("=", 1) for m in args.methods.split(","))} if args.methods
                             else {}))
        backbone = load_backbone(args.model)
        heads = {}
        for spec in args.instruction_head:
            name, _, folder = spec.partition("=")
            heads[name] = load_calibrator(folder, backbone)
        start = time.perf_counter()
        results = run_answers(backbone, out, plan, instruction_heads=heads, token_features=args.token_features,
                              stages=tuple(args.stages.split(",")))
        results["command"] = "python " + " ".join(sys.argv)
        results["machine"] = machine()
        results["minutes_last_invocation"] = round((time.perf_counter() - start) / 60, 1)
        (out / "results.json").write_text(json.dumps(results, indent=1))
    render(out / "results.json", results_dir)


if __name__ == "__main__":
    main()
