"""CLI start-up time: `import ats.cli.main` (python -X importtime) and the wall time of `ats --help`,
`ats train --help` and an argument error, median of 5 runs each (issue 22, part 5).

    python benchmarks/bench_cli_startup.py                          # this checkout (src/)
    python benchmarks/bench_cli_startup.py --src /tmp/before/src --label before --out /tmp/before.json

Every command runs as `python -m ats ...` with PYTHONPATH=SRC and a fresh $ATS_CACHE: the first run of a checkout
builds the parser (and saves its record), the timed runs replay it, as every later run on a user's machine does.
Writes benchmarks/results/cli_startup.md (and .json); with --before, a JSON of another checkout's numbers is shown
beside these.
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
COMMANDS = {
    "ats --help": ["--help"],
    "ats train --help": ["train", "--help"],
    "ats eval --head bogus (argparse error)": ["eval", "--head", "bogus", "--out", "x"],
    "ats eval --calibrator platt (a check inside the command: imports the library)":
        ["eval", "--calibrator", "platt", "--out", "x"],
}
FIRST = "first `ats --help` of a checkout (no parser record yet: builds and saves it)"
RUNS = 5
NOTES = """How: command modules import the library only inside `run`, and the parser (whose train / eval / ablate
options come from the config dataclasses, which import torch) is replayed from a JSON record saved under
`$ATS_CACHE/cli` and keyed by a hash of the package's sources (`ats/cli/parser_cache.py`). The configs' range checks
(`--lr 0`, `--alpha 2`) run from that record too (`ats.config.check_parsed`), before any import. So `--help`, every
error argparse finds (unknown command or option, bad choice, not a number, missing argument) and the configs' range
checks answer in about 0.2 s on this loaded machine.

Not yet under 1 s: the first run after installing or editing any source file (it builds the record: as slow as
before), and the checks that need the library's own tables, such as model names (`EMBEDDED_MODELS` in
model/backbone.py), task names (evaluation/tasks), calibrator names and data files (the row `--calibrator platt`).
Those tables live in modules that import torch and transformers at the top; moving them, and the config dataclasses,
into torch-free modules would make these checks as fast."""


def _env(src: Path, cache: str) -> dict:
    return {**os.environ, "PYTHONPATH": str(src), "ATS_CACHE": cache, "OMP_NUM_THREADS": "1"}


def import_time(src: Path, cache: str) -> tuple[float, list[tuple[float, str]]]:
    """Seconds to import ats.cli.main (cumulative, from -X importtime) and the five slowest top-level imports."""
    err = subprocess.run([sys.executable, "-X", "importtime", "-c", "import ats.cli.main"], env=_env(src, cache),
                         capture_output=True, text=True, check=True).stderr
    rows = [re.match(r"import time:\s+(\d+) \|\s+(\d+) \|( *)(\S+)", line) for line in err.splitlines()]
    rows = [r for r in rows if r]
    total = next(int(r[2]) for r in reversed(rows) if r[4] == "ats.cli.main" and len(r[3]) == 1) / 1e6
    packages: dict[str, float] = {}
    for r in rows:
        if "." not in r[4] and r[4] != "ats":
            packages[r[4]] = max(packages.get(r[4], 0.0), int(r[2]) / 1e6)
    top = sorted(((s, name) for name, s in packages.items()), reverse=True)[:5]
    return total, top


def wall_time(src: Path, cache: str, argv: list[str]) -> float:
    """Median wall seconds of `python -m ats ARGV` over RUNS runs (after one untimed run that warms the record)."""
    command = [sys.executable, "-m", "ats", *argv]
    subprocess.run(command, env=_env(src, cache), capture_output=True)
    times = []
    for _ in range(RUNS):
        start = time.perf_counter()
        subprocess.run(command, env=_env(src, cache), capture_output=True)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def machine() -> str:
    """paper_table's machine line (CPU model, cores, torch) and the load average when measured (a shared machine)."""
    from paper_table import machine as cpu  # this script's folder, first on sys.path

    return f"{cpu()}, Python {platform.python_version()}, load average " + ", ".join(f"{x:.2f}" for x in os.getloadavg())


def measure(src: Path, label: str) -> dict:
    """Every number of the table for the checkout at `src`."""
    with tempfile.TemporaryDirectory() as cache:
        imported, top = import_time(src, cache)
        start = time.perf_counter()
        subprocess.run([sys.executable, "-m", "ats", "--help"], env=_env(src, cache), capture_output=True)
        walls = {FIRST: time.perf_counter() - start}
        walls.update({name: wall_time(src, cache, argv) for name, argv in COMMANDS.items()})
    return {"label": label, "src": str(src), "import_s": imported, "slowest_imports": top, "wall_s": walls,
            "machine": machine()}


def table(runs: list[dict]) -> str:
    """The markdown table: one column per measured checkout."""
    lines = ["| | " + " | ".join(r["label"] for r in runs) + " |", "|---|" + "---:|" * len(runs),
             "| `import ats.cli.main` (-X importtime, cumulative) | "
             + " | ".join(f"{r['import_s']:.3f} s" for r in runs) + " |"]
    for name in COMMANDS:
        lines.append(f"| `{name}`, wall, median of {RUNS} | " + " | ".join(f"{r['wall_s'][name]:.2f} s" for r in runs)
                     + " |")
    lines.append(f"| {FIRST}, wall, once | " + " | ".join(f"{r['wall_s'].get(FIRST, float('nan')):.2f} s"
                                                          for r in runs) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--src", default=str(ROOT / "src"), help="the checkout's src folder")
    parser.add_argument("--label", default="after")
    parser.add_argument("--before", default=None, help="JSON written by an earlier run of this script")
    parser.add_argument("--out", default=None, help="write only this run's JSON here (no markdown)")
    parser.add_argument("--render", action="store_true", help="rewrite the markdown from the saved JSON, no timing")
    args = parser.parse_args()
    if args.render:
        runs = json.loads((RESULTS / "cli_startup.json").read_text())
    else:
        run = measure(Path(args.src), args.label)
        if args.out:
            Path(args.out).write_text(json.dumps(run, indent=2))
            print(json.dumps(run, indent=2))
            return
        runs = ([json.loads(Path(args.before).read_text())] if args.before else []) + [run]
    text = ["# CLI start-up (issue 22, part 5)", "",
            f"`python benchmarks/bench_cli_startup.py` (each command as `python -m ats ...`, {RUNS} timed runs after "
            "one untimed run, fresh `$ATS_CACHE`; the before column: `--src` at a checkout of 9c119ba).", "",
            table(runs), ""]
    for r in runs:
        slow = ", ".join(f"{name} {s:.2f} s" for s, name in r["slowest_imports"]) or "none"
        text.append(f"- {r['label']}: {r['machine']}; slowest imports under `import ats.cli.main`: {slow}")
    text += ["", NOTES]
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "cli_startup.json").write_text(json.dumps(runs, indent=2))
    (RESULTS / "cli_startup.md").write_text("\n".join(text) + "\n")
    print("\n".join(text))


if __name__ == "__main__":
    main()
