"""What fitting the baselines on a token subsample costs and changes: temperature scaling, histogram binning and
isotonic regression fitted on the evidence run's 30k-token subsample vs. on every training token, against the time of
one full-vocabulary pass over the same tokens; held-out token ECE of each fit.

    ATS_DATA_DIR=../shared/data python benchmarks/fit_subsample.py --features runs/evidence/features   # after evidence.py

Writes benchmarks/results/fit_subsample.md and .json.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent / "results"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--features", default="runs/evidence/features", help="the evidence run's feature folder")
    p.add_argument("--out", default="runs/fit_subsample")
    p.add_argument("--subsample", type=int, default=30000)
    p.add_argument("--methods", default="temperature,histogram,isotonic")
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    from ats.evaluation.metrics import summarize
    from ats.evaluation.report import markdown_table
    from ats.io import write_json
    from ats.model.backbone import load_backbone
    from ats.training.features import FeatureStore
    from ats.workflows.pipeline import fit_calibrators

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from paper_table import machine

    from ats.evaluation.token_eval import token_confidences

    backbone = load_backbone("smollm2-135m-instruct")
    train, val = FeatureStore(Path(args.features) / "train"), FeatureStore(Path(args.features) / "val")
    names = tuple(args.methods.split(","))
    rows, record = [], {"command": "python benchmarks/fit_subsample.py " + " ".join(sys.argv[1:]),
                        "machine": machine(), "train_response_tokens": train.meta["response_tokens"], "fits": {}}
    for fit_tokens in (args.subsample, None):
        label = str(fit_tokens) if fit_tokens else f"all ({train.meta['response_tokens']})"
        chunks = train.logit_chunks(backbone.logits, max_tokens=fit_tokens)
        start = time.perf_counter()
        for logits, _ in chunks():
            logits.max(dim=-1)
        one_pass = time.perf_counter() - start
        fitted, seconds = {}, {}
        for name in names:
            start = time.perf_counter()
            fitted.update(fit_calibrators(backbone, train, Path(args.out) / label.split()[0], (name,),
                                          fit_tokens=fit_tokens, progress=False))
            seconds[name] = time.perf_counter() - start
        conf = token_confidences(val, backbone, fitted, progress=False)
        for name in names:
            ece = summarize(*conf[name])["ece"]
            value = fitted[name].config().get("temperature")
            record["fits"][f"{name}@{label}"] = {"seconds": seconds[name], "one_pass_seconds": one_pass,
                                                "held_out_ece": ece, "temperature": value}
            rows.append([name, label, f"{seconds[name]:.1f}", f"{seconds[name] / one_pass:.1f}",
                         "-" if value is None else f"{value:.4f}", f"{ece:.4f}"])
    table = markdown_table(["method", "fit tokens", "fit s", "fit / one full-vocab pass", "temperature",
                            "held-out token ECE"], rows)
    print(table)
    RESULTS.mkdir(parents=True, exist_ok=True)
    write_json(RESULTS / "fit_subsample.json", record)
    (RESULTS / "fit_subsample.md").write_text(
        f"# Baselines on a token subsample vs. on every training token\n\nCommand: `{record['command']}`\n"
        f"Machine: {record['machine']}. Training tokens: {record['train_response_tokens']}.\n\n{table}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
