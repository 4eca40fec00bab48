"""The answer-trained heads' results as markdown and reliability diagrams (results of `protocols.answers`).

One block per task (metrics as columns, methods as rows): accuracy, mean confidence, ECE, Brier and AUROC with 95%
intervals (the mean and spread over seeds where there are several), then the paired differences "method minus
control" and "method minus uncalibrated" with their intervals; and the issue's targets checked per task.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from ats.evaluation.plots import reliability_figure
from ats.evaluation.report import cell, markdown_table
from ats.io import read_json

CHANCE = {"sciq": 0.25, "social_iqa": 1 / 3, "boolq": 0.5, "winogrande": 0.5, "mmlu_validation": 0.25, "mmlu": 0.25}


def _diff(entry: dict | None, key: str) -> str:
    if not entry or key not in entry:
        return "-"
    d = entry[key]
    mark = "*" if d["excludes_zero"] else ""
    return f"{d['diff']:+.3f} [{d['ci'][0]:+.3f}, {d['ci'][1]:+.3f}]{mark}"


def _seeded(entry: dict, key: str) -> str:
    runs = entry["seeds"]
    if len(runs) == 1:
        return cell(runs[0], key)
    return f"{entry['mean'][key]:.3f} ± {entry['spread'][key]:.3f}"


def task_block(name: str, task: dict) -> str:
    """One task's table: a row per method."""
    rows = []
    for method, entry in task["methods"].items():
        first = entry["seeds"][0]
        rows.append([method, f"{first['accuracy']:.3f}", f"{first['mean_confidence']:.3f}", _seeded(entry, "ece"),
                     _seeded(entry, "brier"), _seeded(entry, "auroc"),
                     _diff(entry.get("minus_control"), "ece"), _diff(entry.get("minus_control"), "auroc"),
                     _diff(entry.get("minus_uncalibrated"), "ece"), _diff(entry.get("minus_uncalibrated"), "auroc")])
    header = ["method", "acc", "conf", "ECE", "Brier", "AUROC", "ECE - control", "AUROC - control",
              "ECE - uncal.", "AUROC - uncal."]
    return f"### {name} ({task['n']} questions)\n\n" + markdown_table(header, rows)


def targets(name: str, task: dict, method: str = "ats-answers") -> str:
    """The issue's targets for `method` on one task, each marked met or not, with its numbers."""
    m = task["methods"]
    if method not in m or "control-answers" not in m:
        return f"- {name}: {method} or the control is missing"
    ece, base = m[method]["seeds"][0]["ece"], m["uncalibrated"]["seeds"][0]["ece"]
    vs_control = m[method]["minus_control"]["ece"]
    vs_base_auroc = m[method]["minus_uncalibrated"]["auroc"]
    others = [k for k in m if k not in ("uncalibrated", method, "control-answers") and "minus_control" in m[k]]
    beats = all(m[method]["seeds"][0]["ece"] < m[k]["seeds"][0]["ece"] for k in others)
    checks = [
        (ece <= 0.5 * base, f"ECE {ece:.3f} <= 0.5 x uncalibrated {base:.3f}"),
        (vs_control["diff"] < 0 and vs_control["excludes_zero"], f"below the control {vs_control['diff']:+.3f} "
         f"[{vs_control['ci'][0]:+.3f}, {vs_control['ci'][1]:+.3f}]"),
        (beats, "ECE below every other method" if beats else "ECE not below every other method"),
        (vs_base_auroc["diff"] >= 0.03 and vs_base_auroc["excludes_zero"],
         f"AUROC {vs_base_auroc['diff']:+.3f} [{vs_base_auroc['ci'][0]:+.3f}, {vs_base_auroc['ci'][1]:+.3f}] vs "
         "uncalibrated (target +0.03, interval excluding 0)"),
    ]
    return f"- {name}: " + "; ".join(("met: " if ok else "NOT met: ") + text for ok, text in checks)


def _verdict(d: dict, better_if_negative: bool, what: str) -> str:
    diff, (lo, hi) = d["diff"], d["ci"]
    if not d["excludes_zero"]:
        return f"no detectable difference in {what} ({diff:+.3f}, interval [{lo:+.3f}, {hi:+.3f}] includes 0)"
    better = (diff < 0) == better_if_negative
    return f"{'better' if better else 'worse'} {what} ({diff:+.3f} [{lo:+.3f}, {hi:+.3f}])"


def paragraph(name: str, task: dict, method: str = "ats-answers") -> str:
    """One task's answer to the issue's question: does the per-token head trained on answers rank answers better
    than the global control (AUROC), and is it better calibrated (ECE), with what confidence?"""
    m = task["methods"]
    if method not in m or "minus_control" not in m[method]:
        return f"**{name}.** {method} or the control is missing."
    head, control, base = m[method]["seeds"][0], m["control-answers"]["seeds"][0], m["uncalibrated"]["seeds"][0]
    d = m[method]["minus_control"]
    text = (f"**{name}** ({task['n']} questions, uncalibrated accuracy {base['accuracy']:.3f}, mean confidence "
            f"{base['mean_confidence']:.3f}, ECE {base['ece']:.3f}, AUROC {base['auroc']:.3f}). Against the global "
            f"control, the per-token head has {_verdict(d['auroc'], False, 'ranking (AUROC)')} and "
            f"{_verdict(d['ece'], True, 'calibration (ECE)')}: ECE {head['ece']:.3f} vs {control['ece']:.3f}, "
            f"AUROC {head['auroc']:.3f} vs {control['auroc']:.3f}, mean confidence {head['mean_confidence']:.3f} vs "
            f"{control['mean_confidence']:.3f}.")
    if abs(head["accuracy"] - base["accuracy"]) > 1e-9:
        text += (f" Its per-token scales change the chosen answer (accuracy {base['accuracy']:.3f} -> "
                 f"{head['accuracy']:.3f}; the control's: {control['accuracy']:.3f}).")
    others = [k for k in m if k not in ("uncalibrated", method, "control-answers") and "minus_control" in m[k]]
    if others:
        text += " The other methods against the control (ECE; AUROC): " + "; ".join(
            f"{k} {m[k]['seeds'][0]['ece']:.3f}, {_diff(m[k]['minus_control'], 'ece')}; "
            f"{m[k]['seeds'][0]['auroc']:.3f}, {_diff(m[k]['minus_control'], 'auroc')}" for k in others) + "."
    best = min((k for k in m if k != "uncalibrated"), key=lambda k: m[k]["seeds"][0]["ece"])
    text += f" Lowest ECE here: {best} ({m[best]['seeds'][0]['ece']:.3f})."
    return text


