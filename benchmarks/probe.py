"""Does a correctness probe tell right answers from wrong ones better than the logit calibrators, and does its
certified threshold answer more at the same risk?

Per model (the three embedded instruct models), on the protocol of `benchmarks/selective.py` (its answer sets,
sizes and certification rule, shared code): the backbone answers the QA pool's training split, held-out pool
questions and the reported tasks once; every answer set is cached and fingerprinted, so a rerun resumes. Methods,
each fitted on the pool's training split only (or, for the paper's head, on instruction data):

- uncalibrated; temperature: one temperature trained on the answers (the control, `--method constant`);
- thermometer (`--method thermometer`); histogram: equal-mass binning of the uncalibrated answer confidence;
- ats-paper: the paper's transformer head on Alpaca-GPT4 instruction tokens;
- probe: `CorrectnessProbe`, its layers, views and L2 chosen by leaving each pool task out (training split only).

Reported (never trained or selected on): MMLU, TriviaQA, TruthfulQA MC1 and free-form. Leave-one-task-out: every
answer-trained method refitted without one pool task, scored on that task's held-out questions. Metrics: AUROC, PRR,
AURC, ECE, Brier, each with the probe's paired bootstrap interval against the best logit-based method on that set
(the one of highest PRR, lowest ECE, ...: the baselines' best case). Certification (`certify_threshold`, delta 0.1) at
target risks 0.2 / 0.3 / 0.4 per kind of answer, as `selective.analyse` does it.

    ATS_DATA_DIR=../shared/data python benchmarks/probe.py --model qwen2.5-coder-1.5b-instruct
    ATS_DATA_DIR=../shared/data python benchmarks/probe.py --report     # tables from OUT/scores in seconds
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

import numpy as np
from bench_generation import command_line, machine
from protocols.answers import baselines_on_answers
from selective import analyse, answer_head, model_markdown, paper_head, reported_tasks

from ats.calibrators import load_calibrator
from ats.evaluation.metrics import paired_differences, summarize
from ats.io import write_json
from ats.model.backbone import load_backbone
from ats.training.answers import score_answers
from ats.training.probe_fit import fit_probe
from ats.workflows.answer_pool import AnswerPool, held_out_tasks, pool_names, pool_tasks
from ats.workflows.pipeline import prepare_answers

METHODS = ("uncalibrated", "temperature", "thermometer", "histogram", "ats-paper", "probe")
LOGIT_METHODS = METHODS[:-1]
ALPHAS = (0.2, 0.3, 0.4)
METRICS = {"auroc": max, "prr": max, "aurc": min, "ece": min, "brier": min}  # the baselines' best case per metric
RESULTS = Path(__file__).parent / "results" / "probe"


def fit_methods(backbone, train: dict, pool: AnswerPool, heads: Path, paper) -> dict:
    """method -> (answer set -> (confidence, correct)), every method fitted on `train` (task name -> set)."""
    logits = backbone.logits
    sets = list(train.values())
    control = answer_head(backbone, "constant", sets, pool, heads / "temperature")
    thermometer = answer_head(backbone, "thermometer", sets, pool, heads / "thermometer")
    histogram = baselines_on_answers(sets, logits, control)["histogram-answers"]
    info = {"hidden_size": backbone.hidden_size, "base_model": backbone.name, "revision": backbone.revision}
    probe = fit_probe(train, logits, info, progress=False)
    probe.save_pretrained(heads / "probe")
    methods = {"uncalibrated": lambda a: score_answers(None, a, logits),
            "temperature": lambda a: score_answers(control, a, logits),
            "thermometer": lambda a: score_answers(thermometer, a, logits),
            "histogram": lambda a: (np.asarray(histogram(a), dtype=np.float64), score_answers(None, a, logits)[1]),
            "ats-paper": lambda a: score_answers(paper, a, logits),
            "probe": lambda a: score_answers(probe, a, logits)}
    if paper is None:  # --instruction-limit 0: no paper head (its extraction is the slowest step on large models)
        del methods["ats-paper"]
    return methods, probe


def _record(conf: np.ndarray, correct: np.ndarray) -> dict:
    return {"confidence": [float(c) for c in conf], "correct": [bool(c) for c in correct]}


def score_all(args) -> dict:
    """The expensive part, cached under --work: every method's (confidence, correct) on every answer set, and the
    leave-one-task-out scores."""
    work = Path(args.work) / args.model
    paper_folder = paper_head(args.model, work, args.instruction_limit) if args.instruction_limit else None
    backbone = load_backbone(args.model)
    paper = load_calibrator(paper_folder, backbone) if paper_folder else None
    pool = AnswerPool(pool_size=args.pool_size, mmlu_per_subject=args.mmlu_pool)

    def prepared(tasks: dict, where: str) -> dict:
        return {t.name: prepare_answers(backbone, t, work / "answers" / where / t.name, progress=True)
                for t in tasks.values()}
    train = prepared(pool_tasks(pool.pool_size, pool.mmlu_per_subject), "pool")
    held = {**prepared(held_out_tasks(pool, args.held_out, names=tuple(pool_names(1))[:4]
                                      + ("nq_open", "triviaqa_pool")), "held_out"),
            **(prepared(held_out_tasks(pool, args.mmlu_held_out, names=("mmlu_validation",)), "held_out")
               if args.mmlu_held_out else {})}
    reported = prepared(reported_tasks({"mmlu": args.mmlu, "triviaqa": args.triviaqa,
                                        "truthfulqa": args.truthfulqa}), "reported")
    methods, probe = fit_methods(backbone, train, pool, work / "heads" / "all", paper)
    evaluated = {**held, **reported}
    scores = {m: {name: _record(*score(a)) for name, a in evaluated.items()} for m, score in methods.items()}
    print(f"{args.model}: scored every set", file=sys.stderr, flush=True)
    left_out = {}
    for name in train:  # refit every answer-trained method without `name`, score its held-out questions
        fold, _ = fit_methods(backbone, {n: s for n, s in train.items() if n != name}, pool,
                              work / "heads" / f"without_{name}", paper)
        left_out[f"{name}_held_out"] = {m: _record(*score(held[f"{name}_held_out"])) for m, score in fold.items()}
        print(f"{args.model}: left out {name}", file=sys.stderr, flush=True)
    return {"model": args.model, "command": command_line(None), "machine": machine(),
            "sizes": {"pool": pool.pool_size, "mmlu_pool": pool.mmlu_per_subject, "held_out": args.held_out,
                      "mmlu_held_out": args.mmlu_held_out, "mmlu": args.mmlu, "triviaqa": args.triviaqa,
                      "truthfulqa": args.truthfulqa, "instruction_limit": args.instruction_limit},
            "probe": {"layers": probe.layers, "views": probe.views, "c": probe.c,
                      "temperature": probe.temperature, "selection": probe.selection},
            "scores": scores, "left_out": left_out}


def compare(by_method: dict, *, bootstrap: int) -> dict:
    """Per metric: every method's value on one set, the best logit-based one, and probe - best with its paired
    interval."""
    arrays = {m: (np.asarray(r["confidence"]), np.asarray(r["correct"], dtype=bool)) for m, r in by_method.items()}
    values = {m: summarize(*a) for m, a in arrays.items()}
    out = {"n": int(arrays["probe"][0].size), "values": values, "vs_best": {}}
    logit_methods = [m for m in LOGIT_METHODS if m in values]
    for key, better in METRICS.items():
        best = better(logit_methods, key=lambda m: values[m][key])
        diff = paired_differences(arrays["probe"], arrays[best], keys=(key,), bootstrap=bootstrap)[key]
        out["vs_best"][key] = {"best": best, **diff}
    return out


def analyse_probe(scored: dict, *, bootstrap: int = 1000) -> dict:
    """Ranking and calibration tables (reported tasks, held-out pool sets, left-out tasks) and the certification
    analysis of `selective.analyse` on this benchmark's methods and target risks."""
    scores = scored["scores"]
    sets = list(scores["uncalibrated"])
    methods = tuple(m for m in METHODS if m in scores)
    tables = {name: compare({m: scores[m][name] for m in methods}, bootstrap=bootstrap) for name in sets}
    left_out = {name: compare(by_method, bootstrap=bootstrap) for name, by_method in scored["left_out"].items()}
    certified = analyse(scored, methods=methods, alphas=ALPHAS, bootstrap=200)
    return {**{k: scored.get(k) for k in ("command", "machine", "model", "sizes", "seconds", "probe")},
            "tables": tables, "left_out": left_out, "certified": certified}


