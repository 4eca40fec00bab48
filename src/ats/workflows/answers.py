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

import dataclasses
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..errors import ATSError
from ..evaluation.answers import AnswerSet, build_answer_set
from ..evaluation.metrics import paired_differences, summarize
from ..evaluation.tasks import (
    MMLUTask,
    MultipleChoiceTask,
    NQOpenTask,
    TriviaQATask,
    TruthfulQAGenTask,
    TruthfulQAMC1Task,
)
from ..io import read_json, write_json
from ..training.config import TrainingConfig
from .answer_training import score_answers, train_on_answers

logger = logging.getLogger(__name__)

POOL_MC = ("sciq", "social_iqa", "boolq", "winogrande")
TRIVIAQA_POOL_OFFSET = 1000  # reported TriviaQA subsets use the first <= 1000 questions after the few-shot ones


@dataclass
class AnswerPlan:
    """What `run_answers` does: sizes, methods, the selection grid and criterion, seeds (serialised beside the
    results, so a reader sees what was fixed before any reported task ran)."""

    pool_size: int = 300  # questions per pool task (MMLU validation: per subject, see mmlu_pool_per_subject)
    mmlu_pool_per_subject: int = 3  # 0: no MMLU in the pool
    reported: dict = field(default_factory=lambda: {"mmlu": 3, "triviaqa": 400, "truthfulqa_mc1": 300,
                                                     "truthfulqa_gen": 300})
    methods: dict = field(default_factory=lambda: {  # name -> what is trained (`method_spec`)
        "ats-answers": "transformer", "linear-answers": "linear", "control-answers": "constant",
        "thermometer-answers": "thermometer", "ats-answers-tokens": "transformer+tokens"})
    token_weight: float = 1.0  # "+tokens" methods: fixed before any run, not tuned (nothing held out measures it)
    token_window: int = 512  # the instruction sequence's first positions the token term reads (cost: the head's pass)
    token_max: int = 64  # response tokens of that window per step (a seeded random subset)
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


def pool_tasks(plan: AnswerPlan) -> dict:
    """name -> task of the training pool (local files under ATS_DATA_DIR, else the Hub: `qa_pool.pool_path`)."""
    from ..evaluation.tasks.qa_pool import pool_path

    tasks = {}
    for name in POOL_MC:
        tasks[name] = MultipleChoiceTask(pool_path(name), "likelihood", limit=plan.pool_size, seed=0)
    tasks["nq_open"] = NQOpenTask(limit=plan.pool_size, seed=0)
    trivia = TriviaQATask(limit=plan.pool_size, seed=0, offset=TRIVIAQA_POOL_OFFSET)
    trivia.name = "triviaqa_pool"
    tasks["triviaqa_pool"] = trivia
    if plan.mmlu_pool_per_subject > 0:
        mmlu = MMLUTask(limit=plan.mmlu_pool_per_subject, seed=0, split="validation")
        mmlu.name = "mmlu_validation"
        tasks["mmlu_validation"] = mmlu
    return tasks


def pool_names(plan: AnswerPlan) -> list[str]:
    """The names of `pool_tasks(plan)`'s tasks (and answer sets), in order, without reading any data."""
    names = [f"mc_{n}_likelihood" for n in POOL_MC] + ["nq_open", "triviaqa_pool"]
    return names + (["mmlu_validation"] if plan.mmlu_pool_per_subject > 0 else [])


def reported_tasks(plan: AnswerPlan) -> dict:
    """name -> task reported and never trained or selected on."""
    r = plan.reported
    if r.get("triviaqa", 0) > TRIVIAQA_POOL_OFFSET:
        raise ATSError(f"reported TriviaQA questions ({r['triviaqa']}) would overlap the pool (offset "
                       f"{TRIVIAQA_POOL_OFFSET})")
    return {"mmlu": MMLUTask(limit=r["mmlu"], seed=0), "triviaqa": TriviaQATask(limit=r["triviaqa"], seed=0),
            "truthfulqa_mc1": TruthfulQAMC1Task(limit=r["truthfulqa_mc1"], seed=0),
            "truthfulqa_gen": TruthfulQAGenTask(limit=r["truthfulqa_gen"], seed=0)}


