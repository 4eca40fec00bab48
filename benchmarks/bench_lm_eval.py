"""Wall time of lm-eval with the `ats` model (SmolLM2 + a transformer ATS head) against lm-eval's own `hf` model.

The task is local (no Hub): MMLU questions of one subject from ATS_DATA_DIR in lm-eval's MMLU layout (description,
"{question}\\nA. ..\\nAnswer:", choices " A".." D"), zero-shot and 5-shot (the subject's dev questions, first_n), so
that one run shows the calibration's own cost (0-shot: nothing is shared between questions) and what reusing the
few-shot prefix saves (5-shot). `ats prefix_cache=0` is the ats model without that reuse.

Two measurements, both with hf and ats interleaved (the order reversed every round) and torch pinned to --threads:
- in-process: `lm_eval.simple_evaluate` on each model in one Python process (model loading included, imports and
  lm-eval's task indexing not), wall and CPU time; the time spent inside the calibrator (`Calibrator.apply`: head
  and scaling) is timed within each ats run, a figure the machine's load barely moves;
- command line: the exact commands a user types (`lm_eval --model hf ...` and `ats lm-eval --model ats ...`), end
  to end, imports and lm-eval's indexing of its ~10k task files included.
Ratios are medians over rounds of (ats / hf) within the same round.

    python benchmarks/bench_lm_eval.py --questions 40 --rounds 3 --cli-rounds 1
    python benchmarks/bench_lm_eval.py --questions 8 --rounds 1 --cli-rounds 0 --shots 0   # a quick look
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import transformers

from ats.io import atomic_file, read_jsonl, write_json
from ats.model.backbone import model_source

MODEL = "smollm2-135m-instruct"
SUBJECT = "high_school_geography"
ROOT = Path(__file__).resolve().parents[1]


def machine() -> dict:
    info = {"cpu": platform.processor() or "unknown", "cores": os.cpu_count(), "platform": platform.platform()}
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        fields = {k.strip(): v.strip() for k, v in (line.split(":", 1) for line in out.splitlines() if ":" in line)}
        info["cpu"] = fields.get("Model name", info["cpu"])
    except (OSError, subprocess.CalledProcessError):
        pass
    return info


def load_average() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def data_dir() -> Path:
    folder = Path(os.environ.get("ATS_DATA_DIR", ROOT.parent / "shared" / "data")) / "mmlu"
    if not (folder / "test.jsonl").is_file():
        sys.exit(f"bench_lm_eval: no MMLU copy at {folder} (set ATS_DATA_DIR)")
    return folder


def make_tasks(folder: Path, subject: str, questions: int, shots: list[int]) -> dict[int, str]:
    """Local lm-eval tasks over the first `questions` test questions of `subject`: shots -> task name."""
    source = data_dir()
    rows = [row for _, row in read_jsonl(source / "test.jsonl")]
    dev = [row for _, row in read_jsonl(source / "dev.jsonl")]
    test = [r for r in rows if r["subject"] == subject][:questions]
    if len(test) < questions:
        sys.exit(f"bench_lm_eval: subject {subject} has only {len(test)} test questions")
    (folder / "test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in test))
    (folder / "dev.jsonl").write_text("".join(json.dumps(r) + "\n" for r in dev if r["subject"] == subject))
    description = f"The following are multiple choice questions (with answers) about {subject.replace('_', ' ')}."
    names = {}
    for k in shots:
        names[k] = f"bench_mmlu_{subject}_{k}shot"
        (folder / f"{names[k]}.yaml").write_text(
            f"task: {names[k]}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
            f"    test: {folder / 'test.jsonl'}\n    dev: {folder / 'dev.jsonl'}\n"
            f"test_split: test\nfewshot_split: dev\nfewshot_config:\n  sampler: first_n\nnum_fewshot: {k}\n"
            f"description: \"{description}\\n\\n\"\noutput_type: multiple_choice\n"
            "doc_to_text: \"{{question.strip()}}\\nA. {{choices[0]}}\\nB. {{choices[1]}}\\nC. {{choices[2]}}\\n"
            "D. {{choices[3]}}\\nAnswer:\"\ndoc_to_choice: [\"A\", \"B\", \"C\", \"D\"]\ndoc_to_target: answer\n"
            "metric_list:\n  - metric: acc\n")
    return names


def train_head(folder: Path) -> Path:
    """A transformer head trained briefly on 48 Alpaca-GPT4 records (its cost does not depend on its weights)."""
    head = folder / "head"
    if (head / "calibrator_config.json").is_file():
        return head
    records = json.loads((data_dir().parent / "alpaca_gpt4" / "alpaca_gpt4_1k.json").read_text())[:48]
    folder.mkdir(parents=True, exist_ok=True)
    data = folder / "alpaca48.json"
    data.write_text(json.dumps(records))
    subprocess.run([sys.executable, "-m", "ats", "-q", "train", "--model", MODEL, "--head", "transformer", "--data",
                    str(data), "--max-length", "96", "--epochs", "1", "--lr", "1e-3", "--out", str(folder)],
                   check=True)
    return head


class ApplyTimer:
    """Seconds spent in one calibrator's `apply` (head + scaling), timed inside the run."""

    def __init__(self, calibrator) -> None:
        self.seconds = 0.0
        inner = calibrator.apply

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start

        calibrator.apply = timed


