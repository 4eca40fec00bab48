"""Heads trained on the backbone's own answers (issue 21): the answer pool, its cache, and the experiment protocol.

The pool (training and model selection only; `../shared/data/README.md`, last paragraph): NQ-open (free-form),
SciQ, Social IQa, BoolQ and Winogrande (multiple choice, scored by choice likelihood: letter scoring is at chance for
the small embedded models), MMLU validation (5-shot letters, as the MMLU task scores it) and TriviaQA questions
disjoint from every reported one (`offset=1000`). The reported tasks (MMLU test, TriviaQA, TruthfulQA MC1 and
free-form) are never trained or selected on.

Protocol (`run_answers`):
1. answers of every pool and reported task, generated once per backbone and cached (`answers/<task>/`, checked
   against the task's and the backbone's description on reuse);
2. learning rate per method chosen by the criterion declared in the plan (the mean answer log loss on a held-out 20%
   of the selection tasks, which are never left out, after training on 80% of every pool task), before any
   reported number is computed;
3. leave one pool task out: train on the other pool tasks, score the left-out one;
4. every method trained on the whole pool with several seeds, scored on the reported tasks; paired bootstrap
   intervals against the global control and against the uncalibrated model.
"""
from __future__ import annotations

import logging
from pathlib import Path

import numpy as np

from ..errors import ATSError
from ..evaluation.answers import AnswerSet
from ..evaluation.metrics import paired_differences, summarize
from ..io import read_json, write_json
from ..training.config import DEFAULT_ANSWER_METHOD
from .answer_methods import (
    HEAD_KINDS,
    RECORD_DEFAULTS,
    answer_head_record,
    fresh_head,
    method_spec,
    parse_spec,
    reusable_answer_head,
    train_answer_head,
    train_method,
    trained_head,
)
from .answer_pool import (
    POOL_MC,
    TRIVIAQA_POOL_OFFSET,
    AnswerPlan,
    cached_answers,
    leave_one_out_splits,
    mean_log_loss,
    pool_names,
    pool_tasks,
    reported_tasks,
    split_holdout,
)
from .answer_training import score_answers

logger = logging.getLogger(__name__)

__all__ = [  # the protocol, and the pool and methods it is built from
    "BASELINES", "baselines_on_answers", "choose_learning_rates", "evaluate_methods", "leave_one_out",
    "run_answers", "token_level",
    "POOL_MC",
    "TRIVIAQA_POOL_OFFSET",
    "AnswerPlan",
    "cached_answers",
    "leave_one_out_splits",
    "mean_log_loss",
    "pool_names",
    "pool_tasks",
    "reported_tasks",
    "split_holdout",
    "DEFAULT_ANSWER_METHOD",
    "HEAD_KINDS",
    "RECORD_DEFAULTS",
    "answer_head_record",
    "fresh_head",
    "method_spec",
    "parse_spec",
    "reusable_answer_head",
    "train_answer_head",
    "train_method",
    "trained_head",
]

BASELINES = ("isotonic-answers", "histogram-answers", "scaling-binning-answers")  # fitted on the pool's confidences


def _pool_scores(sets: list[AnswerSet], calibrator, logits_fn) -> tuple[np.ndarray, np.ndarray]:
    """(confidence, correct) of every answer of `sets` under `calibrator` (None: uncalibrated), pooled."""
    pairs = [score_answers(calibrator, s, logits_fn) for s in sets]
    return np.concatenate([c for c, _ in pairs]), np.concatenate([k for _, k in pairs])


def baselines_on_answers(sets: list[AnswerSet], logits_fn, control, *, n_bins: int = 15) -> dict:
    """The post-hoc baselines fitted on the pool's answer confidences: method -> (answer set -> confidences (Q,)).

    - isotonic-answers: isotonic regression of correctness on the uncalibrated confidence;
    - histogram-answers: equal-mass histogram binning (Zadrozny & Elkan) of the uncalibrated confidence, each bin
      mapped to its accuracy;
    - scaling-binning-answers (Kumar et al. 2019): the control's confidence (one temperature trained on answers),
      binned by equal mass, each bin mapped to its mean scaled confidence (left out when `control` is None).
    Vector scaling has no answer-level form here: the choices of likelihood-scored and free-form questions are not a
    fixed set of classes.
    """
    from sklearn.isotonic import IsotonicRegression

    from ..calibrators.binning import apply_bins, equal_mass_bins

    conf, correct = _pool_scores(sets, None, logits_fn)
    isotonic = IsotonicRegression(y_min=0.0, y_max=1.0, out_of_bounds="clip").fit(conf, correct.astype(float))
    hist = equal_mass_bins(conf, correct.astype(float), n_bins)
    maps = {"isotonic-answers": lambda a: np.clip(isotonic.predict(score_answers(None, a, logits_fn)[0]), 0.0, 1.0),
            "histogram-answers": lambda a: apply_bins(score_answers(None, a, logits_fn)[0], *hist)}
    if control is not None:
        scaled, _ = _pool_scores(sets, control, logits_fn)
        sb = equal_mass_bins(scaled, scaled, n_bins)
        maps["scaling-binning-answers"] = lambda a: apply_bins(score_answers(control, a, logits_fn)[0], *sb)
    return maps


