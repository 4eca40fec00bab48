"""Issue 32's evidence: does an answer-or-abstain threshold certified on held-out QA-pool answers keep its promised
risk on other tasks, and which calibrator answers the most questions at the target risk?

Per model: the backbone answers the QA pool once (the training split `ats train --on answers` uses), the held-out
pool questions (`answer_pool.held_out_tasks`: disjoint from that split) and the reported tasks (MMLU, TriviaQA,
TruthfulQA MC1 and free-form; never trained or selected on); every answer set is cached and fingerprinted
(`pipeline.prepare_answers`), so a rerun resumes. Methods, all fitted on the training split only (or, for the
paper's head, on instruction data):

- uncalibrated;
- control: one temperature trained on the answers (`--method constant`);
- thermometer: Thermometer trained on the answers (the default of `ats train`);
- ats-paper: the paper's transformer head trained on Alpaca-GPT4 instruction tokens (`ats train --on instructions`);
- histogram: equal-mass histogram binning of the uncalibrated confidence on the training split's answers.

For each method and target risk alpha (delta = 0.1), the threshold is certified (`certify_threshold`: Clopper-
Pearson, fixed-sequence testing) on the held-out free-form pool answers (NQ-open and TriviaQA pool questions: the
kind of answer `ats serve` decides on), then applied to every other answer set: realised risk (error rate among the
answered) and coverage. A free-form pool task is judged with the threshold certified on the other one alone (left
out of the certification); multiple-choice pool tasks and the reported tasks were never in it. Within the
certification distribution the guarantee is checked directly: 200 random halvings of the held-out free-form answers,
certify on one half, measure on the other.

    ATS_DATA_DIR=../shared/data python benchmarks/selective.py --model smollm2-135m-instruct
    ATS_DATA_DIR=../shared/data python benchmarks/selective.py --model qwen2.5-coder-0.5b-instruct
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
from bench_generation import command_line, machine
from protocols.answers import baselines_on_answers

from ats.calibrators import load_calibrator
from ats.evaluation.tasks import MMLUTask, TriviaQATask, TruthfulQAGenTask, TruthfulQAMC1Task
from ats.evaluation.threshold import certify_threshold
from ats.io import write_json
from ats.model.backbone import load_backbone
from ats.training.answers import score_answers
from ats.training.config import TrainingConfig
from ats.workflows.answer_methods import train_spec
from ats.workflows.answer_pool import FREE_FORM, AnswerPool, held_out_tasks, pool_names, pool_tasks
from ats.workflows.pipeline import prepare_answers

ALPHAS = (0.1, 0.2, 0.3, 0.5, 0.7)
DELTA = 0.1
METHODS = ("uncalibrated", "control", "thermometer", "ats-paper", "histogram")
CERTIFY = tuple(f"{n}_held_out" for n in FREE_FORM)
RESULTS = Path(__file__).parent / "results" / "selective"


def reported_tasks(sizes: dict) -> dict:
    return {"mmlu": MMLUTask(limit=sizes["mmlu"], seed=0), "triviaqa": TriviaQATask(limit=sizes["triviaqa"], seed=0),
            "truthfulqa_mc1": TruthfulQAMC1Task(limit=sizes["truthfulqa"], seed=0),
            "truthfulqa_gen": TruthfulQAGenTask(limit=sizes["truthfulqa"], seed=0)}


def paper_head(model: str, work: Path, limit: int) -> Path:
    """The paper's recipe through the command line (features and head reused on a rerun): work/paper/head."""
    out = work / "paper"
    subprocess.run([sys.executable, "-m", "ats", "-q", "train", "--on", "instructions", "--model", model,
                    "--limit", str(limit), "--out", str(out)], check=True)
    return out / "head"


def answer_head(backbone, kind: str, sets: list, pool: AnswerPool, folder: Path):
    """A calibrator of `kind` trained on the pool's answers with `ats train --on answers`' defaults; reused."""
    if (folder / "calibrator_config.json").exists():
        return load_calibrator(folder, backbone)
    calibrator = train_spec(backbone, sets, pool, kind=kind, tokens=False,
                            training=TrainingConfig(loss_type="answer-log"), method=f"{kind}-answers")
    calibrator.save_pretrained(folder)
    return calibrator


