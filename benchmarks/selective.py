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

For each method, kind of answer and target risk alpha (delta = 0.1), the threshold is certified (`certify_threshold`:
Clopper-Pearson, fixed-sequence testing) on the held-out pool answers of that kind: free-form (NQ-open and TriviaQA
pool questions: the kind of answer `ats serve` decides on) or multiple-choice (SciQ, Social IQa, BoolQ, WinoGrande,
MMLU validation). It is then applied to every other answer set: realised risk (error rate among the answered) and
coverage. A pool set of the certifying kind is judged with the threshold certified on the other sets of that kind
(left out); the reported tasks and the sets of the other kind were never in it. Within the certification
distribution the guarantee is checked directly: 200 random halvings, certify on one half, measure on the other.

Scoring the answers is the slow part (an hour and more per model on 2 cores); every question's confidence and
correctness per method is stored (`OUT/scores/MODEL.json`), so the analysis (`--report`) is redone in seconds.

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
from ats.evaluation.metrics import paired_differences
from ats.evaluation.selective import aurc, prr
from ats.evaluation.start_choice import halves
from ats.evaluation.tasks import MMLUTask, TriviaQATask, TruthfulQAGenTask, TruthfulQAMC1Task
from ats.evaluation.threshold import certify_threshold, clopper_pearson_upper
from ats.io import write_json
from ats.model.backbone import load_backbone
from ats.model.heads.config import MAX_SCALE
from ats.training.answers import score_answers
from ats.training.config import TrainingConfig
from ats.workflows.answer_methods import answer_head_record, reusable_answer_head, train_spec
from ats.workflows.answer_pool import FREE_FORM, AnswerPool, held_out_tasks, pool_names, pool_tasks
from ats.workflows.pipeline import prepare_answers

ALPHAS = (0.1, 0.2, 0.3, 0.5, 0.7, 0.8, 0.9)
DELTA = 0.1
METHODS = ("uncalibrated", "control", "thermometer", "ats-paper", "histogram")
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
    """A calibrator of `kind` trained on the pool's answers with `ats train --on answers`' defaults; reused only when
    its training record matches (`reusable_answer_head`, the CLI's rule; a head trained otherwise is refused, naming
    what differs). The pool's sizes are guarded one step earlier: its cached answer sets refuse another size."""
    training = TrainingConfig(loss_type="answer-log")
    record = answer_head_record(training, pool, False, tasks=[a.name for a in sets])  # those it trains on
    if reusable_answer_head(folder, record, head_type=kind, max_scale=MAX_SCALE, overwrite=False):
        return load_calibrator(folder, backbone)
    calibrator = train_spec(backbone, sets, pool, kind=kind, tokens=False, training=training,
                            method=f"{kind}-answers")
    calibrator.save_pretrained(folder)
    return calibrator


def decide(threshold, conf: np.ndarray, correct: np.ndarray) -> dict:
    """Coverage and realised risk of `threshold` on these answers, the risk with its two-sided 95% Clopper-Pearson
    interval (so an exceedance can be told from noise): each end the library's one-sided 97.5% bound, on the errors
    (upper) and on the right answers (lower = 1 - their upper bound)."""
    answered = threshold.answers(conf)
    k, n = int((~correct[answered]).sum()), int(answered.sum())
    ci = None
    if n:
        upper = clopper_pearson_upper([k, n - k], [n, n], 0.025)
        ci = [float(1.0 - upper[1]), float(upper[0])]
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
    got = paired_halvings({"method": conf}, correct, alpha, repeats=repeats)["method"]
    return {"repeats": repeats, "certified": got["certified"], "exceed": got["exceed"],
            "exceed_rate": got["exceed"] / repeats, "mean_coverage": float(np.mean(got["coverage"]))}


def paired_halvings(conf: dict[str, np.ndarray], correct: np.ndarray, alpha: float, *, repeats: int = 200,
                    start_coverage: float = 0.0) -> dict[str, dict]:
    """`repeats` seeded random halvings, the same split for every method: certify on one half (`certify_threshold`
    with `start_coverage`), measure on the other. Per method: halvings certified, those whose other half's error
    rate exceeds alpha (`exceed`) and whose 95% interval lies entirely above it (`beyond_noise`), and the other
    half's coverage per halving (`coverage`, in split order: paired across methods)."""
    out = {m: {"certified": 0, "exceed": 0, "beyond_noise": 0, "coverage": []} for m in conf}
    for a, b in halves(correct.size, repeats):
        for method, c in conf.items():
            t = certify_threshold(c[a], correct[a], target_risk=alpha, delta=DELTA, start_coverage=start_coverage)
            d = decide(t, c[b], correct[b])
            out[method]["coverage"].append(d["coverage"])
            if d["risk"] is not None:
                out[method]["certified"] += 1
                out[method]["exceed"] += d["risk"] > alpha
                out[method]["beyond_noise"] += d["risk_ci"][0] > alpha
    return out


