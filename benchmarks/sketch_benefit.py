"""Does the `LogitSketch` still earn its place (issue 31, part 4)? On features that carry the scale summary (what
`ats train` / `ats demo` always extract), the three methods that still read the sketch there (scaling-binning,
histogram binning, isotonic regression: temperature scaling and Thermometer fit on the summary first) are fitted from
three views of the same fitting tokens, and their top-1 confidences, fits and costs compared:

- sketch: one full-vocabulary pass builds the `LogitSketch`; its exact top-1 statistics at s = 1, its approximate
  confidence at s = 1 / T;
- summary: the summary rows the features already hold (no pass): log p_top = -G(s) from the summary's quintic,
  correctness from its header;
- exact: one full-vocabulary pass per method (`collect_top1`), the reference.

Each fitted map is compared with the exact route's on the exact confidences of the fitting tokens: the mean absolute
difference, and the share of tokens mapped more than 1e-3 apart (a confidence a hair from a bin edge can fall in the
next bin, so the largest difference is a bin's step whatever the view).

    PYTHONPATH=src ATS_DATA_DIR=../shared/data python benchmarks/sketch_benefit.py --limit 60 --threads 2

Writes benchmarks/results/sketch_benefit.md and .json.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

RESULTS = Path(__file__).resolve().parent / "results"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--limit", type=int, default=60, help="Alpaca-GPT4 examples (train + val)")
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)

    from ats.calibrators import build_calibrator
    from ats.calibrators._fitting import collect_top1
    from ats.calibrators.sketch import LogitSketch
    from ats.model.backbone import load_backbone
    from ats.model.scale_summary import SummaryView, scaled_ce_from_summary
    from ats.training.data import DataConfig
    from ats.workflows.pipeline import prepare_features

    backbone = load_backbone("smollm2-135m-instruct")
    with tempfile.TemporaryDirectory() as tmp:
        train, _ = prepare_features(backbone, Path(tmp) / "features", DataConfig(limit=args.limit), progress=False)
        chunks = train.logit_chunks(backbone.logits)
        rows = train.response_summary()
        temperature = build_calibrator("temperature").fit(chunks).temperature  # the exact T, the same for all

        start = time.perf_counter()
        exact = {"conf": collect_top1(chunks)}
        exact["scaled"] = collect_top1(chunks, transform=lambda z: z / temperature)
        seconds = {"exact (2 passes)": time.perf_counter() - start}

        start = time.perf_counter()
        sketch = LogitSketch.from_chunks(chunks)
        s_conf, s_correct = sketch.confidence.numpy(), sketch.correct.numpy()
        s_scaled = sketch.top1_confidence(1 / temperature).numpy()
        seconds["sketch (1 pass)"] = time.perf_counter() - start

        start = time.perf_counter()
        r = rows.double()
        view = SummaryView(r)
        # clipped to [0, 1] as the summary route of the fits clips them (`_fitting.source_top1`)
        m_conf = scaled_ce_from_summary(r, torch.ones(len(r), dtype=torch.float64)).log_p_top.exp().clamp(0, 1).numpy()
        m_scaled = scaled_ce_from_summary(r, torch.full((len(r),), 1 / temperature, dtype=torch.float64)) \
            .log_p_top.exp().clamp(0, 1).numpy()
        m_correct = view.correct.double().numpy()
        seconds["summary (no pass)"] = time.perf_counter() - start

    e_conf, e_correct = exact["conf"]
    e_scaled = exact["scaled"][0]
    views = {"sketch": (s_conf, s_correct, s_scaled), "summary": (m_conf, m_correct, m_scaled)}

    def fits(conf, correct, scaled) -> dict[str, np.ndarray]:
        """Each method fitted on this view, as its map applied to the exact confidences (isotonic regression's
        thresholds move with ties, so the maps are compared, not the tensors)."""
        maps = {"histogram": build_calibrator("histogram").fit_top1(conf, correct),
                "isotonic": build_calibrator("isotonic").fit_top1(conf, correct),
                "scaling-binning": build_calibrator("scaling-binning").fit_top1(scaled, scaled)}
        return {name: cal.calibrate_confidence(e_scaled if name == "scaling-binning" else e_conf)
                for name, cal in maps.items()}

    reference = fits(e_conf, e_correct, e_scaled)
    record = {"command": "python benchmarks/sketch_benefit.py " + " ".join(sys.argv[1:]), "tokens": len(e_conf),
              "vocabulary": backbone.vocab_size, "temperature": temperature, "seconds": seconds, "views": {}}
    for name, (conf, correct, scaled) in views.items():
        fitted = fits(conf, correct, scaled)
        record["views"][name] = {
            "max |conf - exact| at s=1": float(np.abs(conf - e_conf).max()),
            "max |conf - exact| at s=1/T": float(np.abs(scaled - e_scaled).max()),
            "correctness differs": int((correct != e_correct).sum()),
            **{f"{method}: mean |map - exact map|": float(np.abs(fitted[method] - reference[method]).mean())
               for method in reference},
            **{f"{method}: tokens mapped > 1e-3 apart": float(np.mean(np.abs(fitted[method] - reference[method])
                                                                       > 1e-3)) for method in reference}}
    lines = ["# The LogitSketch against the scale summary (issue 31, part 4)", "",
             f"Command: `{record['command']}` (SmolLM2-135M-Instruct, V = {record['vocabulary']}, "
             f"{record['tokens']} fitting tokens, T = {temperature:.4f} fitted exactly).", "",
             "| view | seconds | " + " | ".join(next(iter(record["views"].values()))) + " |",
             "|---|---:|" + "---:|" * len(next(iter(record["views"].values())))]
    for name, values in record["views"].items():
        key = next(k for k in seconds if k.startswith(name))
        lines.append(f"| {name} | {seconds[key]:.2f} | " + " | ".join(f"{v:.3g}" for v in values.values()) + " |")
    lines += ["", f"Exact reference (two full-vocabulary passes): {seconds['exact (2 passes)']:.2f} s."]
    text = "\n".join(lines)
    print(text)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "sketch_benefit.json").write_text(json.dumps(record, indent=2))
    (RESULTS / "sketch_benefit.md").write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