def decide(threshold, conf: np.ndarray, correct: np.ndarray) -> dict:
    """Coverage and realised risk of `threshold` on these answers, the risk with its two-sided 95% Clopper-Pearson
    interval (so an exceedance can be told from noise)."""
    from scipy.stats import beta

    answered = threshold.answers(conf)
    k, n = int((~correct[answered]).sum()), int(answered.sum())
    ci = None
    if n:
        ci = [float(beta.ppf(0.025, k, n - k + 1)) if k else 0.0,
              float(beta.ppf(0.975, k + 1, n - k)) if k < n else 1.0]
    return {"n": int(conf.size), "accuracy": float(correct.mean()), "coverage": float(answered.mean()),
            "answered": n, "risk": k / n if n else None, "risk_ci": ci}


def paired_coverage(a: np.ndarray, b: np.ndarray, resamples: int = 1000) -> dict:
    """Coverage of decisions `a` minus `b` (bool, the same questions), with a 95% paired bootstrap interval."""
    rng = np.random.default_rng(0)
    idx = rng.integers(0, a.size, size=(resamples, a.size))
    diffs = a[idx].mean(1) - b[idx].mean(1)
    return {"diff": float(a.mean() - b.mean()), "ci": [float(np.quantile(diffs, 0.025)),
                                                       float(np.quantile(diffs, 0.975))]}


