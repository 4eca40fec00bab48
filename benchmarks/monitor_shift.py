"""How much traffic the served certificate's monitor (`ats.serving.monitor`) needs to say that the questions are not
the certification mix, and how often it says so when they are.

1. Simulation (no model): certification answers and served answers drawn as Bernoulli answer decisions, the
   certified count itself random; per setting 1,000 runs of up to 2,000 served answers, the monitor's own alarm rule
   (`shift_alarm`, delta 0.1) read after every answer. Reported: the runs that raise the alarm, and the answers
   until it (median, 90th percentile) when the served rate is the certified one (false alarms) and when it moved.
2. Served answers of a real model: the uncalibrated model (`--model`) answers, exactly as `ats serve` answers a chat
   request (`served_answers`, greedy, 64 new tokens), its certification set (`ats certify`'s for the uncalibrated
   model: NQ-open and TriviaQA pool questions in turn), then three kinds of traffic: more questions of the same mix
   (disjoint from the certification ones: no shift), TruthfulQA questions (a reported set: nothing is tuned here,
   the traffic only needs the model's confidence) and Alpaca-GPT4 instructions (an assistant's traffic). A
   threshold is certified at each target risk of `--target-risks` (every one reported, none chosen), and each
   traffic set is replayed in 200 seeded orders through the alarm rule.

    ATS_DATA_DIR=../shared/data python benchmarks/monitor_shift.py --model qwen2.5-coder-1.5b-instruct
    python benchmarks/monitor_shift.py --simulation-only

Answers are cached per set under --work (JSON, with the options that made them, checked on reuse), so a stopped run
resumes. Writes benchmarks/results/monitor_shift.md and .json.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
from bench_generation import command_line, machine, save_results

from ats.evaluation.report import markdown_table
from ats.serving.monitor import rate_interval, shift_alarm

RESULTS = Path(__file__).resolve().parent / "results"
DELTA = 0.1
LEVEL = DELTA / 2  # each side's share, as DecisionMonitor.report splits it


def first_alarms(decisions: np.ndarray, certified_answered: np.ndarray, certified_n: int) -> np.ndarray:
    """(R,) the number of served answers at the first alarm of each run (0: none), from answered decisions (R, T)
    and each run's certified count (R,)."""
    answered = decisions.cumsum(axis=1)  # (R, T)
    looks = np.arange(1, decisions.shape[1] + 1)  # (T,)
    out = np.zeros(decisions.shape[0], dtype=np.int64)
    for r in range(decisions.shape[0]):
        alarm = shift_alarm(answered[r], looks, rate_interval(int(certified_answered[r]), certified_n, LEVEL), LEVEL)
        hits = np.flatnonzero(alarm)
        out[r] = hits[0] + 1 if hits.size else 0
    return out


def delay_figures(first: np.ndarray) -> dict:
    """The share of runs alarmed and the answers until the alarm among them (median, 90th percentile)."""
    hit = first[first > 0]
    return {"alarmed": float(hit.size / first.size),
            "median": float(np.median(hit)) if hit.size else None,
            "p90": float(np.percentile(hit, 90)) if hit.size else None}


def simulate(runs: int, looks: int, seed: int) -> list[dict]:
    """The simulation grid: certified on 300 or 2,000 answers at rate 0.3; served at 0.3 (no shift) and moved."""
    rng = np.random.default_rng(seed)
    rows = []
    for certified_n in (300, 2000):
        for served in (0.3, 0.25, 0.2, 0.1, 0.4, 0.6):
            certified = rng.binomial(certified_n, 0.3, size=runs)
            decisions = rng.uniform(size=(runs, looks)) < served
            rows.append({"certified_n": certified_n, "certified_rate": 0.3, "served_rate": served,
                         **delay_figures(first_alarms(decisions, certified, certified_n))})
    return rows


