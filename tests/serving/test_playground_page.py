"""The playground's files: installed with the package (pyproject's package data), self-contained (no address outside
the server: works offline, no CDN) and never parsing text as HTML (no innerHTML and the like)."""

from __future__ import annotations

import fnmatch
import re
import tomllib
from importlib import resources
from pathlib import Path

from ats.serving.playground import PAGE_PATHS, STATIC

REPO = Path(__file__).resolve().parents[2]
FILES = ["index.html", *STATIC]


def _text(name: str) -> str:
    return resources.files("ats.serving").joinpath("static", name).read_text(encoding="utf-8")


def test_every_page_file_is_package_data():
    config = tomllib.loads((REPO / "pyproject.toml").read_text())
    patterns = config["tool"]["setuptools"]["package-data"]["ats.serving"]
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