def _metric_table(tables: dict, names: list, key: str) -> list[str]:
    lines = [f"| {key} | " + " | ".join(f"{n} ({tables[n]['n']})" for n in names) + " |",
             "|---|" + "---:|" * len(names)]
    for m in (m for m in METHODS if m in tables[names[0]]["values"]):
        lines.append(f"| {m} | " + " | ".join(f"{tables[n]['values'][m][key]:.3f}" for n in names) + " |")
    cells = []
    for n in names:
        d = tables[n]["vs_best"][key]
        cells.append(f"{d['diff']:+.3f} [{d['ci'][0]:+.3f}, {d['ci'][1]:+.3f}]{'*' if d['excludes_zero'] else ''} "
                     f"vs {d['best']}")
    return lines + ["| probe - best logit method | " + " | ".join(cells) + " |", ""]


REPORTED = (("mmlu", "MMLU"), ("triviaqa", "TriviaQA"), ("truthfulqa_mc1", "TruthfulQA MC1"),
            ("truthfulqa_gen", "TruthfulQA free-form"))


def summary_table(results: list[dict]) -> list[str]:
    """One row per model and reported task: the probe's PRR and ECE against the best logit method's, paired, and
    how many tasks meet the targets (PRR above the best with its interval excluding 0; ECE within +0.01)."""
    def cell(t: dict, key: str) -> str:
        d = t["vs_best"][key]
        star = "*" if d["excludes_zero"] else ""
        return (f"{t['values']['probe'][key]:.3f} ({d['diff']:+.3f} [{d['ci'][0]:+.3f}, {d['ci'][1]:+.3f}]{star} "
                f"vs {d['best']} {t['values'][d['best']][key]:.3f})")

    lines = ["| model | task | n | accuracy | uncalibrated PRR | probe PRR (- best logit method) | "
             "probe ECE (- best logit method) |", "|---|---|---:|---:|---:|---|---|"]
    for r in results:
        tasks = [(key, name) for key, name in REPORTED if key in r["tables"]]
        for key, name in tasks:
            t = r["tables"][key]
            lines.append(f"| {r['model']} | {name} | {t['n']} | {t['values']['probe']['accuracy']:.2f} | "
                         f"{t['values']['uncalibrated']['prr']:.3f} | {cell(t, 'prr')} | {cell(t, 'ece')} |")
        prr = sum(r["tables"][k]["vs_best"]["prr"]["diff"] > 0 and r["tables"][k]["vs_best"]["prr"]["excludes_zero"]
                  for k, _ in tasks)
        ece = sum(r["tables"][k]["vs_best"]["ece"]["diff"] <= 0.01 for k, _ in tasks)
        lines.append(f"| {r['model']} | targets | | | | PRR above the best, interval excluding 0: {prr} of "
                     f"{len(tasks)} | ECE within +0.01 of the best: {ece} of {len(tasks)} |")
    return lines + [""]


