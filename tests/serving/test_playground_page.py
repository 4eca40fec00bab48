"""The playground's files: installed with the package (pyproject's package data), self-contained (no address outside
the server: works offline, no CDN) and never parsing text as HTML (no innerHTML and the like)."""

from __future__ import annotations

import fnmatch
import re
from importlib import resources
from pathlib import Path

import pytest

from ats.errors import ATSError
from ats.serving.playground import PAGE_PATHS, STATIC
from ats.serving.saved_evaluation import SavedEvaluation

REPO = Path(__file__).resolve().parents[2]
FILES = ["index.html", *STATIC]


def _text(name: str) -> str:
    return resources.files("ats.serving").joinpath("static", name).read_text(encoding="utf-8")


def test_every_page_file_is_package_data():
    section = (REPO / "pyproject.toml").read_text().split("[tool.setuptools.package-data]", 1)[1].split("\n[", 1)[0]
    line = next(x for x in section.splitlines() if x.startswith('"ats.serving"'))  # (no tomllib on Python 3.10)
    patterns = re.findall(r'"([^"]+)"', line.split("=", 1)[1].split("#", 1)[0])
    assert patterns
    on_disk = sorted(p.name for p in (REPO / "src" / "ats" / "serving" / "static").iterdir())
    assert on_disk == sorted(FILES)
    assert all(any(fnmatch.fnmatch(f"static/{name}", pattern) for pattern in patterns) for name in on_disk)


def test_the_page_loads_nothing_from_outside_the_server():
    for name in FILES:
        assert not re.search(r"(https?:)?//[a-z0-9.-]+\.[a-z]{2,}", _text(name), re.I), name
    html = _text("index.html")
    assert sorted(re.findall(r'(?:href|src)="([^"]+)"', html)) == sorted(p for p in PAGE_PATHS if p != "/")


def test_the_script_never_parses_text_as_html():
    code = _text("playground.js")
    for sink in ("innerHTML", "outerHTML", "insertAdjacentHTML", "document.write", "eval(", "new Function",
                 "DOMParser", "createContextualFragment"):
        assert sink not in code.replace("nothing here uses innerHTML", ""), sink


def test_a_folder_without_results_is_refused_by_name(tmp_path):
    with pytest.raises(ATSError, match=f"--eval {tmp_path}: no results.json"):
        SavedEvaluation(tmp_path)
    (tmp_path / "results.json").write_text('{"triviaqa": [1, 2]}')
    with pytest.raises(ATSError, match="expected task -> method -> metrics"):
        SavedEvaluation(tmp_path)


def test_serve_refuses_playground_options_it_cannot_honour_in_one_line(model_dir, tmp_path, capsys):
    from ats.cli import main

    cases = [(["serve", "--engine", "vllm", "--model", str(model_dir), "--calibrator", "none", "--compare", "none"],
              "--compare: an option of the playground"),
             (["serve", "--model", str(model_dir), "--calibrator", "none", "--eval", str(tmp_path)],
              f"--eval {tmp_path}: no results.json there"),
             (["serve", "--model", str(model_dir), "--calibrator", "none", "--compare", str(tmp_path / "missing")],
              "missing")]
    for argv, message in cases:
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.startswith("ats: error: ") and message in err and err.count("\n") == 1, err
