"""What `ats certify` buys on answers made as they are served: does the default calibrator (Thermometer trained on
the model's own answers, `ats train` without options) let the model answer more questions at a certified risk than
its raw confidence, and does the certificate keep its promise on other questions of the same mix?

Per model:

1. `ats train --model M --out WORK/M/train` (the default: Thermometer on the QA pool's answers; cached and resumed).
2. `ats certify`'s own certification questions for that calibrator (`certification_sets`: NQ-open and TriviaQA pool
   questions after those it trained on, `--size` of each, taken in turn), answered exactly as `ats serve` answers
   a chat request (`evaluation.served`: one user turn, greedy, 64 new tokens at most, judged by whole-word alias
   containment). One pass gives both confidences of the same answer: Thermometer's served `answer_confidence` and
   the raw model's (`uncalibrated`): a scaling calibrator never changes a greedy answer. Cached per batch (JSON with
   the options that made it, checked on reuse), so a stopped run resumes.
3. Per target risk (delta 0.1): the threshold certified on all of them (coverage, risk, its bound; the sequence
   started at the fewest answers that can certify, `ats certify`'s start when this ran, now `--start-coverage 0`),
   the smallest certifiable target risk, and 200 seeded halvings (certify on one half, measure on the other, both
   methods on the same split): how often the realised risk exceeds the target (and how often its two-sided 95%
   Clopper-Pearson interval lies entirely above it: a half answering a handful of questions exceeds by chance, and
   the guarantee is about the risk, not one half's error rate), mean coverage, and Thermometer's
   coverage minus the raw model's on the same halves (mean and the 2.5-97.5% range over halvings). Ordering: AUROC
   and PRR with paired bootstrap intervals (Thermometer - raw), and the accuracy of the most confident answers,
   where fixed-sequence testing starts. Every target risk listed is reported. The same with the sequence started at
   5% coverage (`ats certify --start-coverage 0.05`): that value was chosen after reading these answers' top
   accuracies, so that table shows the mechanism and is no evidence for a default (`ats certify`'s default start,
   0.3, was chosen on other answers: benchmarks/start_coverage.py).

    ATS_DATA_DIR=../shared/data python benchmarks/certify_served.py --model qwen2.5-coder-1.5b-instruct
    python benchmarks/certify_served.py --report          # the analysis again from OUT's answers, in seconds

Writes benchmarks/results/certify_served.md and .json (every answer's confidences and correctness in the JSON).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
from bench_generation import command_line, machine, save_results
from selective import decide, paired_halvings

from ats.calibrators import load_calibrator
from ats.evaluation.metrics import paired_differences
from ats.evaluation.report import markdown_table
from ats.evaluation.selective import prr
from ats.evaluation.served import answer_format, served_answers
from ats.evaluation.threshold import certify_threshold, smallest_certifiable_risk
from ats.io import read_json, write_json
from ats.model.backbone import load_backbone
from ats.workflows.answer_pool import free_form_tasks
from ats.workflows.certify import BATCH, certification_sets, interleaved_order

RESULTS = Path(__file__).resolve().parent / "results" / "certify_served"
TARGET_RISKS = (0.3, 0.4, 0.5, 0.6, 0.7)
DELTA = 0.1
HALVINGS = 200
START = 0.05  # the sequence started at 5% coverage (`ats certify --start-coverage`): chosen while reading these answers
TOP = (10, 30, 60, 120)  # the most confident answers whose accuracy is reported (where a certificate starts)
METHODS = {"uncalibrated": "uncalibrated", "thermometer": "confidence"}  # method -> the answers' field
NAMES = {"auroc": "AUROC", "prr": "PRR", "ece": "ECE", "brier": "Brier"}


def trained_head(model: str, work: Path) -> Path:
    """`ats train`'s default calibrator for `model`, through the command line (its answers and head reused on a
    rerun): WORK/train/head."""
    out = work / "train"
    subprocess.run([sys.executable, "-m", "ats", "-q", "train", "--model", model, "--out", str(out)], check=True)
    return out / "head"


def answer_all(model: str, work: Path, size: int, skip: int = 0) -> dict:
    """The served answers of `model`'s certification questions, both confidences per answer (module docstring),
    made `BATCH` at a time and saved after each batch to WORK/served.json (resumed when made the same way). `skip`:
    the `size` questions per task after the first `skip` of them instead (other questions of the same mix, for
    choosing what is then measured on the first ones: WORK/served_skip{skip}.json)."""
    head = trained_head(model, work)
    backbone = load_backbone(model)
    calibrator = load_calibrator(head, backbone)
    tasks = certification_sets(calibrator, size, where=str(head))
    if skip:
        tasks = free_form_tasks(size, {name: task.offset + skip for name, task in tasks.items()})
    questions = {name: task.load()[1] for name, task in tasks.items()}
    order = interleaved_order(questions)
    made = {"model": model, "calibrator": calibrator.digest(), "format": answer_format(backbone),
            "sets": {name: task.describe() for name, task in tasks.items()}}
    path = work / (f"served_skip{skip}.json" if skip else "served.json")
    saved = read_json(path) if path.is_file() else None
    if saved is not None and saved["made"] != made:
        raise SystemExit(f"{path}: made otherwise ({saved['made']} vs {made}): delete it or use another --work")
    rows = saved["rows"] if saved is not None else []
    seconds = saved["seconds"] if saved is not None else 0.0
    for start in range(len(rows), len(order), BATCH):
        began = time.perf_counter()
        batch = order[start:start + BATCH]
        got = served_answers(backbone, calibrator, [questions[t][i] for t, i in batch], batch_size=BATCH)
        rows += [{"task": t, "index": i, "confidence": float(got.confidence[k]),
                  "uncalibrated": float(got.uncalibrated[k]), "correct": bool(got.correct[k]),
                  "finish": got.finish[k], "text": got.text[k]} for k, (t, i) in enumerate(batch)]
        seconds += time.perf_counter() - began
        write_json(path, {"made": made, "rows": rows, "seconds": seconds})
        print(f"{model}: {len(rows)}/{len(order)} served answers, {seconds:.0f} s", file=sys.stderr, flush=True)
    return {"made": made, "rows": rows, "seconds": seconds}


def halvings(conf: dict[str, np.ndarray], correct: np.ndarray, target: float, start: float = 0.0) -> dict:
    """`HALVINGS` seeded random halvings, the same for every method (`selective.paired_halvings`, the sequence
    started at coverage `start`), and Thermometer's coverage minus the raw model's over the same splits."""
    out = paired_halvings(conf, correct, target, repeats=HALVINGS, start_coverage=start)
    diff = np.asarray(out["thermometer"]["coverage"]) - np.asarray(out["uncalibrated"]["coverage"])
    result = {m: {"exceed_rate": v["exceed"] / HALVINGS, "beyond_noise_rate": v["beyond_noise"] / HALVINGS,
                  "certified": v["certified"],
                  "mean_coverage": float(np.mean(v["coverage"]))} for m, v in out.items()}
    result["coverage_diff"] = {"mean": float(diff.mean()), "range": [float(np.quantile(diff, 0.025)),
                                                                     float(np.quantile(diff, 0.975))]}
    return result


def arrays(rows: list[dict]) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """Each method's confidences (N,) and the correctness (N,) of saved answer rows."""
    correct = np.asarray([r["correct"] for r in rows], dtype=bool)
    return {m: np.asarray([r[f] for r in rows], dtype=np.float64) for m, f in METHODS.items()}, correct