def cached_answers(backbone, task, folder: Path, *, progress: bool = True) -> AnswerSet:
    """The task's answers from `folder` when they were made by this task and backbone with the default storage
    (float16 hidden states); built and saved otherwise (with the default scale summary). A set saved before answer
    sets carried a summary is reused as it is (scored by the exact route, which the summary matches to 1e-4), and so
    is one with other summary settings (each summary row carries its own range and nodes), said in one line.

    Raises:
        ATSError: if the folder holds another task's or backbone's answers, or other storage settings.
    """
    from ..model.scale_summary import ScaleSummarySpec

    want = {"task": task.describe(), "backbone": backbone.describe(), "dtype": "float16",
            "summary": dataclasses.asdict(ScaleSummarySpec())}
    if (folder / "answers.json").is_file():
        meta = read_json(folder / "answers.json")
        have = {key: meta.get(key) for key in want}
        if "summary" not in meta:  # made before answer sets had a summary: the exact route scores it
            have["summary"] = want["summary"]
        elif have["summary"] != want["summary"]:  # each row carries its own nodes: read as made, to 1e-4 of exact
            logger.info("%s: answers with scale summary %s (default now %s), reused as they are", folder,
                        have["summary"], want["summary"])
            have["summary"] = want["summary"]
        if have != want:
            raise ATSError(f"{folder}: answers of {have}, not of {want}; remove the folder or use another --out")
        logger.info("reusing the answers in %s", folder)
        return AnswerSet.load(folder)
    start = time.perf_counter()
    answers = build_answer_set(backbone, task, progress=progress)
    answers.meta["seconds"] = round(time.perf_counter() - start, 1)
    answers.save(folder)
    logger.info("%s: %d answers in %.0f s", task.name, len(answers), answers.meta["seconds"])
    return answers


def split_holdout(answers: AnswerSet, fraction: float, seed: int = 0) -> tuple[AnswerSet, AnswerSet]:
    """(train, held-out) subsets of a set's questions, a seeded `fraction` held out."""
    order = np.random.default_rng(seed).permutation(len(answers))
    n_out = max(1, round(fraction * len(answers)))
    return answers.subset(sorted(order[n_out:].tolist())), answers.subset(sorted(order[:n_out].tolist()))


def leave_one_out_splits(names: list[str], left_out: tuple) -> list[tuple[str, list[str]]]:
    """[(left-out task, the training tasks)]: every training list lacks its left-out task."""
    return [(out, [n for n in names if n != out]) for out in left_out if out in names]


def mean_log_loss(confidence: np.ndarray, correct: np.ndarray) -> float:
    """The mean binary log loss of answer confidences."""
    p = np.clip(confidence, 1e-7, 1 - 1e-7)
    return float(-np.mean(np.where(correct, np.log(p), np.log1p(-p))))


HEAD_KINDS = ("transformer", "linear", "mlp", "constant", "thermometer")
DEFAULT_ANSWER_METHOD = "thermometer"  # `ats train`'s default: best on both embedded models (results/answers)
BASELINES = ("isotonic-answers", "histogram-answers", "scaling-binning-answers")  # fitted on the pool's confidences


def parse_spec(spec: str, *, field: str) -> tuple[str, bool]:
    """(kind, with the token term) of a method spec: "transformer", ..., "thermometer", optionally "+tokens".

    Raises:
        ATSError: naming `field`, if the spec names an unknown kind or suffix (Thermometer has no token term).
    """
    kind, plus, extra = spec.partition("+")
    if kind not in HEAD_KINDS or (plus and extra != "tokens") or (extra and kind == "thermometer"):
        raise ATSError(f"{field}: unknown spec {spec!r} (one of {', '.join(HEAD_KINDS)}, an ATS head optionally "
                       "with '+tokens')")
    return kind, bool(extra)


