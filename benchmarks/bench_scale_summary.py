"""Issue 24: the scale summary against the exact full-vocabulary route, on real tokens of the embedded models.

Measures (a) the largest relative error of CE(q, y), CE(q, u), log p_top and their d/ds over s in [0.05, max_scale]
against a float64 reference without cancellation, (b) the time of one training step (transformer head forward, loss,
backward) from the summary and by the exact route, (c) feature extraction with and without the summary. Writes
benchmarks/results/scale_summary.md and .json.

    ATS_DATA_DIR=../shared/data OMP_NUM_THREADS=1 python benchmarks/bench_scale_summary.py
"""

from __future__ import annotations

import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

from ats.calibrators.ats import ATSCalibrator
from ats.evaluation.token_eval import token_validator
from ats.model.backbone import IGNORE_INDEX, load_backbone
from ats.model.scale_summary import ScaleSummarySpec, scaled_ce_from_summary, summarize_logits
from ats.training.config import TrainingConfig
from ats.training.data import DataConfig, load_instructions, tokenize_instructions
from ats.training.features import extract_features
from ats.training.losses import calibration_loss
from ats.workflows.pipeline import prepare_features, train_head

OUT = Path(__file__).parent / "results" / "scale_summary"
MODELS = ("smollm2-135m-instruct", "qwen2.5-coder-0.5b-instruct")
SCALES = [0.05 * (10.0 / 0.05) ** (i / 59) for i in range(60)]
SPEC = ScaleSummarySpec()


def reference(z: torch.Tensor, y: torch.Tensor, s: float) -> dict:
    """(value, d/ds, size of d/ds's terms) per quantity, float64, G = softplus(logsumexp(-s d)) (no cancellation)."""
    z = z.double()
    top = z.argmax(-1)
    z_top = z.max(-1).values
    d = (z_top[:, None] - z).scatter(1, top[:, None], float("inf"))
    lse = torch.logsumexp(-s * d, -1)
    G = torch.nn.functional.softplus(lse)
    dG = -(torch.softmax(-s * d, -1) * torch.where(torch.isinf(d), 0.0, d)).sum(-1) * torch.sigmoid(lse)
    gy, gu = z_top - z.gather(1, y[:, None])[:, 0], z_top - z.mean(-1)
    return {"ce_label": (G + s * gy, dG + gy, dG.abs() + gy.abs()),
            "ce_uniform": (G + s * gu, dG + gu, dG.abs() + gu.abs()), "log_p_top": (-G, -dG, dG.abs())}


def accuracy(z: torch.Tensor, y: torch.Tensor) -> dict:
    """Max relative errors of the values and of d/ds (relative to the size of its terms) over SCALES."""
    rows = summarize_logits(z, y, max_scale=SPEC.max_scale)
    worst = {}
    for s in SCALES:
        scale = torch.full((len(y),), s, dtype=torch.float64, requires_grad=True)
        out = scaled_ce_from_summary(rows, scale)
        for name, (value, grad, size) in reference(z, y, s).items():
            got = getattr(out, name)
            (g,) = torch.autograd.grad(got.sum(), scale, retain_graph=True)
            rv = ((got.detach() - value).abs() / value.abs()).max().item()
            rg = ((g - grad).abs() / size).max().item()
            old = worst.get(name, (0.0, 0.0))
            worst[name] = (max(old[0], rv), max(old[1], rg))
    return {name: {"value": v, "d_ds": g} for name, (v, g) in worst.items()}


def response_logits(backbone, examples, n_tokens: int):
    """Hidden states (n, H), logits (n, V) and labels (n,) of the first n_tokens response tokens."""
    hs, ys = [], []
    with torch.no_grad():
        for ex in examples:
            h, _ = backbone.forward(torch.tensor([ex.input_ids]))
            labels = torch.tensor(ex.labels)
            hs.append(h[0][labels != IGNORE_INDEX])
            ys.append(labels[labels != IGNORE_INDEX])
            if sum(len(y) for y in ys) >= n_tokens:
                break
    h, y = torch.cat(hs)[:n_tokens], torch.cat(ys)[:n_tokens]
    return h, backbone.logits(h).float(), y


def step_time(backbone, h: torch.Tensor, z: torch.Tensor, y: torch.Tensor, repeats: int = 3) -> dict:
    """Seconds per training step (transformer head forward + loss + backward) on the tokens as one sequence."""
    cal = ATSCalibrator.for_backbone(backbone, head_type="transformer")
    rows = summarize_logits(z, y, max_scale=SPEC.max_scale)
    times = {}
    for route, summary in (("exact", None), ("summary", rows)):
        best = math.inf
        for _ in range(repeats):
            t = time.perf_counter()
            tau = cal.temperature(h[None].float(), torch.ones(1, len(y), dtype=torch.long))[0]
            loss = calibration_loss(h.float(), cal.scale(tau.float()), y, backbone.logits, summary=summary)
            loss.loss.backward()
            best = min(best, time.perf_counter() - t)
        times[route] = best
    return times


def extraction_time(backbone, examples) -> dict:
    """Seconds to extract the examples' features without and with the summary (best of two)."""
    times = {}
    with tempfile.TemporaryDirectory() as tmp:
        for route, spec in (("without", None), ("with", SPEC)):
            best = math.inf
            for k in range(2):
                t = time.perf_counter()
                extract_features(backbone, examples, Path(tmp) / f"{route}{k}", progress=False, summary=spec)
                best = min(best, time.perf_counter() - t)
            times[route] = best
    return times