def write_report(out: Path) -> None:
    """OUT/analysis/MODEL.json and OUT/README.md from every model's scores in OUT/scores/."""
    scored = [json.loads(p.read_text()) for p in sorted((out / "scores").glob("*.json"))]
    results = [analyse_probe(s) for s in scored]
    for r in results:
        write_json(out / "analysis" / f"{r['model']}.json", r)
    lines = ["# Correctness probes against logit calibrators", "",
             "Method and protocol: the docstring of `benchmarks/probe.py`. Every question's confidence and correctness "
             "per method: `scores/MODEL.json` (`python benchmarks/probe.py --report` redoes everything below). * marks "
             "a paired 95% bootstrap interval (1,000 resamples) that excludes 0.", ""]
    lines += ["## Summary: the reported tasks (nothing trained or selected on them)", "",
              "Each model's sizes and the probe it chose are under its own heading below.", ""]
    lines += summary_table(results)
    if (out / "analysis.md").exists():
        lines += [(out / "analysis.md").read_text(), ""]
    for r in results:
        reported = [n for n in ("mmlu", "triviaqa", "truthfulqa_mc1", "truthfulqa_gen") if n in r["tables"]]
        held = [n for n in r["tables"] if n.endswith("_held_out")]
        lines += [f"## {r['model']}", "", f"Command: `{r['command']}`. Machine: {r['machine']}. Sizes: {r['sizes']}.",
                  f"Probe chosen on the pool (leave one pool task out): layers {r['probe']['layers']}, views "
                  f"{r['probe']['views']}, C = {r['probe']['c']:g} (confidence-only when no layers); token temperature "
                  f"{r['probe']['temperature']:.3f}.", "", "### Reported tasks (nothing trained or selected on them)", ""]
        for key in METRICS:
            lines += _metric_table(r["tables"], reported, key)
        lines += ["### Each pool task left out (every answer-trained method refitted without it)", ""]
        for key in ("prr", "auroc", "ece"):
            lines += _metric_table(r["left_out"], list(r["left_out"]), key)
        lines += ["### Held-out pool questions (the certification sets; methods trained on every pool task)", ""]
        for key in ("prr", "ece"):
            lines += _metric_table(r["tables"], held, key)
        lines += model_markdown(r["certified"])[1:]
    out.mkdir(parents=True, exist_ok=True)
    (out / "README.md").write_text("\n".join(lines))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    p.add_argument("--pool-size", type=int, default=AnswerPool().pool_size, help="training pool per task")
    p.add_argument("--mmlu-pool", type=int, default=AnswerPool().mmlu_per_subject)
    p.add_argument("--held-out", type=int, default=100, help="held-out questions per pool task")
    p.add_argument("--mmlu-held-out", type=int, default=2,
                   help="held-out MMLU validation questions per subject; 0: none")
    p.add_argument("--mmlu", type=int, default=2, help="reported MMLU test questions per subject")
    p.add_argument("--triviaqa", type=int, default=200)
    p.add_argument("--truthfulqa", type=int, default=200)
    p.add_argument("--instruction-limit", type=int, default=300,
                   help="Alpaca-GPT4 examples of the paper's head; 0: no paper head")
    p.add_argument("--work", default="runs/probe", help="answer caches and heads (resumable)")
    p.add_argument("--out", default=str(RESULTS))
    p.add_argument("--report", action="store_true", help="only redo OUT/analysis and OUT/README.md from OUT/scores")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    out = Path(args.out)
    if not args.report:
        started = time.perf_counter()
        scored = score_all(args)
        scored["seconds"] = time.perf_counter() - started
        write_json(out / "scores" / f"{args.model}.json", scored)
    write_report(out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
