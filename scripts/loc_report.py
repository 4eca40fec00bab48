"""Source lines per layer (folder of src/ats) and the longest functions: the size report issue 23 asks for.

    python scripts/loc_report.py [--top 15] [--json out.json]

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--top", type=int, default=15)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    layers, functions = layer_lines(), longest_functions(top=args.top)
    print("| layer | lines |\n|---|---:|")
    for name, n in layers.items():
        print(f"| {name} | {n} |")
    print(f"| total | {sum(layers.values())} |\n\n| function | lines |\n|---|---:|")
    for n, name in functions:
        print(f"| `{name}` | {n} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"layers": layers, "functions": functions}, indent=1))


if __name__ == "__main__":
    main()