KINDS = {  # certification set per kind of answer: the held-out pool answers of that kind
    "free-form": tuple(f"{n}_held_out" for n in FREE_FORM),
    "multiple-choice": ("mc_sciq_likelihood_held_out", "mc_social_iqa_likelihood_held_out",
                        "mc_boolq_likelihood_held_out", "mc_winogrande_likelihood_held_out",
                        "mmlu_validation_held_out"),
}
REPORTED = {"free-form": ("triviaqa", "truthfulqa_gen"), "multiple-choice": ("mmlu", "truthfulqa_mc1")}


def score_all(args) -> dict:
    """The expensive part, cached under --work: every method's (confidence, correct) on every answer set."""
    work = Path(args.work) / args.model
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
    evaluated = {**held_sets, **reported}
    scores = {}
    for method in METHODS:
        scores[method] = {}
        for name, answers in evaluated.items():
            conf, correct = score_answers(calibrators.get(method), answers, backbone.logits)
            if method == "histogram":
                conf = np.asarray(histogram(answers), dtype=np.float64)
            scores[method][name] = {"confidence": [float(c) for c in conf],  # full precision: ties are real ones
                                    "correct": [bool(c) for c in correct]}
        print(f"{args.model} {method}: scored", file=sys.stderr, flush=True)
    return {"model": args.model, "command": command_line(None), "machine": machine(),
            "sizes": {"pool": pool.pool_size, "mmlu_pool": pool.mmlu_per_subject, "held_out": args.held_out,
                      "mmlu_held_out": args.mmlu_held_out, "mmlu": args.mmlu, "triviaqa": args.triviaqa,
                      "truthfulqa": args.truthfulqa, "instruction_limit": args.instruction_limit},
            "scores": scores}


def analyse(scored: dict, *, repeats: int = 200, bootstrap: int = 500, methods: tuple = METHODS,
            alphas: tuple = ALPHAS) -> dict:
    """The cheap part, from the stored scores: per kind of certification set and target risk, the certified
    threshold, the halvings check, and the realised coverage / risk on every answer set of both kinds (a pool set of
    the certifying kind is judged with the threshold certified on the other sets of that kind: left out), and the
    ranking table; `repeats` random halvings per threshold, `bootstrap` paired resamples per ranking difference.
    `methods` (the first is the reference, uncalibrated) and `alphas`: those of this benchmark unless given
    (`benchmarks/probe.py` gives its own)."""
    METHODS, ALPHAS = methods, alphas  # noqa: N806 (the module's names, shadowed by the caller's choice)
    scores = scored["scores"]

    def arrays(method: str, name: str) -> tuple[np.ndarray, np.ndarray]:
        s = scores[method][name]
        return np.asarray(s["confidence"], dtype=np.float64), np.asarray(s["correct"], dtype=bool)

    def pooled(method: str, names) -> tuple[np.ndarray, np.ndarray]:
        parts = [arrays(method, n) for n in names]
        return np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])

    names = list(scores["uncalibrated"])
    table, decisions = {}, {}
    kinds = {kind: tuple(n for n in certify_on if n in scores["uncalibrated"]) for kind, certify_on in KINDS.items()}
    for kind, certify_on in kinds.items():  # the certification sets this run made (MMLU's may be left out)
        table[kind] = {}
        for method in METHODS:
            cert_conf, cert_ok = pooled(method, certify_on)
            rows = {}
            for alpha in ALPHAS:
                threshold = certify_threshold(cert_conf, cert_ok, target_risk=alpha, delta=DELTA, start_coverage=0.0)
                row = {"threshold": threshold.to_dict(), "halvings": halvings(cert_conf, cert_ok, alpha, repeats),
                       "tasks": {}}
                for name in names:
                    conf, ok = arrays(method, name)
                    rule = threshold
                    if name in certify_on:  # left out: certified on the other sets of this kind
                        rule = certify_threshold(*pooled(method, [n for n in certify_on if n != name]),
                                                 target_risk=alpha, delta=DELTA, start_coverage=0.0)
                    d = decide(rule, conf, ok)
                    d["exceeds"] = d["risk"] is not None and d["risk"] > alpha
                    row["tasks"][name] = d
                    decisions[(kind, method, alpha, name)] = rule.answers(conf)
                rows[f"{alpha:g}"] = row
            table[kind][method] = rows
        for method in METHODS[1:]:  # coverage against the uncalibrated model's, question by question
            for alpha in ALPHAS:
                for name in names:
                    table[kind][method][f"{alpha:g}"]["tasks"][name]["coverage_vs_uncalibrated"] = \
                        paired_coverage(decisions[(kind, method, alpha, name)],
                                        decisions[(kind, "uncalibrated", alpha, name)])
    accuracy = {m: {n: float(arrays(m, n)[1].mean()) for n in names} for m in METHODS}
    ranking = {}  # how well each confidence orders answers, whatever the threshold: PRR, AURC, paired vs uncalibrated
    for n in names:
        ranking[n] = {}
        for m in METHODS:
            conf, ok = arrays(m, n)
            ranking[n][m] = {"prr": prr(conf, ok), "aurc": aurc(conf, ok)}
            if m != "uncalibrated":
                ranking[n][m]["vs_uncalibrated"] = paired_differences((conf, ok), arrays("uncalibrated", n),
                                                                      keys=("prr", "aurc"), bootstrap=bootstrap)
    return {**{k: scored.get(k) for k in ("command", "machine", "model", "sizes", "seconds")}, "alphas": list(ALPHAS),
            "delta": DELTA, "certified_on": {k: list(v) for k, v in kinds.items()}, "accuracy": accuracy,
            "ranking": ranking, "n": {n: len(scores["uncalibrated"][n]["correct"]) for n in names}, "results": table}


