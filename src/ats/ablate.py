"""Ablations of ATS on one set of extracted features: smoothing type, smoothing weight alpha, head architecture.

    smoothing   none / full / selective                  (transformer head, alpha 0.5)
    alpha       0.1 / 0.3 / 0.5 / 0.7 / 0.9              (selective loss, transformer head)
    head        linear / mlp / transformer               (selective loss, alpha 0.5)

A configuration that appears in several ablations (selective / 0.5 / transformer appears in all three) is trained
once. Every head is trained with `pipeline.train_head` into `out_dir/heads/<name>` and reused when it is already
there, so a stopped run continues with the same call. All heads (and the uncalibrated model) are evaluated together
with `evaluate.evaluate` (one backbone pass per task example for all of them) and on the held-out instruction split
token by token (`token_eval.token_confidences`).

Output in `out_dir`:

    heads/<name>/                 the trained heads (calibrator_config.json + model.safetensors)
    eval/                         evaluate()'s per-task files, results.json / results.md, reliability diagrams
    <ablation>.md                 one markdown table per ablation: ECE and Brier per task + token-level validation
    ablations.json                settings, configurations, every number
    ece_vs_alpha.png / .pdf       ECE against alpha, one line per task (dashed: uncalibrated)

`run_alignment` measures the uncalibrated calibration of several backbones (an aligned chat model beside a
pre-trained base model) on the same tasks, and ATS on each.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import math
from dataclasses import dataclass
from pathlib import Path

from .calibrators.base import CONFIG_NAME, Uncalibrated
from .errors import ATSError
from .heads import HEAD_TYPES
from .io import atomic_file, write_json

ABLATIONS = ("smoothing", "alpha", "head")
ALPHAS = (0.1, 0.3, 0.5, 0.7, 0.9)
REFERENCE = "uncalibrated"
VAL_TASK = "val_tokens"  # the token-level column of the tables
TASK_LABELS = {"mmlu": "MMLU", "triviaqa": "TriviaQA", "truthfulqa_mc1": "TruthfulQA MC1", VAL_TASK: "val (token)"}
TABLE_METRICS = (("ECE", "ece"), ("Brier", "brier"))


@dataclass(frozen=True)
class HeadRun:
    """One ATS training configuration; `name` is its folder under heads/ and its method name in evaluate()."""

    head_type: str = "transformer"
    loss_type: str = "selective"
    alpha: float = 0.5

    @property
    def name(self) -> str:
        base = f"{self.head_type}-{self.loss_type}"
        return base if self.loss_type == "none" else f"{base}-a{self.alpha:g}"  # alpha is unused by "none"


def ablation_plan(ablations=ABLATIONS) -> dict[str, list[tuple[str, HeadRun]]]:
    """Ablation -> its rows as (row label, configuration), in table order."""
    if isinstance(ablations, str):
        ablations = [a for a in ablations.split(",") if a]
    ablations = list(ablations)
    unknown = [a for a in ablations if a not in ABLATIONS]
    if unknown or not ablations:
        raise ATSError(f"ablations: unknown or empty {unknown or ablations!r}; known: {', '.join(ABLATIONS)}")
    rows = {
        "smoothing": [(loss, HeadRun(loss_type=loss)) for loss in ("none", "full", "selective")],
        "alpha": [(f"{a:g}", HeadRun(alpha=a)) for a in ALPHAS],
        "head": [(head, HeadRun(head_type=head)) for head in HEAD_TYPES],
    }
    return {a: rows[a] for a in dict.fromkeys(ablations)}


def unique_runs(plan: dict[str, list[tuple[str, HeadRun]]]) -> list[HeadRun]:
    """Every configuration the plan needs, each once, in first-appearance order."""
    return list(dict.fromkeys(run for rows in plan.values() for _, run in rows))


def _jsonable(value):
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if hasattr(value, "item") and callable(value.item):  # numpy / torch scalars
        return _jsonable(value.item())
    return value


def _task_limit(spec: str, task_limit) -> int | None:
    if isinstance(task_limit, dict):
        key = "mc" if spec.startswith("mc:") and "mc" in task_limit else spec
        return task_limit.get(key)
    return task_limit


def build_tasks(tasks, task_limit=None, *, seed: int = 0, mmlu_options: dict | None = None) -> list:
    """Task objects from specs (or Task objects, kept); `task_limit`: an int for all, or spec -> int."""
    from .tasks import build_task

    built = []
    for t in tasks:
        if isinstance(t, str):
            options = dict(mmlu_options or {}) if t.strip() == "mmlu" else {}
            built.append(build_task(t, limit=_task_limit(t.strip(), task_limit), seed=seed, **options))
        else:
            built.append(t)
    return built


def _cell(metrics: dict | None, key: str) -> str:
    value = None if metrics is None else metrics.get(key)
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "-"
    return f"{value:.3f}"


def _task_order(results: dict) -> list[str]:
    return [t for t in results if t != VAL_TASK] + ([VAL_TASK] if VAL_TASK in results else [])


def format_ablation_table(rows: list[tuple[str, str]], results: dict, *, first: str = "setting") -> str:
    """Markdown: one row per (label, method) plus the uncalibrated reference; ECE / Brier per task."""
    tasks = _task_order(results)
    header = [first, "run"] + [f"{TASK_LABELS.get(t, t)} {label}" for t in tasks for label, _ in TABLE_METRICS]
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(["---", "---"] + ["---:"] * (len(header) - 2)) + "|"]
    for label, method in [(REFERENCE, REFERENCE), *rows]:
        cells = [label, method if method != REFERENCE else "-"]
        for t in tasks:
            cells += [_cell(results[t].get(method), key) for _, key in TABLE_METRICS]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _save_figure(fig, stem: Path) -> list[Path]:
    import matplotlib

    from .plots import _STYLE

    stem.parent.mkdir(parents=True, exist_ok=True)
    paths = []
    for suffix in ("png", "pdf"):
        path = stem.with_name(f"{stem.name}.{suffix}")
        with atomic_file(path, "wb") as f, matplotlib.rc_context(_STYLE):
            fig.savefig(f, format=suffix, dpi=200)
        paths.append(path)
    return paths


def alpha_figure(rows: list[tuple[str, str]], results: dict, stem: str | Path) -> list[Path]:
    """ECE against alpha, one line per task (dashed, same colour: the uncalibrated model); PNG + PDF."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    from .plots import _STYLE

    alphas = [float(label) for label, _ in rows]
    with matplotlib.rc_context(_STYLE):
        fig = Figure(figsize=(4.2, 3.0), layout="constrained")
        ax = fig.add_subplot()
        colours = matplotlib.rcParams["axes.prop_cycle"].by_key()["color"]
        for i, task in enumerate(_task_order(results)):
            colour = colours[i % len(colours)]
            ys = [results[task].get(method, {}).get("ece") for _, method in rows]
            ys = [math.nan if y is None else y for y in ys]
            ax.plot(alphas, ys, marker="o", color=colour, label=TASK_LABELS.get(task, task))
            ref = results[task].get(REFERENCE, {}).get("ece")
            if ref is not None and math.isfinite(ref):
                ax.axhline(ref, color=colour, linestyle="--", linewidth=0.8, alpha=0.7)
        ax.set_xlabel(r"smoothing weight $\alpha$ (selective loss)")
        ax.set_ylabel("ECE")
        ax.set_xticks(alphas)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend(title="dashed: uncalibrated", title_fontsize=7, frameon=False)
    return _save_figure(fig, Path(stem))