def method_spec(plan: AnswerPlan, method: str) -> tuple[str, float]:
    """(kind, token weight) of a plan method: `parse_spec`'s kind, and `plan.token_weight` for "+tokens" (the answer
    loss plus that weight x the top-label loss on instruction tokens), else 0.

    Raises:
        ATSError: if the spec names an unknown kind or suffix.
    """
    kind, tokens = parse_spec(plan.methods[method], field=f"answer plan method {method!r}")
    return kind, plan.token_weight if tokens else 0.0


def token_record(plan: AnswerPlan, token_weight: float) -> dict:
    """The token-term fields of a head's training record (the window and subset only when the term is on)."""
    return {"token_weight": token_weight,
            **({"token_max": plan.token_max, "token_window": plan.token_window} if token_weight > 0 else {})}


def fresh_head(backbone, kind: str, seed: int, method: str, *, max_scale: float = 10.0, **thermometer_options):
    """An untrained calibrator for `backbone` (identity at start): an ATS-family head of type `kind` (scales clamped
    at `max_scale`), or a Thermometer sized for the backbone (its schedule options recorded in its config)."""
    from ..calibrators.ats import ATSCalibrator
    from ..calibrators.thermometer import Thermometer

    if kind == "thermometer":
        return Thermometer(hidden_size=backbone.hidden_size, seed=seed, **thermometer_options)
    return ATSCalibrator.for_backbone(backbone, head_type=kind, seed=seed, method=method, max_scale=max_scale)


def train_method(backbone, sets: list[AnswerSet], plan: AnswerPlan, method: str, *, lr: float, seed: int,
                 token_store=None, progress: bool = False):
    """A calibrator of `method`'s spec trained on `sets` with the plan's objective and schedule.

    Raises:
        ATSError: if the method needs instruction tokens and `token_store` is None.
    """
    kind, token_weight = method_spec(plan, method)
    if token_weight > 0 and token_store is None:
        raise ATSError(f"method {method!r} adds a token-level term: pass the instruction features "
                       "(--token-features)")
    calibrator = fresh_head(backbone, kind, seed, method, lr=lr, epochs=plan.epochs, batch_size=plan.batch_size)
    config = TrainingConfig(lr=lr, epochs=plan.epochs, batch_size=plan.batch_size, micro_batch_size=plan.batch_size,
                            seed=seed)
    train_on_answers(calibrator, sets, backbone.logits, config=config, loss_type=plan.loss_type,
                     token_store=token_store if token_weight > 0 else None, token_weight=token_weight,
                     token_max=plan.token_max, token_window=plan.token_window, progress=progress)
    return calibrator


def trained_head(backbone, sets: list[AnswerSet], plan: AnswerPlan, method: str, *, lr: float, seed: int,
                 folder: Path, token_store=None, progress: bool = False):
    """`train_method`'s calibrator, saved in `folder`; reused from there when its training record matches.

    Raises:
        ATSError: if the folder holds a calibrator trained with other settings.
    """
    from ..calibrators import load_calibrator

    kind, token_weight = method_spec(plan, method)
    record = {"lr": lr, "seed": seed, "epochs": plan.epochs, "loss_type": plan.loss_type,
              "batch_size": plan.batch_size, "tasks": [s.name for s in sets], **token_record(plan, token_weight)}
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


def answer_head_record(training: TrainingConfig, loss_type: str, plan: AnswerPlan, token_weight: float = 0.0) -> dict:
    """The training record a head trained by `train_answer_head` carries (compared on reuse)."""
    return {**training.to_dict(), "loss_type": loss_type, "data": "answers", "tasks": pool_names(plan),
            "lr": training.lr if training.lr is not None else 1e-3, **token_record(plan, token_weight)}


RECORD_DEFAULTS = {"token_weight": 0.0}  # record fields of heads saved before the field existed


