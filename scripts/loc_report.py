"""Source lines per layer (folder of src/ats) and the longest functions: the size report issue 23 asks for.

    python scripts/loc_report.py [--top 15] [--json out.json] [--root DIR] [--compare before.json]

`--root` measures another checkout's src/ats (e.g. a `git worktree` of an older commit); `--compare` prints the
layers, the longest functions and the largest files of a saved report beside this one.

Lines are physical lines of .py files (blank and comment lines included, as `wc -l` counts them); a function's
length is its last line minus its first line + 1 (decorators excluded), nested functions counted on their own.
"""

from __future__ import annotations

import argparse
import ast
import json
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "src" / "ats"


def layer_lines(root: Path = ROOT) -> dict[str, int]:
    """Layer (top-level folder, or '(top)' for modules directly under src/ats) -> source lines."""
    lines: Counter = Counter()
    for path in root.rglob("*.py"):
        rel = path.relative_to(root)
        layer = rel.parts[0] if len(rel.parts) > 1 else "(top)"
        lines[layer] += len(path.read_text().splitlines())
    return dict(sorted(lines.items(), key=lambda kv: -kv[1]))


def longest_functions(root: Path = ROOT, top: int = 15) -> list[tuple[int, str]]:
    """(lines, 'path:qualname') of the `top` longest functions and methods."""
    found = []
    for path in root.rglob("*.py"):
        tree = ast.parse(path.read_text())
        stack = [(tree, "")]
        while stack:
            node, prefix = stack.pop()
            for child in ast.iter_child_nodes(node):
                if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    name = f"{prefix}{child.name}"
                    if not isinstance(child, ast.ClassDef):
                        found.append((child.end_lineno - child.lineno + 1,
                                      f"{path.relative_to(root.parent)}:{name}"))
                    stack.append((child, name + "."))
    return sorted(found, reverse=True)[:top]


def largest_files(root: Path = ROOT, top: int = 15) -> list[tuple[int, str]]:
    """(lines, path) of the `top` largest source files."""
    sizes = [(len(p.read_text().splitlines()), str(p.relative_to(root.parent))) for p in root.rglob("*.py")]
    return sorted(sizes, reverse=True)[:top]


def comparison(before: dict, after: dict) -> str:
    """Markdown tables of two reports: lines per layer (before, after, change), then the longest functions and the
    largest files of each, side by side."""
    lines = ["| layer | before | after | change |", "|---|---:|---:|---:|"]
    for name in sorted(set(before["layers"]) | set(after["layers"]), key=lambda n: -after["layers"].get(n, 0)):
        b, a = before["layers"].get(name, 0), after["layers"].get(name, 0)
        lines.append(f"| {name} | {b} | {a} | {a - b:+d} |")
    b, a = sum(before["layers"].values()), sum(after["layers"].values())
    lines.append(f"| total | {b} | {a} | {a - b:+d} |")
    for key, title in (("functions", "function"), ("files", "file")):
        lines += ["", f"| longest {title}s before | lines | after | lines |", "|---|---:|---|---:|"]
        for (nb, wb), (na, wa) in zip(before.get(key, []), after.get(key, [])):
            lines.append(f"| `{wb}` | {nb} | `{wa}` | {na} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--top", type=int, default=15)
    parser.add_argument("--json", default=None)
    parser.add_argument("--root", default=None, help="another checkout's root (default: this one)")
    parser.add_argument("--compare", default=None, help="a report saved with --json, printed beside this one")
    args = parser.parse_args()
    root = Path(args.root) / "src" / "ats" if args.root else ROOT
    layers, functions = layer_lines(root), longest_functions(root, top=args.top)
    report = {"layers": layers, "functions": functions, "files": largest_files(root, top=args.top)}
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    if args.compare:
        print(comparison(json.loads(Path(args.compare).read_text()), report))
        return
    print("| layer | lines |\n|---|---:|")
    for name, n in layers.items():
        print(f"| {name} | {n} |")
    print(f"| total | {sum(layers.values())} |\n\n| function | lines |\n|---|---:|")
    for n, name in functions:
        print(f"| `{name}` | {n} |")


if __name__ == "__main__":
    main()
