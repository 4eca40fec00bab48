"""Issue 24: the scale summary against the exact full-vocabulary route, on real tokens of the embedded models.

Measures (a) the largest relative error of CE(q, y), CE(q, u), log p_top and their d/ds over s in [0.05, max_scale]
against a float64 reference without cancellation, (b) the time of one training step (transformer head forward, loss,
backward) from the summary and by the exact route, (c) feature extraction with and without the summary, the two
interleaved in one run, and what the summary adds split into the response tokens' logits (z = W h, the floor) and
`summarize_logits`, (d) on a short SmolLM2 run, the ATS head and the global control trained both ways, and temperature
scaling and Thermometer fitted from the summary and by the exact route. Writes benchmarks/results/scale_summary.md and
.json.

    ATS_DATA_DIR=../shared/data python benchmarks/bench_scale_summary.py --threads 1
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import tempfile
import time
from pathlib import Path

import torch

from ats.calibrators.ats import ATSCalibrator
from ats.calibrators.thermometer import Thermometer, prompt_states
from ats.evaluation.token_eval import token_validator
from ats.model.backbone import load_backbone
from ats.model.labels import IGNORE_INDEX
from ats.model.scale_summary import ScaleSummarySpec, scaled_ce_from_summary, summarize_logits
from ats.model.scaled_ce import scaled_cross_entropy
from ats.training.config import TrainingConfig
from ats.training.data import DataConfig, load_instructions, tokenize_instructions
from ats.training.features import extract_features
from ats.training.losses import calibration_loss
from ats.workflows.pipeline import fit_calibrators, prepare_features, train_head

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
            tau = cal.log_scale(h[None].float(), torch.ones(1, len(y), dtype=torch.long))[0]
            loss = calibration_loss(h.float(), cal.scale(tau.float()), y, backbone.logits, summary=summary)
            loss.loss.backward()
            best = min(best, time.perf_counter() - t)
        times[route] = best
    return times


def extraction_time(backbone, examples, repeats: int) -> dict:
    """Seconds to extract the examples' features without and with the summary, the two routes interleaved (best of
    `repeats` each), and the parts of the difference: the response tokens' logits and `summarize_logits` on them."""
    times = {"without": math.inf, "with": math.inf, "logits": math.inf, "summarize": math.inf}
    with tempfile.TemporaryDirectory() as tmp:
        for k in range(repeats):
            for route, spec in (("without", None), ("with", SPEC)):
                t = time.perf_counter()
                store = extract_features(backbone, examples, Path(tmp) / f"{route}{k}", progress=False, summary=spec)
                times[route] = min(times[route], time.perf_counter() - t)
            h = [hidden for hidden, _ in store.response_tokens(128)]
            y = [labels for _, labels in store.response_tokens(128)]
            with torch.no_grad():
                t = time.perf_counter()
                z = [backbone.logits(part.to(store_dtype(store))) for part in h]
                times["logits"] = min(times["logits"], time.perf_counter() - t)
                t = time.perf_counter()
                for zz, yy in zip(z, y):
                    summarize_logits(zz, yy, max_scale=SPEC.max_scale)
                times["summarize"] = min(times["summarize"], time.perf_counter() - t)
    times["response_tokens"] = sum(len(part) for part in y)
    times["tokens"] = sum(len(ex.input_ids) for ex in examples)
    return times


def store_dtype(store) -> torch.dtype:
    """The stored hidden states' dtype."""
    return {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}[store.meta["dtype"]]


def training_runs(backbone, n_examples: int) -> dict:
    """The ATS transformer head and the global-temperature control trained from the summary and by the exact route
    on the same features: held-out token ECE / NLL, the control's temperature, training seconds; and temperature
    scaling and Thermometer fitted both ways (`fit_calibrators` with and without the shared route)."""
    training = TrainingConfig(epochs=2, lr=1e-3)
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        train, val = prepare_features(backbone, Path(tmp) / "f", DataConfig(limit=n_examples, max_length=256),
                                      progress=False)
        out["train_response_tokens"] = train.meta["response_tokens"]
        out["val_response_tokens"] = val.meta["response_tokens"]
        validate = token_validator(val, backbone)
        out["fits"] = {}
        for route, shared in (("summary", True), ("exact", False)):
            row = {}
            for name in ("temperature", "thermometer"):
                t = time.perf_counter()
                cal = fit_calibrators(backbone, train, Path(tmp) / f"fit-{route}", (name,), shared_pass=shared,
                                      progress=False)[name]
                row[name] = {"fit_s": time.perf_counter() - t,
                             **{k: v for k, v in validate(cal).items() if k in ("ece", "nll")}}
                if name == "temperature":
                    row[name]["temperature"] = cal.temperature
                else:
                    row[name]["mean_temperature"] = float(cal.temperature(thermometer_prompts(train)).mean())
            out["fits"][route] = row
        h = torch.cat([hidden for hidden, _ in train.response_tokens()])  # the exact route on the summary's batches
        y = torch.cat([labels for _, labels in train.response_tokens()])
        prompts = thermometer_prompts(train)
        t = time.perf_counter()
        cal = Thermometer(hidden_size=backbone.hidden_size).fit_tokens(
            prompts, train.response_sequence_ids(),
            lambda rows, s: scaled_cross_entropy(h[rows], s, y[rows], backbone.logits).ce_label)
        out["fits"]["exact, same batches"] = {"thermometer": {
            "fit_s": time.perf_counter() - t, "mean_temperature": float(cal.temperature(prompts).mean()),
            **{k: v for k, v in validate(cal).items() if k in ("ece", "nll")}}}
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
            row["selective-temperature"]["temperature"] = math.exp(-head.gain * float(head.tau.detach()))
            out[route] = row
    return out