def run_in_process(kind: str, task: str, tasks, folder: str, head: Path, batch_size: int) -> dict:
    import lm_eval
    from lm_eval.models.huggingface import HFLM

    from ats.integrations.lm_eval_model import ATSLM

    wall, cpu = time.perf_counter(), time.process_time()
    timer, served = None, None
    if kind == "hf":
        lm = HFLM(pretrained=folder, device="cpu", batch_size=batch_size)
    else:
        lm = ATSLM(pretrained=MODEL, calibrator=str(head), device="cpu", batch_size=batch_size,
                   prefix_cache=0 if kind == "ats prefix_cache=0" else 16)
        timer = ApplyTimer(lm.calibrator)
    out = lm_eval.simple_evaluate(model=lm, tasks=[task], task_manager=tasks, verbosity="ERROR")
    if kind != "hf" and lm.prefixes is not None:
        served = [lm.prefixes.rows_served, lm.prefixes.rows_seen]
    return {"wall_s": time.perf_counter() - wall, "cpu_s": time.process_time() - cpu,
            "calibrator_s": None if timer is None else timer.seconds, "prefix_rows": served,
            "acc": out["results"][task]["acc,none"]}


def commands(task: str, include: Path, folder: str, head: Path, batch_size: int, out: Path) -> dict[str, list[str]]:
    common = ["--device", "cpu", "--batch_size", str(batch_size), "--include_path", str(include), "--tasks", task]
    return {"hf": ["lm_eval", "--model", "hf", "--model_args", f"pretrained={folder}", *common,
                   "--output_path", str(out / "hf")],
            "ats": ["ats", "lm-eval", "--model", "ats", "--model_args", f"pretrained={MODEL},calibrator={head}",
                    *common, "--output_path", str(out / "ats")]}


