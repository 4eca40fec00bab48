"""Heads trained on the backbone's own answers (issue 21): the experiment protocol on the library's answer pool
(`ats.workflows.answer_pool`) and answer training (`ats.workflows.answer_methods`).

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
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ats.errors import ATSError
from ats.evaluation.metrics import nll, paired_differences, summarize
from ats.evaluation.tasks import MMLUTask, TriviaQATask, TruthfulQAGenTask, TruthfulQAMC1Task
from ats.io import read_json, write_json
from ats.training.answers import AnswerSet, score_answers
from ats.training.config import TrainingConfig
from ats.workflows.answer_methods import answer_head_record, parse_spec, reusable_answer_head, train_spec
from ats.workflows.answer_pool import (
    POOL_MC,
    TRIVIAQA_POOL_OFFSET,
    AnswerPool,
    pool_tasks,
)
from ats.workflows.pipeline import prepare_answers

logger = logging.getLogger(__name__)

BASELINES = ("isotonic-answers", "histogram-answers", "scaling-binning-answers")  # fitted on the pool's confidences
POOL = AnswerPool()


@dataclass
class AnswerPlan:
    """What `run_answers` does: sizes, methods, the selection grid and criterion, seeds (serialised beside the
    results, so a reader sees what was fixed before any reported task ran)."""

    pool_size: int = POOL.pool_size  # questions per pool task (MMLU validation: per subject, see mmlu_pool_per_subject)
    mmlu_pool_per_subject: int = POOL.mmlu_per_subject  # 0: no MMLU in the pool
    reported: dict = field(default_factory=lambda: {"mmlu": 3, "triviaqa": 400, "truthfulqa_mc1": 300,
                                                     "truthfulqa_gen": 300})
    methods: dict = field(default_factory=lambda: {  # name -> what is trained (`parse_spec`)
        "ats-answers": "transformer", "linear-answers": "linear", "control-answers": "constant",
        "thermometer-answers": "thermometer", "ats-answers-tokens": "transformer+tokens"})
    token_weight: float = POOL.token_weight  # "+tokens": fixed before any run, not tuned (nothing held out measures it)
    token_window: int = POOL.token_window
    token_max: int = POOL.token_max
    loss_type: str = "answer-log"
    lr_grid: tuple = (3e-4, 1e-3, 3e-3)
    epochs: int = 2
    batch_size: int = 16
    seeds: tuple = (0, 1, 2)
    holdout_fraction: float = 0.2
    selection_tasks: tuple = ("triviaqa_pool", "mmlu_validation")  # never left out, so LOTO never selects on its task
    criterion: str = ("mean answer log loss on the held-out 20% of the selection tasks' questions (pooled), after "
                      "training on 80% of every pool task's questions; lowest wins")
    bootstrap: int = 1000
    leave_one_out: tuple = POOL_MC + ("nq_open",)

    @property
    def pool(self) -> AnswerPool:
        """The library's pool options of this plan (sizes and the token term)."""
        return AnswerPool(pool_size=self.pool_size, mmlu_per_subject=self.mmlu_pool_per_subject,
                          token_weight=self.token_weight, token_window=self.token_window, token_max=self.token_max)


def reported_tasks(plan: AnswerPlan) -> dict:
    """name -> task reported and never trained or selected on."""
    r = plan.reported
    if r.get("triviaqa", 0) > TRIVIAQA_POOL_OFFSET:
        raise ATSError(f"reported TriviaQA questions ({r['triviaqa']}) would overlap the pool (offset "
                       f"{TRIVIAQA_POOL_OFFSET})")
    return {"mmlu": MMLUTask(limit=r["mmlu"], seed=0), "triviaqa": TriviaQATask(limit=r["triviaqa"], seed=0),
            "truthfulqa_mc1": TruthfulQAMC1Task(limit=r["truthfulqa_mc1"], seed=0),
            "truthfulqa_gen": TruthfulQAGenTask(limit=r["truthfulqa_gen"], seed=0)}


def split_holdout(answers: AnswerSet, fraction: float, seed: int = 0) -> tuple[AnswerSet, AnswerSet]:
    """(train, held-out) subsets of a set's questions, a seeded `fraction` held out."""
    order = np.random.default_rng(seed).permutation(len(answers))
    n_out = max(1, round(fraction * len(answers)))
    return answers.subset(sorted(order[n_out:].tolist())), answers.subset(sorted(order[:n_out].tolist()))