def analyse(answers: dict) -> dict:
    """Every number of the report from the served answers (module docstring, step 3)."""
    rows = answers["rows"]
    conf, correct = arrays(rows)
    per_target = {}
    for target in TARGET_RISKS:
        entry = {}
        for start, key in ((0.0, ""), (START, "_started")):  # as `ats certify` does; started at coverage START
            full = {}
            for method, c in conf.items():  # the threshold certified on all of them
                certified = certify_threshold(c, correct, target_risk=target, delta=DELTA, start_coverage=start)
                full[method] = {**decide(certified, c, correct), "threshold": certified.threshold,
                                "bound": certified.bound}
            entry.update({f"all{key}": full, f"halvings{key}": halvings(conf, correct, target, start)})
        per_target[str(target)] = entry
    paired = paired_differences((conf["thermometer"], correct), (conf["uncalibrated"], correct),
                                keys=("auroc", "prr", "ece", "brier"))
    return {"n": int(correct.size), "accuracy": float(correct.mean()),
            "per_task": {t: float(np.mean([r["correct"] for r in rows if r["task"] == t]))
                         for t in sorted({r["task"] for r in rows})},
            "finish_length": float(np.mean([r["finish"] == "length" for r in rows])),
            "prr": {m: prr(c, correct) for m, c in conf.items()},
            "top_accuracy": {m: {str(k): float(correct[np.argsort(-c, kind="stable")[:k]].mean()) for k in TOP}
                             for m, c in conf.items()},
            "smallest_risk": {m: smallest_certifiable_risk(c, correct, DELTA, start_coverage=0.0)
                              for m, c in conf.items()},
            "smallest_risk_started": {m: smallest_certifiable_risk(c, correct, DELTA, start_coverage=START)
                                      for m, c in conf.items()},
            "paired": paired, "targets": per_target}


