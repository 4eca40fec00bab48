"""`ats certify`'s default start coverage, chosen on answers that are never reported and checked on answers that are.

Fixed-sequence testing (`certify_threshold`) tests thresholds from the most confident answer down and stops at the
first that fails, so a few wrong answers among the very most confident end it before it reaches the thresholds that
would pass (benchmarks/results/certify_served.md: the 1.5B model's top 10 answers are half wrong). Starting the
sequence at a fixed coverage s keeps the guarantee (s is fixed before any answer is judged) and skips that noisy top,
at the price of never answering fewer than s of the questions. Which s is a good default is an empirical question,
so it is chosen here once, on some answers, and the choice is then measured on others:

1. **Selection** (`--select`, qwen2.5-coder-1.5b-instruct, `--select-skip 300`): the model's served answers to the
   300 NQ-open and 300 TriviaQA pool questions that come after the test's (the next ones of the same permutations:
   the same mix, no question shared), made exactly as benchmarks/certify_served.py makes its answers (`ats train`'s
   default calibrator, answered as `ats serve` answers; qa_pool questions, which the data's README allows selecting
   on). For each s of `GRID`: 200 seeded halvings, the same splits for every s; certify on one half (delta 0.1) at
   every target risk of `TARGETS`, measure coverage on the other. The score of s is Thermometer's (the default
   calibrator's) held-out coverage averaged over halvings and targets; the default is the s with the highest score,
   the smallest on a tie. None of the test's answers enters that choice. (Planned first on
   qwen2.5-coder-0.5b-instruct's answers: right on 5.5% of them, they certify no target risk below 1 from any start,
   so they cannot choose; `--select qwen2.5-coder-0.5b-instruct --select-skip 0` redoes that.)
2. **Test** (`--test`, qwen2.5-coder-1.5b-instruct: the answers reported in certify_served.md): the chosen s
   against 0 (the sequence starting at the fewest answers that can certify) on the same answers, per target risk:
   the coverage certified on all of them, with a 95% paired bootstrap interval over questions (each resample
   certified both ways); the held-out coverage on the same 200 halvings (mean, 2.5-97.5% range of the difference,
   how often a half's realised risk exceeds the target and how often beyond its 95% interval); and the smallest
   certifiable target risk.
3. **Per target** (added after the default was chosen): what `ats certify --start-coverage choose` does with these
   answers, whose selection set is exactly the one it would answer (the `--size` questions per task after the
   certification ones, in the same order): at each target risk, the start `start_choice.choose_start` picks on the
   selection answers at that target alone (ties to the default), then the coverage certified on the test answers
   from it against the default 0.3, with a 95% paired bootstrap interval over the test questions (the choice is
   fixed before the test answers are used, as in `ats certify`).

    ATS_DATA_DIR=../shared/data python benchmarks/start_coverage.py   # selection and test answers, cached
    python benchmarks/start_coverage.py --report     # the analysis again from OUT.json's answers, in minutes

Writes benchmarks/results/start_coverage.md and .json (every answer's two confidences and correctness).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
from bench_generation import command_line, machine, save_results
from certify_served import DELTA, METHODS, answer_all, arrays
from selective import decide, paired_halvings

from ats.evaluation.report import markdown_table
from ats.evaluation.start_choice import HALVINGS, START_GRID, choose_start
from ats.evaluation.start_coverage import DEFAULT_START_COVERAGE
from ats.evaluation.threshold import certify_threshold, smallest_certifiable_risk
from ats.io import read_json

RESULTS = Path(__file__).resolve().parent / "results" / "start_coverage"
GRID = START_GRID  # start coverages tried, fixed before any answer was read
TARGETS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)  # every target risk a user may pick, weighted alike
RESAMPLES = 1000
SELECTED_ON = "thermometer"  # the default calibrator's confidence chooses the default


def held_out_coverage(conf: dict[str, np.ndarray], correct: np.ndarray, start: float,
                      halvings: int = HALVINGS) -> dict[str, dict[str, list[float]]]:
    """Per method and target risk, the other half's coverage on each of `halvings` seeded halvings (the same splits
    for every start, target and method: `selective.paired_halvings`), with the counts of exceedances."""
    out: dict[str, dict] = {m: {} for m in conf}
    for target in TARGETS:
        got = paired_halvings(conf, correct, target, repeats=halvings, start_coverage=start)
        for m, v in got.items():
            out[m][str(target)] = {"coverage": [float(c) for c in v["coverage"]], "certified": v["certified"],
                                   "exceed": int(v["exceed"]), "beyond_noise": int(v["beyond_noise"])}
    return out


def select(conf: dict[str, np.ndarray], correct: np.ndarray, halvings: int = HALVINGS) -> dict:
    """Step 1: every start's score per method (mean held-out coverage over halvings and targets:
    `start_choice.choose_start`, the rule `ats certify --start-coverage choose` applies) and the chosen start (the
    highest `SELECTED_ON` score; on a tie the default at the time, 0)."""
    choices = {m: choose_start(c, correct, target_risks=TARGETS, delta=DELTA, grid=GRID, halvings=halvings,
                               prefer=0.0) for m, c in conf.items()}
    scores = {str(start): {m: {"score": ch.score(start),
                               "per_target": {str(t): v for t, v in ch.coverage[start].items()}}
                           for m, ch in choices.items()}
              for start in GRID}
    return {"scores": scores, "chosen": choices[SELECTED_ON].start}


def certified_coverage(conf: np.ndarray, correct: np.ndarray, target: float, start: float) -> float:
    """The coverage of the threshold certified on these answers themselves (0 when none is)."""
    t = certify_threshold(conf, correct, target_risk=target, delta=DELTA, start_coverage=start)
    return 0.0 if t.threshold is None else float(t.coverage)


def paired_bootstrap(conf: np.ndarray, correct: np.ndarray, target: float, start: float,
                     resamples: int = RESAMPLES, *, against: float = 0.0) -> dict:
    """Certified coverage started at `start` minus started at `against` on these answers, with a 95% paired bootstrap
    interval (each resample of the questions certified both ways) and the fractions of resamples where it is above
    and below 0 (a certificate is all or nothing, so the resampled differences pile up at 0 and far from it)."""
    rng = np.random.default_rng(0)
    diffs = []
    for _ in range(resamples):
        idx = rng.integers(0, correct.size, correct.size)
        diffs.append(certified_coverage(conf[idx], correct[idx], target, start)
                     - certified_coverage(conf[idx], correct[idx], target, against))
    diff = certified_coverage(conf, correct, target, start) - certified_coverage(conf, correct, target, against)
    return {"diff": diff, "ci": [float(np.quantile(diffs, 0.025)), float(np.quantile(diffs, 0.975))],
            "above": float(np.mean(np.asarray(diffs) > 0)), "below": float(np.mean(np.asarray(diffs) < 0))}


def choose_per_target(select_conf: dict[str, np.ndarray], select_correct: np.ndarray, conf: dict[str, np.ndarray],
                      correct: np.ndarray, halvings: int = HALVINGS, resamples: int = RESAMPLES) -> dict:
    """Step 3, what `ats certify --start-coverage choose` does at each target risk: the start chosen on the
    selection answers at that target alone (`choose_start`, ties to the default), then certified on the test
    answers, against the default start on the same answers (paired bootstrap over the test questions; the choice is
    fixed, as it is before certification)."""
    out = {}
    for m in conf:
        per = {}
        for target in TARGETS:
            start = choose_start(select_conf[m], select_correct, target_risks=(target,), delta=DELTA, grid=GRID,
                                 halvings=halvings).start
            per[str(target)] = {"start": start,
                                "coverage": certified_coverage(conf[m], correct, target, start),
                                "default": certified_coverage(conf[m], correct, target, DEFAULT_START_COVERAGE),
                                "paired": paired_bootstrap(conf[m], correct, target, start, resamples,
                                                           against=DEFAULT_START_COVERAGE)}
        out[m] = {"targets": per}
    return out


def test(conf: dict[str, np.ndarray], correct: np.ndarray, start: float, halvings: int = HALVINGS,
         resamples: int = RESAMPLES) -> dict:
    """Step 2: `start` against 0 on the test model's answers, per method and target risk."""
    if start == 0.0:
        return {}
    chosen, zero = (held_out_coverage(conf, correct, s, halvings) for s in (start, 0.0))
    out = {}
    for m, c in conf.items():
        per = {}
        for target in TARGETS:
            key = str(target)
            full = {str(s): {**decide(t, c, correct), "threshold": t.threshold}
                    for s in (start, 0.0)
                    for t in [certify_threshold(c, correct, target_risk=target, delta=DELTA, start_coverage=s)]}
            diff = np.subtract(chosen[m][key]["coverage"], zero[m][key]["coverage"])
            per[key] = {"all": full, "paired": paired_bootstrap(c, correct, target, start, resamples),
                        "halvings": {str(s): {k: v for k, v in h[m][key].items() if k != "coverage"}
                                     | {"mean_coverage": float(np.mean(h[m][key]["coverage"]))}
                                     for s, h in ((start, chosen), (0.0, zero))},
                        "halvings_diff": {"mean": float(diff.mean()), "range": [float(np.quantile(diff, 0.025)),
                                                                                float(np.quantile(diff, 0.975))]}}
        out[m] = {"targets": per,
                  "smallest_risk": {str(s): smallest_certifiable_risk(c, correct, DELTA, start_coverage=s)
                                    for s in (start, 0.0)}}
    return out