def leave_one_out_splits(names: list[str], left_out: tuple) -> list[tuple[str, list[str]]]:
    """[(left-out task, the training tasks)]: every training list lacks its left-out task."""
    return [(out, [n for n in names if n != out]) for out in left_out if out in names]


def plan_training(plan: AnswerPlan, *, lr: float, seed: int) -> TrainingConfig:
    """The protocol's schedule: the plan's epochs and batch (one micro-batch a step), at `lr` and `seed`."""
    return TrainingConfig(loss_type=plan.loss_type, lr=lr, epochs=plan.epochs, batch_size=plan.batch_size,
                          micro_batch_size=plan.batch_size, seed=seed)


def train_method(backbone, sets: list[AnswerSet], plan: AnswerPlan, method: str, *, lr: float, seed: int,
                 token_store=None, progress: bool = False):
    """A calibrator of `method`'s spec trained on `sets` with the plan's objective and schedule.

    Raises:
        ATSError: if the method's spec is unknown, or it needs instruction tokens and `token_store` is None.
    """
    kind, tokens = parse_spec(plan.methods[method], field=f"answer plan method {method!r}")
    if tokens and plan.token_weight > 0 and token_store is None:
        raise ATSError(f"method {method!r} adds a token-level term: pass the instruction features "
                       "(--token-features)")
    return train_spec(backbone, sets, plan.pool, kind=kind, tokens=tokens, training=plan_training(plan, lr=lr, seed=seed),
                      method=method, token_store=token_store, progress=progress)


def trained_head(backbone, sets: list[AnswerSet], plan: AnswerPlan, method: str, *, lr: float, seed: int,
                 folder: Path, token_store=None, progress: bool = False):
    """`train_method`'s calibrator, saved in `folder`; reused from there when its training record matches.

    Raises:
        ATSError: if the folder holds a calibrator trained with other settings.
    """
    from ats.calibrators import load_calibrator

    kind, tokens = parse_spec(plan.methods[method], field=f"answer plan method {method!r}")
    record = answer_head_record(plan_training(plan, lr=lr, seed=seed), plan.pool, tokens, tasks=[s.name for s in sets])
    if reusable_answer_head(folder, record, head_type=kind, max_scale=10.0, overwrite=False):
        return load_calibrator(folder, backbone)
    calibrator = train_method(backbone, sets, plan, method, lr=lr, seed=seed, token_store=token_store,
                              progress=progress)
    calibrator.save_pretrained(folder)
    return calibrator


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

    from ats.calibrators.binning import apply_bins, equal_mass_bins

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
    needs_tokens = [m for m in plan.methods if parse_spec(plan.methods[m], field=f"answer plan method {m!r}")[1]
                    and plan.token_weight > 0]
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
    pool = {name: prepare_answers(backbone, task, out / "answers" / name, progress=progress)
            for name, task in (pool if pool is not None else pool_tasks(plan.pool_size,
                                                                        plan.mmlu_pool_per_subject)).items()}
    results["pool"] = {n: {"questions": len(s), "kind": s.kind, "accuracy": float(np.mean(
        score_answers(None, s, backbone.logits)[1]))} for n, s in pool.items()}
    write_json(results_path, results)
    logits_fn = backbone.logits
    token_store = None
    if token_features is not None:
        from ats.training.features import FeatureStore

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
            answers = prepare_answers(backbone, task, out / "answers" / name, progress=progress)
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
            rows.append({"lr": lr, "heldout_log_loss": nll(conf, ok)})
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
    from ats.calibrators import load_calibrator
    from ats.calibrators.base import Uncalibrated
    from ats.evaluation.token_eval import token_confidences
    from ats.training.features import FeatureStore

    store = FeatureStore(Path(features) / "val")
    calibrators = {"uncalibrated": Uncalibrated(), **instruction_heads}
    for method in plan.methods:
        folder = out / "heads" / method / f"seed{plan.seeds[0]}"
        if (folder / "calibrator_config.json").is_file():
            calibrators[method] = load_calibrator(folder, backbone)
    scored = token_confidences(store, backbone, calibrators, progress=progress)
    return {"features": str(features), "tokens": int(len(next(iter(scored.values()))[0])),
            **{m: summarize(c, k) for m, (c, k) in scored.items()}}