def reusable_answer_head(head_dir: Path, record: dict, *, head_type: str, max_scale: float,
                         overwrite: bool) -> bool:
    """Whether `head_dir` holds a head trained with `record`, `head_type` and `max_scale` (read from its JSON
    config, before any model loads); False when there is none or `overwrite` replaces it.

    Raises:
        ATSError: if it holds a head trained otherwise and `overwrite` is False, naming what differs.
    """
    path = head_dir / "calibrator_config.json"
    if not path.is_file():
        return False
    config = read_json(path)
    thermometer = config.get("type") == "thermometer"  # its training record is its history's first entry
    training = ((config.get("history") or [{}])[0] if thermometer else config.get("training")) or {}
    have = {k: training.get(k, RECORD_DEFAULTS.get(k)) for k in record}
    differ = [k for k in record if have[k] != record[k]]
    if ("thermometer" if thermometer else (config.get("head") or {}).get("head_type")) != head_type:
        differ.append("head")
    if not thermometer and config.get("max_scale") != max_scale:
        differ.append("max_scale")
    if not differ:
        return True
    if overwrite:
        return False
    raise ATSError(f"{head_dir}: a head trained with other settings ({', '.join(differ)}); use --overwrite or "
                   "another --out")


def train_answer_head(backbone, out: str | Path, *, spec: str, training: TrainingConfig, loss_type: str,
                      max_scale: float = 10.0, plan: AnswerPlan | None = None, token_features: str | Path | None = None,
                      overwrite: bool = False, progress: bool = True):
    """`ats train --data answers`: the pool's answers (cached in OUT/answers), a calibrator trained on all of them with
    `training` and `loss_type`, saved in OUT/head (reused when it was trained with the same settings).

    Args:
        backbone: the frozen backbone.
        out: the run folder.
        spec: what is trained (`parse_spec`): an ATS head type ("transformer", "linear", "mlp", "constant": the
            global control), "thermometer", or an ATS head with "+tokens" (plus `plan.token_weight` x the top-label
            loss on the instruction tokens of `token_features`).
        training: lr (None: 1e-3), epochs, batch_size (questions per step), seed, ...
        loss_type: "answer-log" or "answer-brier".
        max_scale: the clamp on exp(tau) (ATS heads).
        plan: the pool's sizes and the token term's settings; default `AnswerPlan()`.
        token_features: an instruction feature folder of the same backbone (its train/ split), for "+tokens".
        overwrite: replace a head trained with other settings instead of refusing.
        progress: show progress bars.

    Returns:
        (the calibrator, name -> the pool's answer sets, whether the head was reused).

    Raises:
        ATSError: if the spec is unknown, "+tokens" comes without token features, or OUT/head holds a head trained
            otherwise (without `overwrite`).
    """
    from ..calibrators import load_calibrator
    from ..training.features import FeatureStore

    plan = plan or AnswerPlan()
    kind, tokens = parse_spec(spec, field="--method")
    if tokens and token_features is None:
        raise ATSError(f"--method {spec}: the token term reads instruction features; pass --token-features DIR "
                       "(an `ats train` features folder of this model)")
    out = Path(out)
    head_dir = out / "head"
    token_weight = plan.token_weight if tokens else 0.0
    reuse = reusable_answer_head(head_dir, answer_head_record(training, loss_type, plan, token_weight),
                                 head_type=kind, max_scale=max_scale, overwrite=overwrite)
    pool = {name: cached_answers(backbone, task, out / "answers" / name, progress=progress)
            for name, task in pool_tasks(plan).items()}
    if reuse:
        logger.info("reusing the head in %s (same settings)", head_dir)
        return load_calibrator(head_dir, backbone), pool, True
    token_store = None
    if tokens:
        token_store = FeatureStore(Path(token_features) / "train")
        token_store.check_backbone(backbone)
    lr = training.lr if training.lr is not None else 1e-3
    calibrator = fresh_head(backbone, kind, training.seed, f"{kind}-answers", max_scale=max_scale, lr=lr,
                            epochs=training.epochs, batch_size=training.batch_size)
    train_on_answers(calibrator, list(pool.values()), backbone.logits, config=training, loss_type=loss_type,
                     token_store=token_store, token_weight=token_weight, token_max=plan.token_max,
                     token_window=plan.token_window, progress=progress)
    calibrator.save_pretrained(head_dir)
    return calibrator, pool, False