def _cell(d: dict, alpha: float) -> str:
    if d["risk"] is None:
        return "0% / -"
    lo, hi = d["risk_ci"]
    flag = " **over**" if lo > alpha else (" over" if d["risk"] > alpha else "")
    return f"{100 * d['coverage']:.0f}% / {d['risk']:.2f} [{lo:.2f}, {hi:.2f}]{flag}"


def _certified(row: dict) -> str:
    t, h = row["threshold"], row["halvings"]
    cov = "abstain" if t["threshold"] is None else f"{100 * t['coverage']:.0f}% (t={t['threshold']:.3f})"
    return f"{cov}; halves over {h['exceed_rate']:.2f}"


def model_markdown(result: dict) -> list[str]:
    """One model's section: per kind of certification set, the target risks where any method certified a
    threshold, with the realised coverage / risk on the left-out sets of that kind and the reported tasks."""
    n = result["n"]
    acc = result["accuracy"]
    lines = [f"## {result['model']}", "", "Accuracy (free-form answers are the model's own greedy ones for every "
             "method; a multiple-choice answer is the option of highest calibrated likelihood, which a scale on the "
             "logits can change):", "", "| method | " + " | ".join(n) + " |", "|---|" + "---:|" * len(n)]
    lines += [f"| {m} | " + " | ".join(f"{acc[m][s]:.2f}" for s in n) + " |" for m in acc]
    lines += ["", "Questions: " + ", ".join(f"{s} {k}" for s, k in n.items()) + ".", "",
              "How well each confidence orders its answers, whatever the threshold: PRR (1: the oracle order, 0: "
              "random; higher answers more at any risk) and, in brackets, its paired 95% bootstrap interval against "
              "the uncalibrated confidence (* where it excludes 0):", "",
              "| method | " + " | ".join(n) + " |", "|---|" + "---:|" * len(n)]
    for m in acc:
        cells = []
        for s in n:
            r = result["ranking"][s][m]
            cell = f"{r['prr']:.2f}"
            if "vs_uncalibrated" in r:
                d = r["vs_uncalibrated"]["prr"]
                cell += f" [{d['ci'][0]:+.2f}, {d['ci'][1]:+.2f}]" + ("*" if d["excludes_zero"] else "")
            cells.append(cell)
        lines.append(f"| {m} | " + " | ".join(cells) + " |")
    lines.append("")
    for kind, certify_on in result["certified_on"].items():
        other = next(k for k in result["certified_on"] if k != kind)
        rows = result["results"][kind]
        lines += [f"### Certified on the held-out {kind} pool answers ({' + '.join(certify_on)}, n = "
                  f"{sum(n[s] for s in certify_on)})", "",
                  "Coverage there at the certified threshold, and how often a threshold certified on a random half "
                  f"exceeded alpha on the other half (200 halvings; the guarantee allows delta = {result['delta']:g}):",
                  "", "| method | " + " | ".join(f"alpha {a:g}" for a in result["alphas"]) + " |",
                  "|---|" + "---:|" * len(result["alphas"])]
        lines += [f"| {m} | " + " | ".join(_certified(r[f"{a:g}"]) for a in result["alphas"]) + " |"
                  for m, r in rows.items()]
        useful = [a for a in result["alphas"] if any(r[f"{a:g}"]["threshold"]["threshold"] is not None
                                                     for r in rows.values())]
        lines += ["", f"Target risks where no method certifies any threshold (abstain always): "
                      f"{', '.join(f'{a:g}' for a in result['alphas'] if a not in useful) or 'none'}.", ""]
        if not useful:
            continue
        columns = [c for c in list(certify_on) + list(REPORTED[kind]) + list(REPORTED[other]) if c in n]
        lines += ["Realised coverage / risk [95% Clopper-Pearson]: the left-out pool sets of this kind (each judged "
                  "with the threshold certified on the others), the reported tasks of this kind, then the reported "
                  f"tasks of the other kind ({other}); 'over': risk above alpha, **over**: even the interval's lower "
                  "end is above it.", ""]
        for a in useful:
            lines += [f"alpha = {a:g}:", "", "| method | " + " | ".join(columns) + " |",
                      "|---|" + "---|" * len(columns)]
            lines += [f"| {m} | " + " | ".join(_cell(r[f"{a:g}"]["tasks"][c], a) for c in columns) + " |"
                      for m, r in rows.items()]
            lines.append("")
        lines += [f"Exceedances (risk above alpha / interval entirely above alpha, of the sets where anything was "
                  f"answered): same kind = the left-out {kind} pool sets and reported tasks; other kind = every "
                  f"{other} set (pool and reported):", "",
                  "| method | " + " | ".join(f"alpha {a:g} same / other" for a in useful) + " |",
                  "|---|" + "---:|" * len(useful)]
        same = [c for c in list(certify_on) + list(REPORTED[kind]) if c in n]
        cross = [c for c in list(result["certified_on"][other]) + list(REPORTED[other]) if c in n]
        for m, r in rows.items():
            cells = []
            for a in useful:
                parts = []
                for group in (same, cross):
                    answered = [d for d in (r[f"{a:g}"]["tasks"][s] for s in group) if d["risk"] is not None]
                    parts.append(f"{sum(d['risk'] > a for d in answered)} / "
                                 f"{sum(d['risk_ci'][0] > a for d in answered)} of {len(answered)}")
                cells.append(" ; ".join(parts))
            lines.append(f"| {m} | " + " | ".join(cells) + " |")
        lines.append("")
    return lines


