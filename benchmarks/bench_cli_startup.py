"""CLI start-up time: `ats --help`, a sub-command's `--help` and argument errors, wall time of `python -m ats ...`,
median of RUNS runs each, this checkout against an earlier revision, measured in one run (interleaved, so the load
of a shared machine falls on both alike) and given as ratios.

    python benchmarks/bench_cli_startup.py                      # this checkout against 9ab0767 (the parser cache)
    python benchmarks/bench_cli_startup.py --before REV --runs 7
    python benchmarks/bench_cli_startup.py --render              # the markdown again from the saved JSON

The earlier revision is extracted with `git archive` into a temporary folder and run with PYTHONPATH=its src. It
replayed its parser from a record saved under $ATS_CACHE (keyed by a hash of the sources): it is timed twice, with
an empty $ATS_CACHE per run (the first run after `pip install` or after editing any file) and with the record saved.
This checkout has no cache of any kind: one column. Writes benchmarks/results/cli_startup.md and .json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
BEFORE = "9ab0767"  # the last revision with cli/parser_cache.py
COMMANDS = {
    "ats --help": ["--help"],
    "ats train --help": ["train", "--help"],
    "ats eval --head bogus (argparse: bad choice)": ["eval", "--head", "bogus", "--out", "x"],
    "ats train --lr 0 (a config's range check)": ["train", "--lr", "0", "--out", "x"],
    "ats eval --calibrator platt (a check inside the command)": ["eval", "--calibrator", "platt", "--out", "x"],
}
HEAVY = ("torch", "transformers", "sklearn")


def _env(src: Path, cache: str) -> dict:
    return {**os.environ, "PYTHONPATH": str(src), "ATS_CACHE": cache, "OMP_NUM_THREADS": "1"}


def _wall(src: Path, argv: list[str], cache: str) -> float:
    """Seconds of one `python -m ats ARGV` with PYTHONPATH=SRC and ATS_CACHE=cache."""
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "ats", *argv], env=_env(src, cache), capture_output=True)
    return time.perf_counter() - start


def import_report(src: Path) -> dict:
    """`import ats.cli.main` and `build_parser()` in a fresh process (no parser record): their seconds, the heavy
    libraries in sys.modules after them, and the five slowest top-level imports (-X importtime)."""
    code = ("import json, sys, time; start = time.perf_counter(); from ats.cli.main import build_parser; "
            "build_parser(); print(json.dumps([time.perf_counter() - start, "
            f"[name for name in {HEAVY!r} if name in sys.modules]]))")
    with tempfile.TemporaryDirectory() as cache:
        done = subprocess.run([sys.executable, "-X", "importtime", "-c", code], env=_env(src, cache),
                              capture_output=True, text=True, check=True)
    seconds, heavy = json.loads(done.stdout)
    rows = [re.match(r"import time:\s+(\d+) \|\s+(\d+) \|( *)(\S+)", line) for line in done.stderr.splitlines()]
    packages: dict[str, float] = {}
    for r in filter(None, rows):
        if "." not in r[4] and r[4] != "ats":
            packages[r[4]] = max(packages.get(r[4], 0.0), int(r[2]) / 1e6)
    top = sorted(((s, name) for name, s in packages.items()), reverse=True)[:5]
    return {"parser_s": seconds, "heavy_loaded": heavy, "slowest_imports": top}


def measure(after: Path, before: Path, runs: int) -> dict:
    """Median wall seconds of every command: `after` (no cache), `before` with an empty cache per run (first run
    after an install or edit) and with its record saved; the three interleaved run by run."""
    times: dict[str, dict[str, list[float]]] = {name: {"after": [], "before_first": [], "before_saved": []}
                                                for name in COMMANDS}
    with tempfile.TemporaryDirectory() as saved:
        subprocess.run([sys.executable, "-m", "ats", "--help"], env=_env(before, saved), capture_output=True)
        for _ in range(runs):
            for name, argv in COMMANDS.items():
                with tempfile.TemporaryDirectory() as empty:
                    times[name]["before_first"].append(_wall(before, argv, empty))
                times[name]["before_saved"].append(_wall(before, argv, saved))
                with tempfile.TemporaryDirectory() as empty:
                    times[name]["after"].append(_wall(after, argv, empty))
    return {name: {k: statistics.median(v) for k, v in columns.items()} for name, columns in times.items()}


def machine() -> str:
    """paper_table's machine line (CPU model, cores, torch) and the load average when measured (a shared machine)."""
    from paper_table import machine as cpu  # this script's folder, first on sys.path

    return f"{cpu()}, Python {platform.python_version()}, load average " + ", ".join(f"{x:.2f}" for x in os.getloadavg())