def halvings(conf: np.ndarray, correct: np.ndarray, alpha: float, repeats: int = 200) -> dict:
    """Certify on a random half, measure on the other: how often the realised risk exceeds alpha."""
    rng = np.random.default_rng(0)
    exceed, answered_any, coverage = 0, 0, []
    for _ in range(repeats):
        order = rng.permutation(conf.size)
        a, b = order[: conf.size // 2], order[conf.size // 2:]
        t = certify_threshold(conf[a], correct[a], alpha=alpha, delta=DELTA)
        d = decide(t, conf[b], correct[b])
        coverage.append(d["coverage"])
        if d["risk"] is not None:
            answered_any += 1
            exceed += d["risk"] > alpha
    return {"repeats": repeats, "certified": answered_any, "exceed": exceed,
            "exceed_rate": exceed / repeats, "mean_coverage": float(np.mean(coverage))}


def run(args) -> dict:
    work = Path(args.work) / args.model
    started = time.perf_counter()
    head_folder = paper_head(args.model, work, args.instruction_limit)
    backbone = load_backbone(args.model)
    pool = AnswerPool(pool_size=args.pool_size, mmlu_per_subject=args.mmlu_pool)
    train_sets = {name: prepare_answers(backbone, task, work / "answers" / "pool" / name, progress=True)
                  for name, task in pool_tasks(pool.pool_size, pool.mmlu_per_subject).items()}
    held = {**held_out_tasks(pool, args.held_out, names=tuple(pool_names(1))[:4] + ("nq_open", "triviaqa_pool")),
            **held_out_tasks(pool, args.mmlu_held_out, names=("mmlu_validation",))}
    held_sets = {name: prepare_answers(backbone, task, work / "answers" / "held_out" / name, progress=True)
                 for name, task in held.items()}
    reported = {name: prepare_answers(backbone, task, work / "answers" / "reported" / name, progress=True)
                for name, task in reported_tasks({"mmlu": args.mmlu, "triviaqa": args.triviaqa,
                                                  "truthfulqa": args.truthfulqa}).items()}
    sets = list(train_sets.values())
    control = answer_head(backbone, "constant", sets, pool, work / "heads" / "control")
    calibrators = {"uncalibrated": None, "control": control,
                   "thermometer": answer_head(backbone, "thermometer", sets, pool, work / "heads" / "thermometer"),
                   "ats-paper": load_calibrator(head_folder, backbone)}
    histogram = baselines_on_answers(sets, backbone.logits, control)["histogram-answers"]

    def scores(method: str, answers) -> tuple[np.ndarray, np.ndarray]:
        correct = score_answers(None, answers, backbone.logits)[1]
        if method == "histogram":
            return np.asarray(histogram(answers), dtype=np.float64), correct
        return score_answers(calibrators[method], answers, backbone.logits)

    evaluated = {**{n: s for n, s in held_sets.items()}, **reported}
    table, decisions = {}, {}
    for method in METHODS:
        per_set = {name: scores(method, answers) for name, answers in evaluated.items()}
        cert_conf = np.concatenate([per_set[n][0] for n in CERTIFY])
        cert_ok = np.concatenate([per_set[n][1] for n in CERTIFY])
        rows = {}
        for alpha in ALPHAS:
            threshold = certify_threshold(cert_conf, cert_ok, alpha=alpha, delta=DELTA)
            row = {"threshold": threshold.to_dict(), "halvings": halvings(cert_conf, cert_ok, alpha), "tasks": {}}
            for name, (conf, ok) in per_set.items():
                rule = threshold
                if name in CERTIFY:  # left out: certified on the other free-form task alone
                    other = [n for n in CERTIFY if n != name]
                    rule = certify_threshold(np.concatenate([per_set[n][0] for n in other]),
                                             np.concatenate([per_set[n][1] for n in other]), alpha=alpha,
                                             delta=DELTA)
                d = decide(rule, conf, ok)
                d["exceeds"] = d["risk"] is not None and d["risk"] > alpha
                row["tasks"][name] = d
                decisions[(method, alpha, name)] = rule.answers(conf)
            rows[f"{alpha:g}"] = row
        table[method] = rows
        print(f"{args.model} {method}: done", file=sys.stderr, flush=True)
    for method in METHODS[1:]:  # coverage against the uncalibrated model's, question by question
        for alpha in ALPHAS:
            for name in evaluated:
                table[method][f"{alpha:g}"]["tasks"][name]["coverage_vs_uncalibrated"] = paired_coverage(
                    decisions[(method, alpha, name)], decisions[("uncalibrated", alpha, name)])
    accuracy = {name: float(score_answers(None, a, backbone.logits)[1].mean()) for name, a in evaluated.items()}
    return {"command": command_line(None), "machine": machine(), "model": args.model,
            "sizes": {"pool": pool.pool_size, "mmlu_pool": pool.mmlu_per_subject, "held_out": args.held_out,
                      "mmlu_held_out": args.mmlu_held_out, "mmlu": args.mmlu, "triviaqa": args.triviaqa,
                      "truthfulqa": args.truthfulqa, "instruction_limit": args.instruction_limit},
            "alphas": list(ALPHAS), "delta": DELTA, "certified_on": list(CERTIFY), "accuracy": accuracy,
            "n": {name: len(a) for name, a in evaluated.items()}, "results": table,
            "seconds": time.perf_counter() - started}


REPORTED = ("triviaqa", "truthfulqa_gen", "mmlu", "truthfulqa_mc1")
LEFT_OUT = ("nq_open_held_out", "triviaqa_pool_held_out", "mc_sciq_likelihood_held_out",
            "mc_social_iqa_likelihood_held_out", "mc_boolq_likelihood_held_out", "mc_winogrande_likelihood_held_out",
            "mmlu_validation_held_out")


def _cell(d: dict, alpha: float) -> str:
    if d["risk"] is None:
        return "0% / -"
    lo, hi = d["risk_ci"]
    flag = " **over**" if lo > alpha else (" over" if d["risk"] > alpha else "")
    return f"{100 * d['coverage']:.0f}% / {d['risk']:.2f} [{lo:.2f}, {hi:.2f}]{flag}"


def model_markdown(result: dict) -> list[str]:
    """One model's section: certification, then realised coverage / risk on every other set per target risk."""
    lines = [f"## {result['model']}", "", "Accuracy (uncalibrated answers; the same for every method): " + ", ".join(
        f"{name} {acc:.2f} (n={result['n'][name]})" for name, acc in result["accuracy"].items()) + ".", "",
        f"Certified on the held-out free-form pool answers ({' + '.join(result['certified_on'])}, n = "
        f"{sum(result['n'][n] for n in result['certified_on'])}); coverage there at the certified threshold, and how "
        f"often a threshold certified on a random half exceeded alpha on the other half (200 halvings; the "
        f"guarantee allows delta = {result['delta']:g}):", "",
        "| method | " + " | ".join(f"alpha {a:g}" for a in result["alphas"]) + " |",
        "|---|" + "---:|" * len(result["alphas"])]
    for method, rows in result["results"].items():
        cells = []
        for a in result["alphas"]:
            r = rows[f"{a:g}"]
            t, h = r["threshold"], r["halvings"]
            cov = "abstain" if t["threshold"] is None else f"{100 * t['coverage']:.0f}% (t={t['threshold']:.3f})"
            cells.append(f"{cov}; halves over {h['exceed_rate']:.2f}")
        lines.append(f"| {method} | " + " | ".join(cells) + " |")
    for group, names in (("reported tasks (never trained, selected or certified on)", REPORTED),
                         ("pool tasks left out of the certification (free-form: certified on the other one alone)",
                          LEFT_OUT)):
        lines += ["", f"Realised coverage / risk [95% Clopper-Pearson] on the {group}; 'over': risk above alpha, "
                      "**over**: even the interval's lower end is above it.", ""]
        for a in result["alphas"]:
            lines += [f"alpha = {a:g}:", "", "| method | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
            for method, rows in result["results"].items():
                tasks = rows[f"{a:g}"]["tasks"]
                lines.append(f"| {method} | " + " | ".join(_cell(tasks[n], a) for n in names) + " |")
            lines.append("")
    lines += ["Exceedances over all reported and left-out sets (risk above alpha / interval entirely above alpha, "
              "of the sets where anything was answered):", "", "| method | " + " | ".join(
                  f"alpha {a:g}" for a in result["alphas"]) + " |", "|---|" + "---:|" * len(result["alphas"])]
    for method, rows in result["results"].items():
        cells = []
        for a in result["alphas"]:
            ds = [rows[f"{a:g}"]["tasks"][n] for n in REPORTED + LEFT_OUT]
            answered = [d for d in ds if d["risk"] is not None]
            over = sum(d["risk"] > a for d in answered)
            sure = sum(d["risk_ci"][0] > a for d in answered)
            cells.append(f"{over} / {sure} of {len(answered)}")
        lines.append(f"| {method} | " + " | ".join(cells) + " |")
    return lines + [""]


def write_report(out: Path) -> None:
    """README.md in `out` from every model's JSON there."""
    results = [json.loads(p.read_text()) for p in sorted(out.glob("*.json"))]
    if not results:
        return
    lines = ["# Answer or abstain: certified thresholds on the embedded models", "",
             "Commands: " + "; ".join(f"`{r['command']}`" for r in results) + f". Machine: {results[0]['machine']}.",
             "", "Method and protocol: the docstring of `benchmarks/selective.py`. Sizes: " + "; ".join(
                 f"{r['model']}: {r['sizes']}" for r in results) + ".", ""]
    for r in results:
        lines += model_markdown(r)
    analysis = out / "analysis.md"
    if analysis.exists():
        lines += [analysis.read_text()]
    (out / "README.md").write_text("\n".join(lines))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--pool-size", type=int, default=AnswerPool().pool_size, help="training pool per task")
    p.add_argument("--mmlu-pool", type=int, default=AnswerPool().mmlu_per_subject)
    p.add_argument("--held-out", type=int, default=300, help="held-out questions per pool task")
    p.add_argument("--mmlu-held-out", type=int, default=5, help="held-out MMLU validation questions per subject")
    p.add_argument("--mmlu", type=int, default=3, help="reported MMLU test questions per subject")
    p.add_argument("--triviaqa", type=int, default=400)
    p.add_argument("--truthfulqa", type=int, default=300)
    p.add_argument("--instruction-limit", type=int, default=300, help="Alpaca-GPT4 examples of the paper's head")
    p.add_argument("--work", default="runs/selective", help="answer caches and heads (resumable)")
    p.add_argument("--out", default=str(RESULTS), help="writes OUT/MODEL.json")
    p.add_argument("--report", action="store_true", help="only rewrite OUT/README.md from the JSON files there")
    args = p.parse_args(argv)
    out = Path(args.out)
    if args.report:
        write_report(out)
        return 0
    result = run(args)
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / f"{args.model}.json", result)
    write_report(out)
    print(json.dumps({m: {a: r["threshold"]["coverage"] for a, r in rows.items()}
                      for m, rows in result["results"].items()}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