def median_ratio(rounds: list[dict], key: str, kind: str) -> float:
    return statistics.median(r[kind][key] / r["hf"][key] for r in rounds)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--subject", default=SUBJECT)
    p.add_argument("--questions", type=int, default=40)
    p.add_argument("--shots", default="0,5")
    p.add_argument("--rounds", type=int, default=3, help="in-process rounds")
    p.add_argument("--cli-rounds", type=int, default=1, help="command-line rounds")
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--calibrator", default=None, help="a SmolLM2 ATS head (default: train one briefly)")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "lm_eval"))
    args = p.parse_args()
    os.environ.update(OMP_NUM_THREADS=str(args.threads), MKL_NUM_THREADS=str(args.threads), HF_HUB_OFFLINE="1",
                      HF_DATASETS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    torch.set_num_threads(args.threads)
    started, load_start = time.time(), load_average()
    work = Path(tempfile.mkdtemp(prefix="bench_lm_eval."))
    shots = [int(k) for k in args.shots.split(",")]
    names = make_tasks(work, args.subject, args.questions, shots)
    head = Path(args.calibrator) if args.calibrator else train_head(work / "train")
    folder, _, _ = model_source(MODEL)  # the plain model folder lm-eval's hf model loads

    from lm_eval.tasks import TaskManager

    tasks = TaskManager(include_path=str(work), include_defaults=False)
    from lm_eval.models.huggingface import HFLM

    from ats.integrations.lm_eval_model import ATSLM

    HFLM(pretrained=folder, device="cpu")  # warm-up, not timed: imports, file cache, first kernels
    ATSLM(pretrained=MODEL, calibrator=str(head), device="cpu")
    results: dict = {"in_process": {}, "command_line": {}}
    for k, task in names.items():
        kinds = ["hf", "ats"] + (["ats prefix_cache=0"] if k > 0 else [])
        rounds = []
        for r in range(args.rounds):
            order = kinds if r % 2 == 0 else kinds[::-1]
            rounds.append({kind: run_in_process(kind, task, tasks, folder, head, args.batch_size) for kind in order})
            print(f"[{k}-shot round {r + 1}] " + ", ".join(f"{kind} {v['wall_s']:.1f}s" for kind, v in
                                                         rounds[-1].items()), flush=True)
        results["in_process"][task] = {"shots": k, "rounds": rounds, "ratios": {
            kind: {"wall": median_ratio(rounds, "wall_s", kind), "cpu": median_ratio(rounds, "cpu_s", kind)}
            for kind in kinds[1:]}}
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    for k, task in names.items():
        runs = []
        for r in range(args.cli_rounds):
            cmds = commands(task, work, folder, head, args.batch_size, work / f"cli{r}")
            timing = {}
            for kind in (["hf", "ats"] if r % 2 == 0 else ["ats", "hf"]):
                start = time.perf_counter()
                subprocess.run(cmds[kind], check=True, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                timing[kind] = {"wall_s": time.perf_counter() - start}
            runs.append(timing)
            print(f"[{k}-shot command line {r + 1}] hf {timing['hf']['wall_s']:.1f}s, ats {timing['ats']['wall_s']:.1f}s",
                  flush=True)
        if runs:
            results["command_line"][task] = {
                "shots": k, "rounds": runs, "ratio_wall": median_ratio(runs, "wall_s", "ats"),
                "commands": {kind: shlex.join(c) for kind, c in commands(task, Path("TASKS"), "MODEL_FOLDER",
                                                                          Path("HEAD"), args.batch_size,
                                                                          Path("OUT")).items()}}
    report = {
        "command": "python benchmarks/bench_lm_eval.py " + shlex.join(sys.argv[1:]),
        "machine": machine(), "threads": args.threads, "load_average": {"start": load_start, "end": load_average()},
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                     "lm_eval": __import__("lm_eval").__version__},
        "sizes": {"model": MODEL, "subject": args.subject, "questions": args.questions, "shots": shots,
                  "batch_size": args.batch_size, "requests_per_run": 4 * args.questions},
        "seconds": round(time.time() - started, 1), **results,
    }
    shutil.rmtree(work, ignore_errors=True)
    out = Path(args.out)
    write_json(out.with_suffix(".json"), report)
    with atomic_file(out.with_suffix(".md")) as f:
        f.write(markdown(report) + "\n")
    print(markdown(report))


def markdown(report: dict) -> str:
    m, s = report["machine"], report["sizes"]
    lines = ["# lm-eval: the `ats` model against lm-eval's `hf` model", "",
             f"Command: `{report['command']}`", "",
             f"Machine: {m['cpu']}, {m['cores']} cores visible, torch threads {report['threads']} (pinned); load "
             f"average {report['load_average']['start']} at start, {report['load_average']['end']} at end "
             f"(the machine is shared). torch {report['versions']['torch']}, transformers "
             f"{report['versions']['transformers']}, lm-eval {report['versions']['lm_eval']}.", "",
             f"Task: {s['questions']} MMLU {s['subject']} questions (local JSONL, lm-eval's MMLU layout, "
             f"{s['requests_per_run']} requests per run, one forward per question), shots {s['shots']}, batch size "
             f"{s['batch_size']}. Model {s['model']} (float32); ats with a transformer ATS head. "
             f"Total benchmark time {report['seconds']:.0f} s.", "",
             "## In-process (`lm_eval.simple_evaluate`, model loading included)", "",
             "| task | model | median wall (s) | median CPU (s) | wall ratio (ats / hf) | CPU ratio | calibrator "
             "share of the run | acc |",
             "|---|---|---:|---:|---:|---:|---:|---:|"]
    for task, entry in report["in_process"].items():
        rounds = entry["rounds"]
        for kind in rounds[0]:
            wall = statistics.median(r[kind]["wall_s"] for r in rounds)
            cpu = statistics.median(r[kind]["cpu_s"] for r in rounds)
            ratio = entry["ratios"].get(kind, {})
            share = [r[kind]["calibrator_s"] / r[kind]["wall_s"] for r in rounds if r[kind]["calibrator_s"]]
            cells = [f"{ratio[key]:.3f}" if key in ratio else "-" for key in ("wall", "cpu")]
            cells.append(f"{100 * statistics.median(share):.1f}%" if share else "-")
            lines.append(f"| {entry['shots']}-shot | {kind} | {wall:.1f} | {cpu:.1f} | {' | '.join(cells)} | "
                         f"{rounds[0][kind]['acc']:.3f} |")
    if report["command_line"]:
        lines += ["", "## Command line (end to end: imports and lm-eval's task indexing included)", "",
                  "| task | hf wall (s) | ats wall (s) | ratio (ats / hf) |", "|---|---:|---:|---:|"]
        for task, entry in report["command_line"].items():
            hf = statistics.median(r["hf"]["wall_s"] for r in entry["rounds"])
            ats = statistics.median(r["ats"]["wall_s"] for r in entry["rounds"])
            lines.append(f"| {entry['shots']}-shot | {hf:.1f} | {ats:.1f} | {entry['ratio_wall']:.3f} |")
        first = next(iter(report["command_line"].values()))["commands"]
        lines += ["", "Commands (TASKS: the generated task folder, MODEL_FOLDER: the dequantized SmolLM2 folder, "
                  "HEAD: the head):", "", f"    {first['hf']}", f"    {first['ats']}"]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
