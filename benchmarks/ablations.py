"""ATS ablations on the embedded SmolLM2-135M-Instruct: smoothing type, smoothing weight alpha, head architecture.

One feature cache (Alpaca-GPT4), nine trained heads (the selective / alpha 0.5 / transformer configuration is shared
by the three ablations and trained once), evaluated on MMLU, TriviaQA, TruthfulQA MC1 and token by token on the
held-out instruction split. Tables go to OUT/<ablation>.md, every number to OUT/ablations.json, the ECE-vs-alpha
figure to OUT/ece_vs_alpha.png/.pdf. Heads, features and finished task files are reused on a rerun.

    python benchmarks/ablations.py                                   # the default size (hours on 2 CPU cores)
    python benchmarks/ablations.py --limit 40 --max-length 128 --epochs 1 --mmlu-subjects anatomy \\
        --mmlu-limit 2 --mmlu-shots 1 --triviaqa-limit 10 --truthfulqa-limit 10 --out /tmp/abl   # a smoke run

--alignment instead measures the calibration of the pre-trained base model Gemma 3 270M (vocabulary 262k) beside
the aligned SmolLM2-135M-Instruct on the same tasks, before and after ATS (transformer head, selective, alpha 0.5):
OUT/alignment/alignment.md and alignment.json.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def parse_args(argv=None) -> argparse.Namespace:
    from ats.training.config import TrainingConfig
    from ats.training.data import DataConfig

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "ablations"))
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--device", default=None, help="cpu, cuda, ... (default: cuda if available)")
    # the data and training options, with their defaults, come from the configs (one source for CLI and scripts)
    DataConfig.add_arguments(p, defaults={"limit": 1000})
    TrainingConfig.add_arguments(p, exclude=("loss_type", "alpha", "save_every"))
    p.add_argument("--ablations", default="smoothing,alpha,head")
    p.add_argument("--tasks", default="mmlu,triviaqa,truthfulqa_mc1")
    p.add_argument("--mmlu-limit", type=int, default=10, help="MMLU questions per subject")
    p.add_argument("--mmlu-subjects", default=None, help="comma-separated MMLU subjects (default: all 57)")
    p.add_argument("--mmlu-shots", type=int, default=5)
    p.add_argument("--triviaqa-limit", type=int, default=500)
    p.add_argument("--truthfulqa-limit", type=int, default=817)
    p.add_argument("--mc-limit", type=int, default=None, help="questions per mc:PATH task")
    p.add_argument("--alignment", action="store_true",
                   help="compare the base Gemma 3 270M with SmolLM2-135M-Instruct (uncalibrated and ATS)")
    p.add_argument("--alignment-models", default="smollm2-135m-instruct,gemma3-270m")
    p.add_argument("--quiet", action="store_true")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    shared = REPO.parent / "shared" / "data"
    if not os.environ.get("ATS_DATA_DIR") and shared.is_dir():
        os.environ["ATS_DATA_DIR"] = str(shared)  # offline: read the local copies
    import torch
    from protocols.alignment import run_alignment  # this script's folder, first on sys.path

    from ats.model.backbone import load_backbone
    from ats.training.config import TrainingConfig
    from ats.training.data import DataConfig
    from ats.workflows.ablate import run_ablations
    from ats.workflows.pipeline import prepare_features

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    out = Path(args.out)
    progress = not args.quiet
    data = DataConfig.from_args(args, seed=args.seed)
    training = TrainingConfig.from_args(args)
    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    task_limit = {"mmlu": args.mmlu_limit, "triviaqa": args.triviaqa_limit, "truthfulqa_mc1": args.truthfulqa_limit,
                  "mc": args.mc_limit}
    mmlu_options = {"n_shots": args.mmlu_shots}
    if args.mmlu_subjects:
        mmlu_options["subjects"] = [s.strip() for s in args.mmlu_subjects.split(",") if s.strip()]
    start = time.time()

    if args.alignment:
        models = [m.strip() for m in args.alignment_models.split(",") if m.strip()]
        summary = run_alignment(models, out / "alignment", tasks=tasks, task_limit=task_limit,
                                data=data, training=training, device=device, seed=args.seed,
                                progress=progress, task_options={"mmlu": mmlu_options})
        print("\n" + summary["table"])
        print(f"\n{out / 'alignment' / 'alignment.md'}; total {(time.time() - start) / 60:.1f} min")
        return 0

    backbone = load_backbone(args.model, device=device)
    train_store, val_store = prepare_features(backbone, out / "features", data, progress=progress)
    print(f"[ablations] {args.model}: {len(train_store)} train / {len(val_store)} val sequences, "
          f"{train_store.meta['response_tokens']} training response tokens")
    summary = run_ablations(backbone, train_store, val_store, out, tasks=tasks, task_limit=task_limit,
                            ablations=args.ablations, training=training, seed=args.seed,
                            progress=progress, task_options={"mmlu": mmlu_options})
    for ablation, table in summary["tables"].items():
        print(f"\n## Ablation: {ablation}\n\n{table}")
    print(f"\nnumbers: {out / 'ablations.json'}; figure: {out / 'ece_vs_alpha.png'}; "
          f"total {(time.time() - start) / 60:.1f} min")
    return 0


if __name__ == "__main__":
    sys.exit(main())