def run_ablations(backbone, train_store, val_store, out_dir: str | Path, *, tasks: list, task_limit=None,
                  epochs: int = 2, ablations=ABLATIONS, progress: bool = True, training=None, n_bins: int = 15,
                  bootstrap: int = 0, seed: int = 0, mmlu_options: dict | None = None) -> dict:
    """Train every configuration the ablations need (each once, reused from out_dir/heads on a rerun), evaluate
    them on `tasks` and token by token on `val_store`, and write the tables, ablations.json and the alpha figure.

    tasks: task specs ('mmlu', 'triviaqa', 'truthfulqa_mc1', 'mc:PATH', ...) or Task objects; task_limit: an int for
    every task, or spec -> int ('mc' for every mc:PATH). training: a TrainingConfig (its epochs are replaced by
    `epochs`). Returns what ablations.json holds, plus the tables' markdown under "tables".
    """
    from .evaluate import evaluate
    from .metrics import summarize
    from .pipeline import train_head
    from .token_eval import token_confidences
    from .training import TrainingConfig

    out_dir = Path(out_dir)
    plan = ablation_plan(ablations)
    runs = unique_runs(plan)
    training = dataclasses.replace(training or TrainingConfig(), epochs=epochs)

    calibrators: dict = {REFERENCE: Uncalibrated()}
    run_info: dict = {}
    for run in runs:
        head_dir = out_dir / "heads" / run.name
        trained_now = not (head_dir / CONFIG_NAME).exists()
        if progress:
            print(f"[ablate] {'training' if trained_now else 'reusing'} {run.name}")
        calibrator = train_head(backbone, train_store, val_store, head_dir, head_type=run.head_type,
                                loss_type=run.loss_type, alpha=run.alpha, training=training, progress=progress)
        calibrator.to(backbone.device)
        calibrator.head.eval()
        calibrators[run.name] = calibrator
        run_info[run.name] = {**dataclasses.asdict(run), "dir": str(head_dir), "trained_now": trained_now,
                              "training": calibrator.config_.training}

    built = build_tasks(tasks, task_limit, seed=seed, mmlu_options=mmlu_options)
    eval_dir = out_dir / "eval"
    if any(info["trained_now"] for info in run_info.values()) and (eval_dir / "tasks").is_dir():
        for stale in (eval_dir / "tasks").glob("*.json"):  # results of heads that were just (re)trained
            stale.unlink()
    results: dict = {}
    if built:
        results = evaluate(backbone, calibrators, built, eval_dir, n_bins=n_bins, bootstrap=bootstrap, seed=seed,
                           progress=progress)
    if val_store is not None and val_store.meta.get("response_tokens", 1) > 0:
        token = token_confidences(val_store, backbone, calibrators, progress=progress)
        results[VAL_TASK] = {name: summarize(conf, correct, n_bins=n_bins) for name, (conf, correct) in token.items()}
    results = _jsonable(results)

    tables, files = {}, []
    for ablation, rows in plan.items():
        table = format_ablation_table([(label, run.name) for label, run in rows], results,
                                      first="alpha" if ablation == "alpha" else ablation)
        tables[ablation] = table
        path = out_dir / f"{ablation}.md"
        with atomic_file(path) as f:
            f.write(f"## Ablation: {ablation}\n\n{table}\n")
        files.append(path.name)
    if "alpha" in plan:
        files += [p.name for p in alpha_figure([(label, run.name) for label, run in plan["alpha"]], results,
                                               out_dir / "ece_vs_alpha")]
    summary = {
        "settings": {"epochs": epochs, "training": dataclasses.asdict(training), "n_bins": n_bins, "seed": seed,
                     "tasks": [t.describe() for t in built], "task_limit": task_limit,
                     "backbone": backbone.describe() if hasattr(backbone, "describe") else str(backbone),
                     "train_sequences": len(train_store), "val_sequences": len(val_store) if val_store else 0,
                     "train_response_tokens": train_store.meta.get("response_tokens")},
        "runs": run_info,
        "ablations": {a: [{"row": label, "run": run.name} for label, run in rows] for a, rows in plan.items()},
        "results": results,
        "files": files,  # relative to out_dir
    }
    summary = _jsonable(summary)
    write_json(out_dir / "ablations.json", summary)
    return {**summary, "tables": tables}