def render(run: dict) -> str:
    """The markdown page of one measured run."""
    before, runs = run["before"], run["runs"]
    lines = [
        "# CLI start-up", "",
        f"`python benchmarks/bench_cli_startup.py`: each command as `python -m ats ...`, median of {runs} runs, "
        f"this checkout and {before} (the parser cache) interleaved in one run. Machine: {run['machine']}.", "",
        f"| command | {before}, first run after install or edit | {before}, parser record saved | now (no cache) "
        f"| first run / now | saved record / now |",
        "|---|---:|---:|---:|---:|---:|"]
    for name, t in run["wall_s"].items():
        lines.append(f"| `{name}` | {t['before_first']:.2f} s | {t['before_saved']:.2f} s | {t['after']:.2f} s | "
                     f"{t['before_first'] / t['after']:.1f}x | {t['before_saved'] / t['after']:.1f}x |")
    lines.append("")
    for label, report in (("now", run["imports_after"]), (before, run["imports_before"])):
        slow = ", ".join(f"{name} {s:.2f} s" for s, name in report["slowest_imports"]) or "none"
        heavy = ", ".join(report["heavy_loaded"]) or "none of torch, transformers, sklearn"
        lines.append(f"- {label}: `import ats.cli.main` + `build_parser()` in a fresh process, no record: "
                     f"{report['parser_s']:.2f} s (under -X importtime); loaded: {heavy}; slowest imports: {slow}")
    lines += ["", NOTES]
    return "\n".join(lines) + "\n"


NOTES = """How: the configs and name tables the parser is built from (`HeadConfig`, `TrainingConfig` and the loss
names, `DataConfig`, `ATSConfig`, the head, task and calibrator registries, the embedded model names) are torch-free
modules, the layers' `__init__` files import on first use (`ats/lazy.py`), and each command module imports the
library inside `run`, after its options are checked. Config numbers are checked by argparse's `type=`
(`ats.config.OptionType`). So every row answers at once on the first run after an install or an edit, with nothing
cached; `tests/cli/test_startup.py` fails if `--help`, a command's `--help` or an argument error imports torch,
transformers or sklearn. Checks that read files (a task's or a calibrator's files, a dataset) and `ats ablate
--ablations` (its names live in workflows/ablate.py) still load the library first."""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", default=BEFORE, help=f"the earlier git revision (default: {BEFORE})")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--render", action="store_true", help="rewrite the markdown from the saved JSON, no timing")
    args = parser.parse_args()
    if args.render:
        run = json.loads((RESULTS / "cli_startup.json").read_text())
    else:
        with tempfile.TemporaryDirectory() as folder:
            archive = subprocess.run(["git", "-C", str(ROOT), "archive", args.before, "src"], capture_output=True,
                                     check=True).stdout
            subprocess.run(["tar", "-x", "-C", folder], input=archive, check=True)
            before, after = Path(folder) / "src", ROOT / "src"
            run = {"before": args.before, "runs": args.runs, "machine": machine(),
                   "wall_s": measure(after, before, args.runs),
                   "imports_after": import_report(after), "imports_before": import_report(before)}
        RESULTS.mkdir(parents=True, exist_ok=True)
        (RESULTS / "cli_startup.json").write_text(json.dumps(run, indent=2))
    text = render(run)
    (RESULTS / "cli_startup.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
