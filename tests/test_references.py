"""What the learner and the instructor read points at things that exist.

Every `lab NN` named in a notebook, a doc or the engine's own comments is a lab of this
repository; every repository path (`engine_core/...`, `docs/...`) and every dotted engine name
(`engine_core.core.scheduler.Scheduler`) in the notebooks and docs resolves; nothing refers to
a document outside the repository.
"""
from __future__ import annotations

import json
import re

import pytest

from grader.labs import REPO_ROOT
from grader.seams import resolve

ROOTS = ("engine_core", "kernels", "grader", "docs", "tests", "solutions", "labs", "jupyter", "benchmarks", "examples")
PATH = re.compile(r"(?<![\w./-])((?:%s)/[\w./-]*\w)" % "|".join(ROOTS))
DOTTED = re.compile(r"`((?:engine_core|kernels|grader|benchmarks|examples)(?:\.\w+)+)")
LAB = re.compile(r"\b[Ll]abs? (\d\d)\b")
PLACEHOLDER = re.compile(r"NN|<|\*|\{|\.\.\.")


def texts() -> dict[str, str]:
    """Prose and code a reader sees: notebooks (every cell), docs, README, engine, grader, benchmark and example
    sources."""
    found = {}
    for nb in sorted(REPO_ROOT.glob("solutions/*/*.ipynb")):
        cells = json.loads(nb.read_text())["cells"]
        found[str(nb.relative_to(REPO_ROOT))] = "\n".join("".join(c["source"]) for c in cells)
    for pattern in ("docs/*.md", "README.md", "engine_core/**/*.py", "kernels/**/*.py", "grader/**/*.py",
                    "benchmarks/*.py", "examples/*.py"):
        for path in sorted(REPO_ROOT.glob(pattern)):
            found[str(path.relative_to(REPO_ROOT))] = path.read_text()
    return found


TEXTS = texts()
LABS = {p.name[:2] for p in (REPO_ROOT / "solutions").iterdir() if re.match(r"\d\d_", p.name)}


@pytest.mark.parametrize("name", sorted(TEXTS))
def test_every_lab_named_exists(name):
    missing = sorted({n for n in LAB.findall(TEXTS[name]) if n not in LABS})
    assert not missing, f"{name} names lab(s) {missing}; the labs are {sorted(LABS)}"


@pytest.mark.parametrize("name", sorted(n for n in TEXTS if n.endswith((".md", ".ipynb"))))
def test_every_repository_path_exists(name):
    text = TEXTS[name]
    paths = {p.rstrip(".") for p in PATH.findall(text) if not PLACEHOLDER.search(p)}
    missing = sorted(p for p in paths if not (REPO_ROOT / p).exists())
    assert not missing, f"{name} refers to paths that do not exist: {missing}"


@pytest.mark.parametrize("name", sorted(n for n in TEXTS if n.endswith((".md", ".ipynb"))))
def test_every_dotted_engine_name_resolves(name):
    missing = []
    for dotted in sorted(set(DOTTED.findall(TEXTS[name]))):
        try:
            resolve(dotted)
        except (ImportError, AttributeError):
            missing.append(dotted)
    assert not missing, f"{name} names things that do not exist: {missing}"


MARKDOWN = re.compile(r"(?<![\w/.-])([\w-]+\.md)\b")
PARENT = re.compile(r"(?<![\w.])\.\./[\w-]")
DOCUMENTS = {p.name for p in REPO_ROOT.rglob("*.md") if ".venv" not in p.parts}


@pytest.mark.parametrize("name", sorted(TEXTS))
def test_nothing_points_outside_the_repository(name):
    """Every markdown document named is one of the repository's, and no path climbs out of it."""
    missing = sorted(set(MARKDOWN.findall(TEXTS[name])) - DOCUMENTS)
    assert not missing, f"{name} names documents the repository does not have: {missing}"
    assert not PARENT.search(TEXTS[name]), f"{name} refers to a path above the repository"
