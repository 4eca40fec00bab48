"""The package as a whole: no pickle anywhere, no remote code by default, and layers that import only downwards."""

import subprocess
import sys
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "ats"


def test_no_pickle_and_no_remote_code_by_default():
    sources = "\n".join(p.read_text() for p in SRC.rglob("*.py"))
    assert "import pickle" not in sources and "torch.load(" not in sources.replace("weights_only=True", "")
    assert "trust_remote_code: bool = False" in (SRC / "model" / "backbone.py").read_text()
    help_text = subprocess.run([sys.executable, "-m", "ats", "train", "--help"], capture_output=True, text=True).stdout
    assert "--trust-remote-code" in help_text


# bottom to top
LAYERS = ["model", "calibrators", "training", "evaluation", "generation", "workflows", "serving", "integrations", "cli"]


def _layer(module: str) -> int:
    """-1 for the shared base modules (errors, io, checks, config, sources, fingerprint), else the layer's index."""
    parts = module.split(".")
    return LAYERS.index(parts[1]) if len(parts) > 1 and parts[1] in LAYERS else -1


def _imports(path: Path) -> list[str]:
    """Absolute names of the ats modules that `path` imports (relative imports resolved)."""
    import ast

    module = "ats." + ".".join(path.relative_to(SRC).with_suffix("").parts)
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    package = package.removesuffix(".__init__")
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module or ""
            if name.startswith("ats"):
                found += [name] if node.module else [f"{name}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            found += [a.name for a in node.names if a.name.startswith("ats")]
    return found


def test_each_layer_imports_only_the_layers_below_it():
    offenders = []
    for path in SRC.rglob("*.py"):
        module = "ats." + ".".join(path.relative_to(SRC).with_suffix("").parts)
        if path.name == "__main__.py":
            continue
        for name in _imports(path):
            if _layer(name) > _layer(module):
                offenders.append(f"{module} imports {name}")
    assert offenders == []


def test_every_module_is_named_in_the_architecture_doc():
    doc = (SRC.parents[1] / "docs" / "architecture.md").read_text()
    missing = [str(p.relative_to(SRC)) for p in SRC.rglob("*.py")
               if p.name not in ("__init__.py", "__main__.py") and p.name not in doc]
    assert missing == []