def evaluate_methods(heads: dict, maps: dict, answers: AnswerSet, logits_fn, plan: AnswerPlan) -> dict:
    """Metrics with intervals per method on one task, and paired differences against the control and the
    uncalibrated model; `heads`: method -> [calibrators, one per seed], `maps`: method -> (answer set ->
    confidences), the baselines fitted on answers (`baselines_on_answers`)."""
    base = score_answers(None, answers, logits_fn)
    scored = {"uncalibrated": [base]}
    for method, calibrators in heads.items():
        scored[method] = [score_answers(c, answers, logits_fn) for c in calibrators]
    for method, fn in maps.items():
        scored[method] = [(fn(answers), base[1])]
    out = {"n": len(answers), "methods": {}}
    control = scored.get("control-answers", [None])
    for method, runs in scored.items():
        per_seed = [summarize(c, k, bootstrap=plan.bootstrap) for c, k in runs]
        entry = {"seeds": per_seed, "mean": {key: float(np.mean([m[key] for m in per_seed]))
                                             for key in ("ece", "brier", "auroc", "mean_confidence", "accuracy")},
                 "spread": {key: float(np.std([m[key] for m in per_seed]))
                            for key in ("ece", "brier", "auroc")}}
        if method != "uncalibrated":
            entry["minus_uncalibrated"] = paired_differences(runs[0], base, bootstrap=plan.bootstrap)
        if method not in ("uncalibrated", "control-answers") and control[0] is not None:
            entry["minus_control"] = paired_differences(runs[0], control[0], bootstrap=plan.bootstrap)
        out["methods"][method] = entry
    out["reliability"] = {m: [r[0][0].tolist(), r[0][1].tolist()] for m, r in scored.items()}
    return out


def run_answers(backbone, out: str | Path, plan: AnswerPlan | None = None, *, instruction_heads: dict | None = None,
                token_features: str | Path | None = None, progress: bool = True,
                stages: tuple = ("select", "loo", "reported", "tokens"), pool: dict | None = None,
                reported: dict | None = None) -> dict:
    """The whole protocol of the module docstring; results in OUT/results.json (each stage saved as it ends, and
    reused when rerun with the same plan).

    Args:
        backbone: the frozen backbone.
        out: the run folder (answers cached under OUT/answers).
        plan: sizes, methods, grid, seeds; default `AnswerPlan()`.
        instruction_heads: method -> a calibrator trained elsewhere (e.g. the paper's head on instruction data),
            scored on the reported tasks beside the answer-trained ones.
        token_features: an instruction feature folder (`train/`, `val/`); its held-out split gives each head's
            token-level calibration ("tokens" stage).
        progress: show progress bars.
        stages: which stages to run.
        pool: name -> task of the training pool; default `pool_tasks(plan)`.
        reported: name -> reported task; default `reported_tasks(plan)`.

    Returns:
        The results dict.
    """
    plan = plan or AnswerPlan()
    needs_tokens = [m for m in plan.methods if method_spec(plan, m)[1] > 0]
    if needs_tokens and token_features is None:
        raise ATSError(f"methods {needs_tokens} add a token-level term: pass the instruction features "
                       "(token_features / --token-features)")
    out = Path(out)
    results_path = out / "results.json"
    plan_dict = {k: (list(v) if isinstance(v, tuple) else v) for k, v in plan.__dict__.items()}
    results = read_json(results_path) if results_path.is_file() else {}
    if results and results.get("plan") != plan_dict:
        raise ATSError(f"{results_path}: made with another plan; use another --out")
    results.update({"plan": plan_dict, "backbone": backbone.describe()})
    reported_by_name = reported if reported is not None else reported_tasks(plan)
    pool = {name: cached_answers(backbone, task, out / "answers" / name, progress=progress)
            for name, task in (pool if pool is not None else pool_tasks(plan)).items()}
    results["pool"] = {n: {"questions": len(s), "kind": s.kind, "accuracy": float(np.mean(
        score_answers(None, s, backbone.logits)[1]))} for n, s in pool.items()}
    write_json(results_path, results)
    logits_fn = backbone.logits
    token_store = None
    if token_features is not None:
        from ..training.features import FeatureStore

        token_store = FeatureStore(Path(token_features) / "train")
        token_store.check_backbone(backbone)

    if "select" in stages and set(results.get("selection", {})) != set(plan.methods):
        choose_learning_rates(backbone, pool, plan, results, results_path, token_store=token_store, progress=progress)
    lrs = {m: results["selection"][m]["lr"] for m in plan.methods}
    if "loo" in stages:
        leave_one_out(backbone, out, pool, plan, lrs, results, results_path, token_store=token_store,
                      progress=progress)
    if "reported" in stages:
        heads = {m: [trained_head(backbone, list(pool.values()), plan, m, lr=lrs[m], seed=s,
                                  folder=out / "heads" / m / f"seed{s}", token_store=token_store, progress=progress)
                     for s in plan.seeds] for m in plan.methods}
        maps = baselines_on_answers(list(pool.values()), logits_fn, heads.get("control-answers", [None])[0])
        heads.update({name: [c] for name, c in (instruction_heads or {}).items()})
        for name, task in reported_by_name.items():
            answers = cached_answers(backbone, task, out / "answers" / name, progress=progress)
            results["reported"] = {**results.get("reported", {}),
                                   name: evaluate_methods(heads, maps, answers, logits_fn, plan)}
            write_json(results_path, results)
    if "tokens" in stages and token_features is not None:
        results["token_level"] = token_level(backbone, out, plan, token_features, instruction_heads or {},
                                             progress=progress)
        write_json(results_path, results)
    return results


