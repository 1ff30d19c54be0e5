"""Where labs live: `solutions/NN_name/NN_name.ipynb`, released to `labs/NN_name/`, with their
official tests in `grader/labtests/labNN_name.py` and planted bugs in `labNN_name_bugs.py`."""
from __future__ import annotations

import importlib
import re
import warnings
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

from _pytest.mark.structures import get_unpacked_marks

REPO_ROOT = Path(__file__).resolve().parent.parent
LABTESTS_DIR = Path(__file__).resolve().parent / "labtests"
LAB_NAME = re.compile(r"^\d\d_[a-z0-9_]+$")


def check_lab_name(lab: str) -> str:
    """Returns `lab` if it names a lab with official tests, else raises ValueError listing the labs."""
    if not isinstance(lab, str) or not LAB_NAME.match(lab) or not tests_path(lab).is_file():
        raise ValueError(f"lab must be one of {available_labs()} (NN_name), got {lab!r}")
    return lab


def tests_module_name(lab: str) -> str:
    """`00_warmup` -> `grader.labtests.lab00_warmup` (a lab name alone is no valid module name)."""
    return f"grader.labtests.lab{lab}"


def tests_path(lab: str) -> Path:
    return LABTESTS_DIR / f"lab{lab}.py"


def bugs_path(lab: str) -> Path:
    return LABTESTS_DIR / f"lab{lab}_bugs.py"


def available_labs() -> list[str]:
    """Every lab with an official test module, in order."""
    found = (p.stem[len("lab"):] for p in LABTESTS_DIR.glob("lab*.py") if not p.stem.endswith("_bugs"))
    return sorted(name for name in found if LAB_NAME.match(name))


def import_tests(lab: str) -> ModuleType:
    with warnings.catch_warnings():  # points/task marks are registered by the plugin, maybe absent here
        warnings.simplefilter("ignore")
        return importlib.import_module(tests_module_name(check_lab_name(lab)))


@dataclass(frozen=True)
class OfficialTest:
    name: str
    task: str
    points: float | None  # None: the test lacks its `points` mark


def official_tests(lab: str) -> list[OfficialTest]:
    """The lab's test functions with their task and points, read from their marks (file order)."""
    module = import_tests(lab)
    module_marks = get_unpacked_marks(module)
    found = []
    for name, fn in vars(module).items():
        if not (name.startswith("test_") and callable(fn)):
            continue
        marks = {}
        for mark in [*module_marks, *get_unpacked_marks(fn)]:  # the test's own marks win
            marks[mark.name] = mark
        task = str(marks["task"].args[0]) if "task" in marks else name[len("test_"):]
        points = float(marks["points"].args[0]) if "points" in marks else None
        found.append(OfficialTest(name, task, points))
    return found


def lab_of_notebook(path: Path) -> str | None:
    """The lab a notebook belongs to (`.../NN_name/NN_name.ipynb`), or None for any other file."""
    if path.suffix != ".ipynb" or path.stem != path.parent.name or not LAB_NAME.match(path.stem):
        return None
    return path.stem if tests_path(path.stem).is_file() else None