def training_runs(backbone, n_examples: int) -> dict:
    """The ATS transformer head and the global-temperature control trained from the summary and by the exact route
    on the same features: held-out token ECE / NLL, the control's temperature, training seconds."""
    training = TrainingConfig(epochs=2, lr=1e-3)
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        train, val = prepare_features(backbone, Path(tmp) / "f", DataConfig(limit=n_examples, max_length=256),
                                      progress=False)
        out["train_response_tokens"] = train.meta["response_tokens"]
        out["val_response_tokens"] = val.meta["response_tokens"]
        validate = token_validator(val, backbone)
        for route in ("summary", "exact"):
            config = training.replace(exact_loss=route == "exact")
            row = {}
            for method in ("ats", "selective-temperature"):
                t = time.perf_counter()
                cal = train_head(backbone, train, None, Path(tmp) / f"{method}-{route}", method=method,
                                 training=config, progress=False)
                row[method] = {"train_s": time.perf_counter() - t,
                               **{k: v for k, v in validate(cal).items() if k in ("ece", "nll", "mean_confidence")}}
            head = cal.head
            row["selective-temperature"]["temperature"] = math.exp(-head.gain * float(head.tau))
            out[route] = row
    return out


def main(n_examples: int = 8, n_tokens: int = 400, n_extract: int = 6, n_train: int = 60) -> None:
    results = {"settings": {**SPEC.describe(), "examples": n_examples, "tokens": n_tokens,
                            "extract_examples": n_extract, "train_examples": n_train, "scales": f"{len(SCALES)} log-spaced in [0.05, 10]",
                            "threads": torch.get_num_threads(), "cpus": os.cpu_count()}, "models": {}}
    for name in MODELS:
        backbone = load_backbone(name)
        examples = tokenize_instructions(backbone.tokenizer, load_instructions("alpaca_gpt4", limit=n_examples,
                                                                               seed=1), max_length=256)[0]
        h, z, y = response_logits(backbone, examples, n_tokens)
        row = {"vocab": backbone.vocab_size, "hidden": backbone.hidden_size, "tokens": len(y),
               "accuracy": accuracy(z, y), "step_s": step_time(backbone, h, z, y),
               "extract_s": extraction_time(backbone, examples[:n_extract])}
        row["step_speedup"] = row["step_s"]["exact"] / row["step_s"]["summary"]
        row["extract_slowdown"] = row["extract_s"]["with"] / row["extract_s"]["without"] - 1
        if name == MODELS[0]:
            row["training"] = training_runs(backbone, n_train)
        results["models"][name] = row
        print(name, json.dumps(row, indent=1), flush=True)
        del backbone
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.with_suffix(".json").write_text(json.dumps(results, indent=1))
    OUT.with_suffix(".md").write_text(render(results))
    print(render(results))


def render(results: dict) -> str:
    """The markdown report."""
    st = results["settings"]
    lines = ["# Scale summary vs the exact route (issue 24)", "",
             f"Command: `ATS_DATA_DIR=../shared/data OMP_NUM_THREADS=1 python benchmarks/bench_scale_summary.py`; "
             f"machine: {st['cpus']} CPU cores shared with another job, {st['threads']} torch thread. Summary: "
             f"K = {st['intervals']} quintic Hermite intervals, knee {st['knee']}, max_scale {st['max_scale']}. "
             f"Accuracy on the first {st['tokens']} response tokens of {st['examples']} Alpaca-GPT4 examples, "
             f"{st['scales']}, against a float64 reference without cancellation; d/ds errors relative to the size "
             f"of its terms (|G'| + |z_top - z_t|). Step: the transformer head's forward, the selective loss and the "
             f"backward on those tokens as one sequence (best of 3). Extraction: {st['extract_examples']} examples, "
             "best of 2.", "",
             "| model | V | max rel. err. value (CE_y / CE_u / log p_top) | max rel. err. d/ds | step exact (s) | "
             "step summary (s) | speed-up | extraction without / with (s) | slowdown |",
             "|---|---:|---|---|---:|---:|---:|---|---:|"]
    for name, r in results["models"].items():
        acc = r["accuracy"]
        values = " / ".join(f"{acc[k]['value']:.1e}" for k in ("ce_label", "ce_uniform", "log_p_top"))
        grads = " / ".join(f"{acc[k]['d_ds']:.1e}" for k in ("ce_label", "ce_uniform", "log_p_top"))
        lines.append(f"| {name} | {r['vocab']} | {values} | {grads} | {r['step_s']['exact']:.3f} | "
                     f"{r['step_s']['summary']:.3f} | {r['step_speedup']:.1f}x | {r['extract_s']['without']:.1f} / "
                     f"{r['extract_s']['with']:.1f} | {100 * r['extract_slowdown']:+.0f}% |")
    for name, r in results["models"].items():
        if "training" not in r:
            continue
        tr = r["training"]
        lines += ["", f"Short training run on {name} ({tr['train_response_tokens']} training / "
                  f"{tr['val_response_tokens']} held-out response tokens, {st['train_examples']} Alpaca-GPT4 "
                  "examples, 2 epochs, lr 1e-3), the same features both ways:", "",
                  "| route | ATS held-out ECE | ATS NLL | ATS train (s) | control ECE | control temperature | "
                  "control train (s) |", "|---|---:|---:|---:|---:|---:|---:|"]
        for route in ("summary", "exact"):
            a, c = tr[route]["ats"], tr[route]["selective-temperature"]
            lines.append(f"| {route} | {a['ece']:.4f} | {a['nll']:.4f} | {a['train_s']:.1f} | {c['ece']:.4f} | "
                         f"{c['temperature']:.5f} | {c['train_s']:.1f} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main(*[int(a) for a in sys.argv[1:]])