# --- alignment: calibration of an aligned chat model vs. a pre-trained base model -------------------------------------
def format_alignment_table(results: dict) -> str:
    """Rows = model x method, columns = task x {Acc, ECE, Brier}."""
    tasks: list[str] = []
    for per_model in results.values():
        for t in _task_order(per_model):
            if t not in tasks:
                tasks.append(t)
    metrics = (("Acc", "accuracy"),) + TABLE_METRICS
    header = ["model", "method"] + [f"{TASK_LABELS.get(t, t)} {label}" for t in tasks for label, _ in metrics]
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(["---", "---"] + ["---:"] * (len(header) - 2)) + "|"]
    for model, per_model in results.items():
        methods = list(dict.fromkeys(m for t in per_model.values() for m in t))
        for method in methods:
            cells = [model, method]
            for t in tasks:
                cells += [_cell(per_model.get(t, {}).get(method), key) for _, key in metrics]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def run_alignment(models: list, out_dir: str | Path, *, tasks: list, task_limit=None, epochs: int = 2,
                  data_options=None, training=None, device: str | None = None, n_bins: int = 15, seed: int = 0,
                  progress: bool = True, mmlu_options: dict | None = None) -> dict:
    """Per backbone (an embedded name, a path or Hub id, or a loaded Backbone): features on the same instruction
    data, one ATS head (transformer, selective, alpha 0.5), and uncalibrated vs. ATS on `tasks` and token-level
    validation. Writes out_dir/alignment.md and alignment.json; each model's work lives in out_dir/<model>/
    (features, head, eval) and is reused on a rerun."""
    from .backbone import load_backbone
    from .evaluate import evaluate
    from .metrics import summarize
    from .pipeline import prepare_features, train_head
    from .token_eval import token_confidences
    from .training import TrainingConfig

    out_dir = Path(out_dir)
    training = dataclasses.replace(training or TrainingConfig(), epochs=epochs)
    results: dict = {}
    names = []
    for model in models:
        backbone = load_backbone(model, device=device) if isinstance(model, str) else model
        model = str(model) if isinstance(model, str) else backbone.name
        names.append(model)
        work = out_dir / Path(model).name.replace(":", "_")
        if progress:
            print(f"[alignment] {model}")
        train_store, val_store = prepare_features(backbone, work / "features", data_options, progress=progress)
        ats = train_head(backbone, train_store, val_store, work / "head", training=training, progress=progress)
        ats.to(backbone.device)
        ats.head.eval()
        calibrators = {REFERENCE: Uncalibrated(), "ats": ats}
        built = build_tasks(tasks, task_limit, seed=seed, mmlu_options=mmlu_options)
        per_model = evaluate(backbone, calibrators, built, work / "eval", n_bins=n_bins, seed=seed,
                             progress=progress) if built else {}
        token = token_confidences(val_store, backbone, calibrators, progress=progress)
        per_model[VAL_TASK] = {name: summarize(c, k, n_bins=n_bins) for name, (c, k) in token.items()}
        results[model] = _jsonable(per_model)
        del backbone, ats, calibrators
        gc.collect()
    table = format_alignment_table(results)
    with atomic_file(out_dir / "alignment.md") as f:
        f.write(f"## Calibration before / after ATS: aligned chat model vs. base model\n\n{table}\n")
    summary = _jsonable({"settings": {"models": names, "epochs": epochs, "training": dataclasses.asdict(training),
                                      "task_limit": task_limit, "seed": seed,
                                      "data": dataclasses.asdict(data_options) if data_options else None},
                         "results": results})
    write_json(out_dir / "alignment.json", summary)
    return {**summary, "table": table}