def answer_sets(args) -> dict:
    """name -> (confidence, correct or None) of each answer set, answered as served (cached under --work)."""
    from ats.evaluation.served import ServedAnswers, served_answers
    from ats.evaluation.tasks.truthfulqa_gen import load_truthfulqa_gen
    from ats.model.backbone import load_backbone
    from ats.training.data import load_instructions
    from ats.workflows.answer_pool import certification_tasks, check_disjoint, free_form_tasks, task_range
    from ats.workflows.certify import interleaved_order

    certify = certification_tasks([], args.certify_size)  # `ats certify`'s sets for the uncalibrated model
    offsets = {name: task.offset + args.certify_size for name, task in certify.items()}
    mix = free_form_tasks(args.traffic_size // 2, offsets)
    check_disjoint([task_range(t.describe()) for t in certify.values()], mix)

    def interleaved(tasks: dict) -> list[dict]:
        rows = {name: task.load()[1] for name, task in tasks.items()}
        return [rows[t][i] for t, i in interleaved_order(rows)]

    rng = np.random.default_rng(0)
    truthful = load_truthfulqa_gen()
    truthful = [{"question": truthful[i]["question"], "aliases": []}
                for i in sorted(rng.permutation(len(truthful))[:args.traffic_size])]
    alpaca = [{"question": (r.instruction + ("\n\n" + r.input if r.input else "")), "aliases": []}
              for r in load_instructions("alpaca_gpt4", limit=args.alpaca_size, seed=0)]
    sets = {"certification": (interleaved(certify), True), "same mix": (interleaved(mix), True),
            "TruthfulQA": (truthful, False), "Alpaca-GPT4": (alpaca, False)}
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    backbone, out = None, {}
    for name, (questions, labelled) in sets.items():
        made = {"model": args.model, "questions": [q["question"] for q in questions], "max_tokens": 64}
        path = work / (name.replace(" ", "_") + ".json")
        cached = json.loads(path.read_text()) if path.is_file() else None
        if cached is not None and cached.get("made") != made:
            raise SystemExit(f"{path}: answers made with other options (model or questions); delete it or use "
                             f"another --work")
        if cached is None:
            backbone = backbone or load_backbone(args.model)
            start, answers = time.perf_counter(), ServedAnswers()
            for i in range(0, len(questions), 16):
                answers.extend(served_answers(backbone, None, questions[i:i + 16], max_tokens=64))
                print(f"{name}: {len(answers)}/{len(questions)} answers", flush=True)
            cached = {"made": made, "seconds": time.perf_counter() - start,
                      "confidence": answers.confidence.tolist(), "correct": answers.correct.tolist(),
                      "finish": answers.finish}
            path.write_text(json.dumps(cached))
        out[name] = {"confidence": np.asarray(cached["confidence"]),
                     "correct": np.asarray(cached["correct"]) if labelled else None, "seconds": cached["seconds"]}
    return out


def replay(args, sets: dict) -> list[dict]:
    """Per target risk of `--target-risks` that certifies on the certification answers: the threshold, and each
    traffic set replayed in seeded orders through the alarm rule."""
    from ats.evaluation.threshold import certify_threshold

    cert = sets["certification"]
    out = []
    for risk in args.target_risks:
        threshold = certify_threshold(cert["confidence"], cert["correct"], target_risk=risk, delta=DELTA,
                                      start_coverage=0.0)  # from the fewest answers, as when these results were made
        if threshold.threshold is None:
            out.append({"threshold": threshold.to_dict()})
            continue
        answered_n = round(threshold.coverage * threshold.n)
        rows = []
        rng = np.random.default_rng(1)
        for name, s in sets.items():
            if name == "certification":
                continue
            decisions = threshold.answers(s["confidence"])  # (N,)
            orders = np.stack([decisions[rng.permutation(decisions.size)] for _ in range(args.orders)])
            first = first_alarms(orders, np.full(args.orders, answered_n), threshold.n)
            row = {"traffic": name, "n": int(decisions.size), "answer_rate": float(decisions.mean()),
                   **delay_figures(first)}
            if s["correct"] is not None:
                row["accuracy"] = float(s["correct"].mean())
                row["risk_answered"] = float(1 - s["correct"][decisions].mean()) if decisions.any() else None
            rows.append(row)
        out.append({"threshold": threshold.to_dict(), "traffic": rows,
                    "certified_interval": list(rate_interval(answered_n, threshold.n, LEVEL))})
    return out


def fmt(x, digits: int = 0) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def markdown(result: dict) -> str:
    lines = ["# The served certificate's monitor: answers until the alarm", "",
             f"Command: `{result['command']}`", "", f"Machine: {result['machine']['cpu']}, "
             f"{result['machine']['cores']} cores.", "",
             "## Simulation", "",
             f"{result['simulation_runs']} runs per row, up to {result['simulation_looks']} served answers each, the "
             f"alarm rule read after every answer (delta {DELTA}). The first rows of each block (served rate = "
             "certified rate) are false alarms: at most delta by construction.", "",
             markdown_table(["certified on", "certified rate", "served rate", "runs alarmed",
                             "answers to alarm: median", "90th percentile"],
                            [[r["certified_n"], r["certified_rate"], r["served_rate"], f"{100 * r['alarmed']:.1f}%",
                              fmt(r["median"]), fmt(r["p90"])] for r in result["simulation"]], text_columns=0)]
    real = result.get("served")
    if real:
        lines += ["", f"## Served answers of {result['model']} (uncalibrated)", "",
                  f"Certification: {real['n']} served answers, accuracy {real['accuracy']:.3f}. Each traffic set "
                  f"replayed in {result['orders']} seeded orders through each threshold below.",
                  "", "Seconds to answer each set: " + ", ".join(f"{k} {v:.0f}" for k, v in real["seconds"].items())
                  + "."]
        for block in real["thresholds"]:
            t = block["threshold"]
            if t["threshold"] is None:
                lines += ["", f"### Target risk {t['target_risk']}: nothing certified (abstain always)"]
                continue
            low, high = block["certified_interval"]
            lines += ["", f"### Target risk {t['target_risk']}: threshold {t['threshold']:.4f}, coverage "
                      f"{t['coverage']:.3f} ({low:.3f}-{high:.3f} at {1 - LEVEL:g}), risk {t['risk']:.3f}, bound "
                      f"{t['bound']:.3f}", "",
                      markdown_table(["traffic", "answers", "answer rate", "orders alarmed",
                                      "answers to alarm: median", "90th percentile", "accuracy",
                                      "error rate among answered"],
                                     [[r["traffic"], r["n"], f"{r['answer_rate']:.3f}", f"{100 * r['alarmed']:.1f}%",
                                       fmt(r["median"]), fmt(r["p90"]), fmt(r.get("accuracy"), 3),
                                       fmt(r.get("risk_answered"), 3)] for r in block["traffic"]])]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    p.add_argument("--work", default="runs/monitor_shift", help="cached answers")
    p.add_argument("--certify-size", type=int, default=150, help="certification questions per free-form pool task")
    p.add_argument("--traffic-size", type=int, default=150, help="questions of the same mix and of TruthfulQA")
    p.add_argument("--alpaca-size", type=int, default=100, help="Alpaca-GPT4 instructions")
    p.add_argument("--target-risks", type=lambda s: [float(x) for x in s.split(",")], default=[0.3, 0.5, 0.7])
    p.add_argument("--orders", type=int, default=200)
    p.add_argument("--runs", type=int, default=1000)
    p.add_argument("--looks", type=int, default=2000)
    p.add_argument("--simulation-only", action="store_true")
    p.add_argument("--out", default=str(RESULTS / "monitor_shift"))
    args = p.parse_args(argv)
    result = {"command": command_line(argv), "machine": machine(), "delta": DELTA, "simulation_runs": args.runs,
              "simulation_looks": args.looks, "orders": args.orders, "model": args.model,
              "simulation": simulate(args.runs, args.looks, seed=0)}
    if not args.simulation_only:
        sets = answer_sets(args)
        cert = sets["certification"]
        result["served"] = {"n": int(cert["confidence"].size), "accuracy": float(cert["correct"].mean()),
                            "seconds": {name: s["seconds"] for name, s in sets.items()},
                            "thresholds": replay(args, sets)}
    text = markdown(result)
    save_results(Path(args.out), result, text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
