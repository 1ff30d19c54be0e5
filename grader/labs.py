"""Where labs live: `solutions/NN_name/NN_name.ipynb`, released to `labs/NN_name/`, with their
official tests in `grader/labtests/labNN_name.py` and planted bugs in `labNN_name_bugs.py`."""
from __future__ import annotations

import importlib
import re
from pathlib import Path
from types import ModuleType

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
    return importlib.import_module(tests_module_name(check_lab_name(lab)))


def lab_of_notebook(path: Path) -> str | None:
    """The lab a notebook belongs to (`.../NN_name/NN_name.ipynb`), or None for any other file."""
    if path.suffix != ".ipynb" or path.stem != path.parent.name or not LAB_NAME.match(path.stem):
        return None
    return path.stem if tests_path(path.stem).is_file() else None