def thermometer_prompts(store) -> torch.Tensor:
    """(S, H) the stored sequences' prompt features."""
    return prompt_states(store)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default=",".join(MODELS), help="embedded models, comma-separated")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads (default: OMP_NUM_THREADS, else torch's default); recorded")
    parser.add_argument("--examples", type=int, default=8, help="Alpaca-GPT4 examples for accuracy and step time")
    parser.add_argument("--tokens", type=int, default=400, help="response tokens for accuracy and step time")
    parser.add_argument("--extract-examples", type=int, default=6, help="examples timed in feature extraction")
    parser.add_argument("--extract-repeats", type=int, default=3, help="interleaved extraction runs per route")
    parser.add_argument("--train-examples", type=int, default=60,
                        help="examples of the short training / fitting run on the first model; 0 skips it")
    parser.add_argument("--no-write", action="store_true", help="print only; do not write benchmarks/results")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    results = {"settings": {**SPEC.describe(), "examples": args.examples, "tokens": args.tokens,
                            "extract_examples": args.extract_examples, "extract_repeats": args.extract_repeats,
                            "train_examples": args.train_examples,
                            "scales": f"{len(SCALES)} log-spaced in [0.05, 10]", "threads": torch.get_num_threads(),
                            "cpus": os.cpu_count(), "cpu": platform.processor() or platform.machine(),
                            "load_average_before": round(os.getloadavg()[0], 2),
                            "torch": torch.__version__}, "models": {}}
    for i, name in enumerate(args.models.split(",")):
        backbone = load_backbone(name)
        examples = tokenize_instructions(backbone.tokenizer, load_instructions("alpaca_gpt4", limit=args.examples,
                                                                               seed=1), max_length=256)[0]
        h, z, y = response_logits(backbone, examples, args.tokens)
        row = {"vocab": backbone.vocab_size, "hidden": backbone.hidden_size, "tokens": len(y),
               "accuracy": accuracy(z, y), "step_s": step_time(backbone, h, z, y),
               "extract_s": extraction_time(backbone, examples[:args.extract_examples], args.extract_repeats)}
        row["step_speedup"] = row["step_s"]["exact"] / row["step_s"]["summary"]
        ex = row["extract_s"]
        row["extract_slowdown"] = ex["with"] / ex["without"] - 1
        row["extract_floor"] = ex["logits"] / ex["without"]  # the logits alone, as a share of the extraction
        # epochs of cached training whose saved step time repays the summary's extraction cost (per response token)
        row["break_even_epochs"] = (((ex["with"] - ex["without"]) / ex["response_tokens"])
                                    / ((row["step_s"]["exact"] - row["step_s"]["summary"]) / len(y)))
        row["bytes_per_token"] = {"summary": 4 * SPEC.width, "hidden_fp16": 2 * backbone.hidden_size}
        if i == 0 and args.train_examples:
            row["training"] = training_runs(backbone, args.train_examples)
        results["models"][name] = row
        print(name, json.dumps(row, indent=1), flush=True)
        del backbone
    if not args.no_write:
        OUT.parent.mkdir(parents=True, exist_ok=True)
        OUT.with_suffix(".json").write_text(json.dumps(results, indent=1))
        OUT.with_suffix(".md").write_text(render(results))
    print(render(results))


def machine_load(settings: dict) -> str:
    """The machine's load before the run, in words (runs recorded before the field existed shared their cores)."""
    load = settings.get("load_average_before")
    return "shared with other jobs" if load is None else f"load average {load} before the run"


def render(results: dict) -> str:
    """The markdown report."""
    st = results["settings"]
    lines = ["# Scale summary vs the exact route (issue 24)", "",
             f"Command: `ATS_DATA_DIR=../shared/data python benchmarks/bench_scale_summary.py --threads "
             f"{st['threads']}`; machine: {st['cpus']} CPU cores ({st['cpu']}), {machine_load(st)}, "
             f"{st['threads']} torch thread(s), torch {st['torch']}. Summary: K = {st['intervals']} quintic "
             f"Hermite intervals, knee {st['knee']}, max_scale {st['max_scale']}. Accuracy on the first {st['tokens']} "
             f"response tokens of {st['examples']} Alpaca-GPT4 examples, {st['scales']}, against a float64 reference "
             "without cancellation; d/ds errors relative to the size of its terms (|G'| + |z_top - z_t|). Step: the "
             "transformer head's forward, the selective loss and the backward on those tokens as one sequence (best "
             f"of 3). Extraction: {st['extract_examples']} examples, the routes without and with the summary "
             f"interleaved, best of {st['extract_repeats']} each; ratios are from the same run.", "",
             "| model | V | max rel. err. value (CE_y / CE_u / log p_top) | max rel. err. d/ds | step exact (s) | "
             "step summary (s) | speed-up |", "|---|---:|---|---|---:|---:|---:|"]
    for name, r in results["models"].items():
        acc = r["accuracy"]
        values = " / ".join(f"{acc[k]['value']:.1e}" for k in ("ce_label", "ce_uniform", "log_p_top"))
        grads = " / ".join(f"{acc[k]['d_ds']:.1e}" for k in ("ce_label", "ce_uniform", "log_p_top"))
        lines.append(f"| {name} | {r['vocab']} | {values} | {grads} | {r['step_s']['exact']:.3f} | "
                     f"{r['step_s']['summary']:.3f} | {r['step_speedup']:.1f}x |")
    lines += ["", "Feature extraction (seconds; the summary's cost split into the response tokens' logits z = W h, "
              "which the extraction without the summary never computes, and `summarize_logits` on them):", "",
              "| model | tokens (response) | without | with | slowdown | logits alone | summarize_logits | "
              "logits as a share of the extraction | repaid after (epochs) | bytes per token: summary / fp16 h |",
              "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for name, r in results["models"].items():
        ex, size = r["extract_s"], r["bytes_per_token"]
        lines.append(f"| {name} | {ex['tokens']} ({ex['response_tokens']}) | {ex['without']:.2f} | {ex['with']:.2f} | "
                     f"{100 * r['extract_slowdown']:+.0f}% | {ex['logits']:.2f} | {ex['summarize']:.2f} | "
                     f"{100 * r['extract_floor']:.0f}% | {r['break_even_epochs']:.2f} | "
                     f"{size['summary']} / {size['hidden_fp16']} |")
    lines += ["", "Read the slowdown with the parts: the issue's target is at most +15%. The logits alone are the floor "
              "of any per-token summary of them (exact float32 matmuls at the CPU's peak; a bfloat16 matmul is "
              "faster but its logits miss the accuracy target, `docs/method.md`), so the target cannot be met where "
              "the floor alone exceeds it. 'Repaid after' is the extraction's extra time per response token divided "
              "by what the summary saves per token of one training epoch (the step times above): every epoch, seed "
              "or method trained on the same features after that is the step's speed-up ahead. `docs/method.md` "
              "(the scale summary section) discusses the numbers."]
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
        if "fits" in tr:
            lines += ["", "Temperature scaling and Thermometer on the same training tokens, fitted from the summary "
                      "(`fit_calibrators`, default) and by the exact route (`shared_pass=False`: every Newton step "
                      "and every Thermometer epoch a full-vocabulary pass); held-out token ECE / NLL:", "",
                      "| route | temperature T | ECE | NLL | fit (s) | Thermometer mean T | ECE | NLL | fit (s) |",
                      "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
            for route, row in tr["fits"].items():
                t, th = row.get("temperature"), row["thermometer"]
                first = (f"{t['temperature']:.6f} | {t['ece']:.4f} | {t['nll']:.4f} | {t['fit_s']:.1f}" if t else
                         "| | |")
                lines.append(f"| {route} | {first} | {th['mean_temperature']:.5f} | {th['ece']:.4f} | "
                             f"{th['nll']:.4f} | {th['fit_s']:.1f} |")
            lines += ["", "(exact: Thermometer's `fit_sequences`, whose batches are drawn differently, so its "
                      "temperatures differ by the optimiser's path; exact, same batches: the exact CE on the batches "
                      "the summary route draws (`Thermometer.fit_tokens`), which isolates the summary's own error.)"]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