def _ci(d: dict) -> str:
    return f"{d['diff']:+.3f} [{d['ci'][0]:+.3f}, {d['ci'][1]:+.3f}]"


def markdown(result: dict) -> str:
    """The results page."""
    lines = ["# Certified thresholds on served answers: the default calibrator against the raw model", "",
             f"Machine: {result['machine']['cpu']}, {result['machine']['cores']} cores. Method: the docstring of "
             "`benchmarks/certify_served.py`.", ""]
    for model, r in result["models"].items():
        a = r["analysis"]
        sizes = ", ".join(f"{t} {d.get('limit')}" for t, d in r["made"]["sets"].items())
        lines += [f"## {model}", "", f"Command: `{r['command']}`", "",
                  f"{a['n']} certification questions answered as served ({sizes}; {r['seconds']:.0f} s): accuracy "
                  f"{a['accuracy']:.3f} (" + ", ".join(f"{t} {v:.3f}" for t, v in a["per_task"].items())
                  + f"), {a['finish_length']:.0%} cut at the token limit. Thermometer - raw, paired bootstrap 95%: "
                  + ", ".join(f"{NAMES[k]} {_ci(a['paired'][k])}" for k in a["paired"])
                  + ". Smallest certifiable target risk (delta 0.1): "
                  + ", ".join(f"{m} {'-' if v is None else f'{v:.3f}'}" for m, v in a["smallest_risk"].items())
                  + ". Accuracy of the most confident answers: "
                  + "; ".join(f"{m} " + ", ".join(f"top {k} {v:.2f}" for k, v in tops.items())
                              for m, tops in a["top_accuracy"].items()) + ".", ""]
        for key, title in (("", "The sequence started at the fewest answers that can certify (`ats certify "
                                 "--start-coverage 0`; its default when this ran)."),
                           ("_started", f"The sequence started at {START:.0%} coverage (`ats certify "
                                        f"--start-coverage {START}`). Smallest certifiable target risk: "
                                        + ", ".join(
                                            f"{m} {'-' if v is None else f'{v:.3f}'}"
                                            for m, v in a["smallest_risk_started"].items()) + ".")):
            lines += [title, "", _table(a, key), ""]
    return "\n".join(lines)


def _table(a: dict, key: str) -> str:
    """One model's table per target risk and method, of the certificates without (`key` "") or with the start."""
    table = []
    for target, t in a["targets"].items():
        for m in METHODS:
            full, half = t[f"all{key}"][m], t[f"halvings{key}"][m]
            diff = t[f"halvings{key}"]["coverage_diff"]
            table.append([target, m, "-" if full["threshold"] is None else f"{full['threshold']:.4f}",
                          f"{full['coverage']:.3f}", "-" if full["risk"] is None else f"{full['risk']:.3f}",
                          f"{half['mean_coverage']:.3f}", f"{half['certified']}/{HALVINGS}",
                          f"{half['exceed_rate']:.3f}", f"{half['beyond_noise_rate']:.3f}",
                          f"{diff['mean']:+.3f} [{diff['range'][0]:+.3f}, {diff['range'][1]:+.3f}]"
                          if m == "thermometer" else ""])
    return markdown_table(["target risk", "method", "threshold (all)", "coverage (all)", "risk (all)",
                           "coverage (halvings)", "halves certified", "halves over target", "over beyond noise",
                           "Thermometer - raw coverage (halvings)"], table)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", action="append", help="embedded model name (repeatable)")
    p.add_argument("--size", type=int, default=300, help="certification questions per task (ats certify's --size)")
    p.add_argument("--work", default="runs/certify_served", help="training runs and served answers (resumable)")
    p.add_argument("--out", default=str(RESULTS), help="writes OUT.md and OUT.json")
    p.add_argument("--report", action="store_true", help="only redo the analysis from OUT.json's answers")
    args = p.parse_args(argv)
    out = Path(args.out)
    previous = read_json(out.with_suffix(".json")) if out.with_suffix(".json").is_file() else {"models": {}}
    models = previous["models"]  # a model run now replaces its own entry; the others stay
    for model in ([] if args.report else args.model or ["qwen2.5-coder-1.5b-instruct"]):
        models[model] = {**answer_all(model, Path(args.work) / model, args.size), "command": command_line(argv)}
    for r in models.values():
        r["analysis"] = analyse(r)
    result = {"machine": machine(), "models": models}
    save_results(out, result, markdown(result))
    print(out.with_suffix(".md").read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