def analyse(select_rows: list[dict], test_rows: list[dict], *, halvings: int = HALVINGS,
            resamples: int = RESAMPLES) -> dict:
    """The three steps from the saved answers."""
    chosen = select(*arrays(select_rows), halvings)
    conf, correct = arrays(test_rows)
    return {"selection": chosen, "test": test(conf, correct, chosen["chosen"], halvings, resamples),
            "choose": choose_per_target(*arrays(select_rows), conf, correct, halvings, resamples),
            "accuracy": {"selection": float(np.mean([r["correct"] for r in select_rows])),
                         "test": float(correct.mean())}}


def _smallest(v: float | None) -> str:
    return "-" if v is None else f"{v:.3f}"


def markdown(result: dict) -> str:
    """The results page."""
    a, s = result["analysis"], result["analysis"]["selection"]
    chosen = s["chosen"]
    lines = ["# `ats certify`'s default start coverage: chosen on some answers, tested on others", "",
             f"Command: `{result['command']}`", "",
             f"Machine: {result['machine']['cpu']}, {result['machine']['cores']} cores. Method: the docstring of "
             "`benchmarks/start_coverage.py` (delta 0.1; target risks " + ", ".join(f"{t:g}" for t in TARGETS)
             + f"; {HALVINGS} halvings).", "",
             f"## Selection: {result['select']} ({len(result['answers']['select'])} served answers to the questions "
             f"after the first {result['select_skip']} per task, accuracy "
             f"{a['accuracy']['selection']:.3f})", "",
             "Held-out coverage per start (mean over halvings and target risks; per target in the JSON). Chosen "
             f"(highest {SELECTED_ON} score): **{chosen:g}**.", "",
             markdown_table(["start coverage"] + [f"{m} score" for m in METHODS],
                            [[f"{float(k):g}"] + [f"{v[m]['score']:.4f}" for m in METHODS]
                             for k, v in s["scores"].items()]), ""]
    lines += [f"## Test: {result['test']} ({len(result['answers']['test'])} served answers, accuracy "
              f"{a['accuracy']['test']:.3f})", ""]
    if not a["test"]:
        lines += ["The chosen start is 0, the current default: nothing to test.", ""]
    for m, t in a["test"].items():
        sm = t["smallest_risk"]
        lines += [f"### {m}: start {chosen:g} against 0", "",
                  f"Smallest certifiable target risk: {_smallest(sm[str(chosen)])} (start {chosen:g}) against "
                  f"{_smallest(sm['0.0'])} (0).", ""]
        rows = []
        for target, v in t["targets"].items():
            full, half = v["all"], v["halvings"]
            rows.append([target, f"{full[str(chosen)]['coverage']:.3f}", f"{full['0.0']['coverage']:.3f}",
                         f"{v['paired']['diff']:+.3f} [{v['paired']['ci'][0]:+.3f}, {v['paired']['ci'][1]:+.3f}]",
                         f"{v['paired']['above']:.3f} / {v['paired']['below']:.3f}",
                         f"{half[str(chosen)]['mean_coverage']:.3f}", f"{half['0.0']['mean_coverage']:.3f}",
                         f"{v['halvings_diff']['mean']:+.3f} [{v['halvings_diff']['range'][0]:+.3f}, "
                         f"{v['halvings_diff']['range'][1]:+.3f}]",
                         f"{half[str(chosen)]['exceed']}/{half[str(chosen)]['certified']}, "
                         f"{half[str(chosen)]['beyond_noise']}"])
        lines += [markdown_table(["target risk", f"coverage (all, {chosen:g})", "coverage (all, 0)",
                                  "difference [95% paired bootstrap]", "resamples above / below 0",
                                  f"coverage (halvings, {chosen:g})",
                                  "coverage (halvings, 0)", "difference [2.5-97.5% of halvings]",
                                  f"halves over target / certified, beyond noise ({chosen:g})"], rows), ""]
    lines += [f"## `ats certify --start-coverage choose`: the start chosen per target risk on the selection answers, "
              f"certified on the test answers, against the default {DEFAULT_START_COVERAGE:g}", ""]
    for m, t in a.get("choose", {}).items():
        rows = [[target, f"{v['start']:g}", f"{v['coverage']:.3f}", f"{v['default']:.3f}",
                 f"{v['paired']['diff']:+.3f} [{v['paired']['ci'][0]:+.3f}, {v['paired']['ci'][1]:+.3f}]",
                 f"{v['paired']['above']:.3f} / {v['paired']['below']:.3f}"] for target, v in t["targets"].items()]
        lines += [f"### {m}", "", markdown_table(["target risk", "chosen start", "coverage (chosen)",
                                                  f"coverage ({DEFAULT_START_COVERAGE:g})",
                                                  "difference [95% paired bootstrap]", "resamples above / below 0"],
                                                 rows), ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--select", default="qwen2.5-coder-1.5b-instruct", help="the model the default is chosen on")
    p.add_argument("--select-skip", type=int, default=300,
                   help="its answers to the --size questions per task after the first this many (default: after the "
                        "test's, so selection and test share no question)")
    p.add_argument("--test", default="qwen2.5-coder-1.5b-instruct", help="the model the choice is tested on")
    p.add_argument("--size", type=int, default=300, help="certification questions per task (ats certify's --size)")
    p.add_argument("--work", default="runs/certify_served", help="training runs and served answers (resumable; "
                                                                  "shared with certify_served.py)")
    p.add_argument("--out", default=str(RESULTS), help="writes OUT.md and OUT.json")
    p.add_argument("--report", action="store_true", help="only redo the analysis from OUT.json's answers")
    args = p.parse_args(argv)
    out = Path(args.out)
    if args.report:
        result = read_json(out.with_suffix(".json"))
    else:
        keep = ("task", "index", "correct", *METHODS.values())
        runs = {"select": (args.select, args.select_skip), "test": (args.test, 0)}
        if runs["select"] == runs["test"]:
            raise SystemExit("--select-skip 0 with --select the --test model: selection and test would be the same "
                             "answers")
        answers = {role: [{k: r[k] for k in keep} for r in answer_all(model, Path(args.work) / model, args.size,
                                                                        skip)["rows"]]
                   for role, (model, skip) in runs.items()}
        result = {"command": command_line(argv), "machine": machine(), "select": args.select,
                  "select_skip": args.select_skip, "test": args.test, "answers": answers}
    result["analysis"] = analyse(result["answers"]["select"], result["answers"]["test"])
    save_results(out, result, markdown(result))
    print(out.with_suffix(".md").read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
