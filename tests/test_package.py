"""The package as a whole: no pickle anywhere, no remote code by default, and layers that import only downwards."""

from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "ats"


def _calls(name: str):
    """(file, call node) of every call of `name` (a dotted name such as "torch.load") in the package."""
    import ast

    for path in SRC.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and ast.unparse(node.func) == name:
                yield path, node


def test_no_pickle_anywhere():
    """No module imports pickle, and every torch.load passes weights_only=True (tensors only, no code)."""
    import ast

    imports = [str(p.relative_to(SRC)) for p in SRC.rglob("*.py") for node in ast.walk(ast.parse(p.read_text()))
               if isinstance(node, (ast.Import, ast.ImportFrom)) and
               "pickle" in ([a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""])]
    assert imports == []
    unsafe = [f"{p.relative_to(SRC)}:{node.lineno}" for p, node in _calls("torch.load")
              if not any(k.arg == "weights_only" and ast.unparse(k.value) == "True" for k in node.keywords)]
    assert unsafe == []


def test_no_remote_code_by_default():
    """Neither the library nor the command line runs a model repository's own code unless asked."""
    import inspect

    from ats.cli.main import build_parser
    from ats.model.backbone import load_backbone

    assert inspect.signature(load_backbone).parameters["trust_remote_code"].default is False
    parser = build_parser()
    for argv in (["train", "--out", "x"], ["eval", "--out", "x"], ["generate", "--calibrator", "x", "hi"],
                 ["serve", "--calibrator", "x"]):
        assert parser.parse_args(argv).trust_remote_code is False, argv
    assert parser.parse_args(["train", "--out", "x", "--trust-remote-code"]).trust_remote_code is True


# bottom to top
LAYERS = ["model", "calibrators", "training", "generation", "evaluation", "workflows", "serving", "integrations", "cli"]


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


def documented_modules(doc: str) -> set[str]:
    """The module paths (relative to src/ats) that the tree in docs/architecture.md lists: each entry in the folder
    above it, so that `export.py` under `cli/` does not also stand for `integrations/vllm/export.py`. Entries sit two
    spaces deeper than their folder; several may share a line; descriptions follow after a wider gap."""
    tree = doc.split("```\nsrc/ats/\n", 1)[1].split("```", 1)[0]
    folders: list[str] = []
    found = set()
    for line in tree.splitlines():
        indent = len(line) - len(line.lstrip(" "))
        if not line.strip() or indent >= 20 or indent % 2:  # blank, or a description's continuation
            continue
        depth = indent // 2 - 1
        del folders[depth:]
        for word in line.split():
            if word.endswith("/"):
                folders.append(word.rstrip("/"))
                break
            if not word.endswith(".py"):
                break
            found.add("/".join([*folders, word]))
    return found


def test_every_module_is_named_in_its_folder_in_the_architecture_doc():
    doc = (SRC.parents[1] / "docs" / "architecture.md").read_text()
    every = {str(p.relative_to(SRC)) for p in SRC.rglob("*.py")}
    modules = {m for m in every if Path(m).name not in ("__init__.py", "__main__.py")}
    documented = documented_modules(doc)
    assert sorted(modules - documented) == []  # every module is listed where it lives
    assert sorted(documented - every) == []  # and the tree names no module that does not exist


def test_documented_modules_reads_each_entry_in_its_folder():
    doc = ("```\nsrc/ats/\n  io.py   atomic files\n  cli/    the command line\n    export.py  eval.py   two\n"
           "                         export.py in a description\n  integrations/   bridges\n    vllm/  vLLM\n"
           "      export.py    the export\n```\n")
    assert documented_modules(doc) == {"io.py", "cli/export.py", "cli/eval.py", "integrations/vllm/export.py"}


def test_encoding_prompts_leaves_the_shared_tokenizer_alone(tiny_backbone):
    """encode_prompts left-pads (each row = its prompt encoded alone, pad ids in front) without ever setting the
    shared tokenizer's padding_side, which other threads (the server's) read meanwhile."""
    from ats.generation.api import encode_prompts

    tok = tiny_backbone.tokenizer
    before = tok.padding_side
    seen = []

    class Watch(type(tok)):  # records every assignment of padding_side during the call
        def __setattr__(self, name, value):
            if name == "padding_side":
                seen.append(value)
            super().__setattr__(name, value)

    original = tok.__class__
    tok.__class__ = Watch
    try:
        ids, mask, texts = encode_prompts(tiny_backbone, ["Hi", "The capital of France is"], chat_template=False)
    finally:
        tok.__class__ = original
    assert seen == [] and tok.padding_side == before
    alone = [tok(t, add_special_tokens=True).input_ids for t in texts]
    width = max(map(len, alone))
    assert ids.tolist() == [[tok.pad_token_id] * (width - len(a)) + a for a in alone]
    assert mask.tolist() == [[0] * (width - len(a)) + [1] * len(a) for a in alone]