def per_token_methods(plan: dict) -> list[str]:
    """The plan's answer-trained per-token heads (transformer, linear, MLP; with or without the token term)."""
    return [m for m, spec in plan["methods"].items() if spec.partition("+")[0] in ("transformer", "linear", "mlp")]


def render(results_path: str | Path, results_dir: str | Path) -> Path:
    """Write results.md, a compact results.json and reliability diagrams into `results_dir`.

    Args:
        results_path: the run's results.json.
        results_dir: the committed results folder.

    Returns:
        The markdown file's path.
    """
    results = read_json(results_path)
    out = Path(results_dir)
    (out / "figures").mkdir(parents=True, exist_ok=True)
    plan = results["plan"]
    lines = [f"# Heads trained on answers: {results['backbone']['base_model']}", ""]
    if "command" in results:
        lines += [f"Command: `{results['command']}`", "", f"Machine: {results.get('machine', '?')}", ""]
    lines += [f"Plan (fixed before any reported task ran): `{json.dumps(plan)}`", "",
              "`*`: the paired 95% bootstrap interval excludes 0. ECE - control < 0 means better calibrated than the "
              "global control (one temperature trained with the same answer loss, data and schedule); AUROC - "
              "control > 0 means it ranks right above wrong answers better.", "", "## The pool", ""]
    pool_rows = [[n, p["kind"], str(p["questions"]), f"{p['accuracy']:.3f}",
                  f"{CHANCE[n]:.3f}" if n in CHANCE else "-"] for n, p in results.get("pool", {}).items()]
    lines += [markdown_table(["task", "scoring", "questions", "accuracy (uncalibrated)", "chance"], pool_rows), ""]
    if "selection" in results:
        lines += ["## Learning rate selection", "", f"Criterion: {plan['criterion']}.", ""]
        rows = [[m, f"{r['lr']:g}", f"{r['heldout_log_loss']:.4f}", "yes" if r["lr"] == s["lr"] else ""]
                for m, s in results["selection"].items() for r in s["grid"]]
        lines += [markdown_table(["method", "lr", "held-out log loss", "chosen"], rows), ""]
        lines += [f"{m}: selection carried over from `{s['carried_over_from']}`." for m, s in
                  results["selection"].items() if "carried_over_from" in s] + [""]
    if results.get("leave_one_out"):
        lines += ["## Leave one pool task out (seed 0)", ""]
        for name, task in results["leave_one_out"].items():
            if "carried_over_from" in task:
                lines += [f"(carried over from `{task['carried_over_from']}`)", ""]
            lines += [task_block(f"{name} (left out)", task), ""]
    if results.get("reported"):
        lines += [f"## Reported tasks (trained on the whole pool; seeds {plan['seeds']}: mean ± spread; intervals "
                  "and paired differences of seed 0)", ""]
        for name, task in results["reported"].items():
            lines += [task_block(name, task), ""]
            curves = {m: (np.asarray(c), np.asarray(k, dtype=bool)) for m, (c, k) in task["reliability"].items()}
            reliability_figure(curves, out / "figures" / name, title=name)
    if results.get("token_level"):
        tl = results["token_level"]
        lines += [f"## Held-out instruction tokens ({tl['tokens']} response tokens of `{tl['features']}`)", ""]
        rows = [[m, f"{v['accuracy']:.3f}", f"{v['mean_confidence']:.3f}", f"{v['ece']:.3f}"]
                for m, v in tl.items() if isinstance(v, dict)]
        lines += [markdown_table(["method", "token accuracy", "mean confidence", "token ECE"], rows), ""]
    blocks = {**{f"{k} (left out)": v for k, v in results.get("leave_one_out", {}).items()},
              **results.get("reported", {})}
    if blocks:
        for method in per_token_methods(plan):
            lines += [f"## Targets (issue 21) for {method}", ""]
            lines += [targets(name, task, method) for name, task in blocks.items()] + [""]
        lines += ["## Per task: does the head trained on answers beat one temperature trained on the same answers?",
                  "", "Generated from the numbers above (seed 0, paired 95% bootstrap intervals).", ""]
        lines += [paragraph(name, task) + "\n" for name, task in blocks.items()]
    md = out / "results.md"
    md.write_text("\n".join(lines))
    compact = {k: v for k, v in results.items() if k not in ("leave_one_out", "reported")}
    for key in ("leave_one_out", "reported"):
        if key in results:
            compact[key] = {n: {k: v for k, v in t.items() if k != "reliability"} for n, t in results[key].items()}
    (out / "results.json").write_text(json.dumps(compact, indent=1, allow_nan=True))
    return md