# --- `ats ablate` ----------------------------------------------------------------------------------------------------
def add_ablate_parser(sub) -> argparse.ArgumentParser:
    """Register `ats ablate` on the CLI's sub-parsers (same model / data options as `ats train`)."""
    from .cli import _add_data, _add_model

    p = sub.add_parser("ablate", help="ATS ablations: smoothing type, alpha, head (one feature cache, shared runs)")
    _add_model(p)
    _add_data(p)
    p.add_argument("--ablations", default=",".join(ABLATIONS), help="comma-separated: " + ", ".join(ABLATIONS))
    p.add_argument("--tasks", default="mmlu,triviaqa,truthfulqa_mc1",
                   help="comma-separated: mmlu, triviaqa, truthfulqa_mc1, mc:PATH[:letters|likelihood]")
    p.add_argument("--task-limit", type=int, default=None, help="examples per task (MMLU: per subject)")
    p.add_argument("--lr", type=float, default=5e-5)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=8, help="sequences per optimizer step")
    p.add_argument("--micro-batch-size", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True, help="ablation folder (heads, eval, tables, ablations.json, figure)")
    return p


def cmd_ablate(args) -> int:
    from .commands import _backbone, _data_options
    from .pipeline import prepare_features
    from .training import TrainingConfig

    out = Path(args.out)
    backbone = _backbone(args)
    train_store, val_store = prepare_features(backbone, args.features or out / "features", _data_options(args),
                                              progress=not args.quiet)
    training = TrainingConfig(lr=args.lr, epochs=args.epochs, batch_size=args.batch_size,
                              micro_batch_size=args.micro_batch_size, seed=args.seed)
    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    summary = run_ablations(backbone, train_store, val_store, out, tasks=tasks, task_limit=args.task_limit,
                            epochs=args.epochs, ablations=args.ablations, training=training, seed=args.seed,
                            progress=not args.quiet)
    for ablation, table in summary["tables"].items():
        print(f"\n## {ablation}\n{table}")
    print(f"\nall numbers: {out / 'ablations.json'}")
    return 0


__all__ = ["ABLATIONS", "ALPHAS", "HeadRun", "ablation_plan", "add_ablate_parser", "alpha_figure", "build_tasks",
           "cmd_ablate", "format_ablation_table", "format_alignment_table", "run_ablations", "run_alignment",
           "unique_runs"]
