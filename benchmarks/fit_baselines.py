"""What fitting all six baselines costs, in full-vocabulary passes over the training tokens, by the shared-pass route
(temperature, scaling-binning, histogram, isotonic and Thermometer fit from the features' scale summary, no pass;
the fitting logits stay in memory for vector scaling's epochs) against the reference route (every method passes over the logits
itself), on the evidence run's features and token subsample, and how much the fitted calibrators differ.

    python benchmarks/fit_baselines.py --features runs/evidence/features --threads 1   # after evidence.py
    python benchmarks/fit_baselines.py --features runs/fit_baselines/features --limit 600 --threads 1  # standalone

Writes benchmarks/results/fit_baselines.md and .json.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent / "results"
ROUTES = {"shared pass": True, "reference": False}


def route_difference(name: str, shared, reference) -> str:
    """How far the shared route's fit is from the reference route's: |dT|, or the largest difference of a saved
    tensor (bins, thresholds, vector scaling's a and b, Thermometer's weights)."""
    if "temperature" in shared.config():
        return f"T {shared.config()['temperature']:.5f} vs {reference.config()['temperature']:.5f}"
    try:
        a, b = shared.state_tensors(), reference.state_tensors()
    except Exception:  # noqa: BLE001 - a method without tensors
        return "-"
    if a.keys() != b.keys() or any(a[k].shape != b[k].shape for k in a):
        return "different shapes"
    return f"max abs diff {max(float((a[k].double() - b[k].double()).abs().max()) for k in a):.2g}"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--features", default="runs/evidence/features", help="the evidence run's feature folder")
    p.add_argument("--out", default="runs/fit_baselines")
    p.add_argument("--limit", type=int, default=None,
                   help="make (or reuse) --features from this many Alpaca-GPT4 examples (the library's defaults "
                        "otherwise) instead of reading the evidence run's")
    p.add_argument("--fit-tokens", type=int, default=30000, help="the evidence run's token subsample")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--render-only", action="store_true",
                   help="no timing: evaluate the fits saved under --out on the held-out features again and rewrite "
                        "the .md from the .json")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    from paper_table import machine  # this script's folder, first on sys.path

    from ats.calibrators import load_calibrator
    from ats.evaluation.metrics import paired_differences, summarize
    from ats.evaluation.report import markdown_table
    from ats.evaluation.token_eval import token_confidences
    from ats.io import read_json, write_json
    from ats.model.backbone import load_backbone
    from ats.training.data import DataConfig
    from ats.training.features import FeatureStore
    from ats.workflows.pipeline import BASELINES, fit_calibrators, prepare_features

    backbone = load_backbone("smollm2-135m-instruct")
    if not args.render_only:
        if args.limit is not None:  # fingerprinted: reused when made with these options, resumed when partial
            train, val = prepare_features(backbone, args.features, DataConfig(limit=args.limit), progress=True)
        else:
            train, val = FeatureStore(Path(args.features) / "train"), FeatureStore(Path(args.features) / "val")
        start = time.perf_counter()
        for logits, _ in train.logit_chunks(backbone.logits)():  # one full-vocabulary pass over every training token
            logits.max(dim=-1)
        one_pass = time.perf_counter() - start
        fitted, seconds = {}, {}
        for route, shared in ROUTES.items():
            out = Path(args.out) / route.replace(" ", "-")
            start = time.perf_counter()
            fitted[route] = fit_calibrators(backbone, train, out, BASELINES, fit_tokens=args.fit_tokens,
                                            shared_pass=shared, overwrite=True, progress=False)
            seconds[route] = {"total": time.perf_counter() - start,
                              **{n: read_json(out / n / "fit_seconds.json")["seconds"] for n in BASELINES}}
        write_json(RESULTS / "fit_baselines.json", {
            "command": "python benchmarks/fit_baselines.py " + " ".join(sys.argv[1:]), "machine": machine(),
            "features": str(args.features),
            "one_pass_seconds": one_pass, "seconds": seconds, "fit_tokens": args.fit_tokens,
            "train_response_tokens": train.meta["response_tokens"],
            "held_out_tokens": val.meta["response_tokens"]})
    record = read_json(RESULTS / "fit_baselines.json")
    one_pass, seconds = record["one_pass_seconds"], record["seconds"]
    fitted = {route: {name: load_calibrator(Path(args.out) / route.replace(" ", "-") / name) for name in BASELINES}
              for route in ROUTES}
    # held-out ECE of every fit, and shared minus reference on the same tokens with a paired bootstrap interval, on
    # the held-out features of the measured run (whatever --features says now)
    record.setdefault("features", str(args.features))
    val = FeatureStore(Path(record["features"]) / "val")
    calibrators = {f"{name}@{route}": fitted[route][name] for route in ROUTES for name in BASELINES}
    conf = token_confidences(val, backbone, calibrators, progress=False)
    ece = {key: summarize(*value)["ece"] for key, value in conf.items()}
    paired = {name: paired_differences(conf[f"{name}@shared pass"], conf[f"{name}@reference"], bootstrap=1000,
                                       keys=("ece",))["ece"] for name in BASELINES}
    record.update(held_out_ece=ece, paired_ece=paired)
    write_json(RESULTS / "fit_baselines.json", record)

    rows = []
    for name in (*BASELINES, "total"):
        row = [name]
        for route in ROUTES:
            row += [f"{seconds[route][name]:.1f}", f"{seconds[route][name] / one_pass:.2f}"]
        if name == "total":
            rows.append(row + ["", "", "", ""])
            continue
        row += [route_difference(name, fitted["shared pass"][name], fitted["reference"][name])]
        row += [f"{ece[f'{name}@{route}']:.4f}" for route in ROUTES]
        d = paired[name]
        row += [f"{d['diff']:+.4f} [{d['ci'][0]:+.4f}, {d['ci'][1]:+.4f}]"]
        rows.append(row)
    header = ["method"]
    for route in ROUTES:
        header += [f"{route} s", f"{route} / pass"]
    header += ["shared vs reference fit"] + [f"{route} held-out ECE" for route in ROUTES]
    header += ["ECE shared - reference [95% paired CI]"]
    table = markdown_table(header, rows)
    command = record["command"]
    speedup = seconds["reference"]["total"] / seconds["shared pass"]["total"]
    text = "\n".join([
        "# Fitting the six baselines: shared pass vs. reference route", "",
        f"Command: `{command}`", f"Machine: {record['machine']}.",
        f"Training tokens: {record['train_response_tokens']} (one full-vocabulary pass over them: {one_pass:.1f} s, "
        f"measured in this run); fit on a seeded subsample of {record['fit_tokens']}; held-out ECE "
        f"on {record['held_out_tokens']} held-out instruction tokens.", "",
        table, "",
        f"`/ pass`: seconds over the time of one full-vocabulary pass over all training tokens. All six baselines: "
        f"{seconds['shared pass']['total'] / one_pass:.2f} passes by the shared route, "
        f"{seconds['reference']['total'] / one_pass:.2f} by the reference route ({speedup:.1f}x faster). The "
        "shared route reads the features' scale summary (no pass) for every method but vector scaling, which replays "
        "the logits kept in memory (identical values, so an identical fit). Temperature, scaling-binning, histogram "
        "binning and isotonic regression differ only by the summary's approximation of logsumexp(s z) and of the top-1 "
        "confidence. Thermometer differs by design: by the shared route it "
        "averages each sequence's loss over that sequence's tokens in the fitting subsample, by the reference route "
        "over all of its tokens (so it also fits on more data there). The last column: held-out ECE of the shared route's "
        "fit minus the reference route's on the same tokens, with a paired bootstrap interval (1,000 resamples of "
        "the held-out tokens). Times come from one run with 1 torch thread "
        "beside another job on the 2 cores; the ratios compare fits and passes of the same run.",
    ])
    print(text)
    (RESULTS / "fit_baselines.md").write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