def choose_learning_rates(backbone, pool: dict, plan: AnswerPlan, results: dict, results_path: Path, *,
                          token_store=None, progress: bool = True) -> None:
    """Stage 2: each method's learning rate, the grid point with the lowest mean answer log loss on the held-out
    part of the selection tasks after training on the rest of every pool task; saved per method in
    `results["selection"]` as it is chosen (a rerun resumes with the next method).

    Raises:
        ATSError: if no selection task of the plan is in the pool.
    """
    splits = {n: split_holdout(s, plan.holdout_fraction) for n, s in pool.items()}
    train_sets = [a for a, _ in splits.values()]
    selection_tasks = [n for n in plan.selection_tasks if n in splits]
    if not selection_tasks:
        raise ATSError(f"no selection task {list(plan.selection_tasks)} in the pool {list(splits)}")
    selection = results.setdefault("selection", {})
    for method in [m for m in plan.methods if m not in selection]:
        rows = []
        for lr in plan.lr_grid:
            head = train_method(backbone, train_sets, plan, method, lr=lr, seed=0, token_store=token_store,
                                progress=progress)
            conf, ok = _pool_scores([splits[n][1] for n in selection_tasks], head, backbone.logits)
            rows.append({"lr": lr, "heldout_log_loss": mean_log_loss(conf, ok)})
        best = min(rows, key=lambda r: r["heldout_log_loss"])
        selection[method] = {"grid": rows, "lr": best["lr"]}
        logger.info("%s: lr %.3g chosen", method, best["lr"])
        write_json(results_path, results)


def leave_one_out(backbone, out: Path, pool: dict, plan: AnswerPlan, lrs: dict, results: dict, results_path: Path, *,
                  token_store=None, progress: bool = True) -> None:
    """Stage 3: per left-out pool task, every method trained (seed 0) on the other pool tasks and scored on it, with
    the baselines fitted on the same answers; saved per task in `results["leave_one_out"]` (the heads under
    OUT/loo/<task>/<method>/seed0, so a rerun resumes; a block missing one of the plan's methods is redone)."""
    loo = results.setdefault("leave_one_out", {})
    for left_out, train_names in leave_one_out_splits(list(pool), plan.leave_one_out):
        if set(plan.methods) <= set(loo.get(left_out, {}).get("methods", {})):
            continue
        sets = [pool[n] for n in train_names]
        heads = {m: [trained_head(backbone, sets, plan, m, lr=lrs[m], seed=0, token_store=token_store,
                                  folder=out / "loo" / left_out / m / "seed0", progress=progress)]
                 for m in plan.methods}
        maps = baselines_on_answers(sets, backbone.logits, heads.get("control-answers", [None])[0])
        loo[left_out] = {"train": train_names, **evaluate_methods(heads, maps, pool[left_out], backbone.logits, plan)}
        write_json(results_path, results)


def token_level(backbone, out: Path, plan: AnswerPlan, features: str | Path, instruction_heads: dict, *,
                progress: bool = True) -> dict:
    """Held-out instruction-token calibration (ECE, mean confidence, accuracy) of every saved head (seed 0) and of
    the instruction-trained heads: does training on answers collapse token confidence?"""
    from ..calibrators import load_calibrator
    from ..calibrators.base import Uncalibrated
    from ..evaluation.token_eval import token_confidences
    from ..training.features import FeatureStore

    store = FeatureStore(Path(features) / "val")
    calibrators = {"uncalibrated": Uncalibrated(), **instruction_heads}
    for method in plan.methods:
        folder = out / "heads" / method / f"seed{plan.seeds[0]}"
        if (folder / "calibrator_config.json").is_file():
            calibrators[method] = load_calibrator(folder, backbone)
    scored = token_confidences(store, backbone, calibrators, progress=progress)
    return {"features": str(features), "tokens": int(len(next(iter(scored.values()))[0])),
            **{m: summarize(c, k) for m, (c, k) in scored.items()}}