def write_report(out: Path) -> None:
    """OUT/analysis/MODEL.json and OUT/README.md from every model's scores in OUT/scores/."""
    scored = [json.loads(p.read_text()) for p in sorted((out / "scores").glob("*.json"))]
    if not scored:
        return
    results = [analyse(s) for s in scored]
    for r in results:
        write_json(out / "analysis" / f"{r['model']}.json", r)
    lines = ["# Answer or abstain: certified thresholds on the embedded models", "",
             "Commands: " + "; ".join(f"`{r['command']}`" for r in results) + f". Machine: {results[0]['machine']}.",
             "", "Method and protocol: the docstring of `benchmarks/selective.py`. Sizes: " + "; ".join(
                 f"{r['model']}: {r['sizes']}" for r in results) + ". Every question's confidence and correctness "
             "per method: `scores/MODEL.json` (`python selective.py --report` redoes everything below from them).",
             ""]
    analysis = out / "analysis.md"
    if analysis.exists():
        lines += [analysis.read_text(), ""]
    for r in results:
        lines += model_markdown(r)
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
    p.add_argument("--out", default=str(RESULTS), help="writes OUT/scores/MODEL.json, OUT/analysis/MODEL.json")
    p.add_argument("--report", action="store_true", help="only redo the analysis and OUT/README.md from OUT/scores")
    args = p.parse_args(argv)
    out = Path(args.out)
    if args.report:
        write_report(out)
        return 0
    started = time.perf_counter()
    scored = score_all(args)
    scored["seconds"] = time.perf_counter() - started
    write_json(out / "scores" / f"{args.model}.json", scored)
    write_report(out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
