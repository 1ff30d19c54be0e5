"""Builds a Python module from a lab notebook's graded code.

Only nbgrader solution cells and cells tagged `setup` run (never demo or test cells), in
notebook order, inside one fresh module. Each cell's source is registered in `linecache`
under the name "cell N of <notebook>", so `inspect.getsource` works (Triton's `@triton.jit`
reads the source) and tracebacks point at the notebook cell. A cell that raises does not
stop the load: later cells still run, and reading a name the notebook never managed to
define raises `StudentCodeError` quoting "cell N of <notebook>: ..." at the test that
needs it, so only the tests using that code fail.
"""
from __future__ import annotations

import itertools
import json
import linecache
import os
import re
import sys
import traceback
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

SETUP_TAG = "setup"
_MAGIC_LINE = re.compile(r"^(\s*)([%!])")
_module_ids = itertools.count()


class StudentCodeError(AttributeError):
    """The learner's code does not provide a name a test needs (and why, if a cell failed)."""


@dataclass(frozen=True)
class CellError:
    """One graded cell that raised while the notebook loaded."""

    cell_label: str  # "cell N of <notebook>"
    summary: str  # "ZeroDivisionError: division by zero"
    traceback: str  # formatted, frames inside the grader removed

    def __str__(self) -> str:
        return f"{self.cell_label}: {self.summary}"


def _source(cell: dict) -> str:
    source = cell.get("source", "")
    return "".join(source) if isinstance(source, list) else source


def read_cells(path: Path) -> list[dict]:
    """The cells of an nbformat-4 notebook: plain JSON, without nbformat (2 s to import)."""
    with open(path, encoding="utf-8") as f:
        nb = json.load(f)
    if not isinstance(nb, dict) or nb.get("nbformat") != 4 or not isinstance(nb.get("cells"), list):
        raise ValueError(f"{path} is not an nbformat-4 notebook (save it with Jupyter >= 4)")
    return nb["cells"]


def is_graded_code(cell: dict) -> bool:
    """True for the cells whose code a lab's tests may use: solution cells and `setup` cells."""
    if cell.get("cell_type") != "code":
        return False
    meta = cell.get("metadata", {})
    return bool(meta.get("nbgrader", {}).get("solution")) or SETUP_TAG in meta.get("tags", [])


def manually_graded(cells: list[dict]) -> list[tuple[str, float]]:
    """(grade_id, points) of the answers a person grades: nbgrader cells that are graded and
    written by the learner but hold no code a test can run (interview answers in markdown)."""
    found = []
    for cell in cells:
        meta = cell.get("metadata", {}).get("nbgrader", {})
        if cell.get("cell_type") == "markdown" and meta.get("grade") and meta.get("solution"):
            found.append((str(meta.get("grade_id", "?")), float(meta.get("points", 0))))
    return found


def _strip_magics(source: str) -> str:
    """Comments out IPython `%magic` / `!shell` lines, which are not Python (line numbers kept)."""
    return "\n".join(_MAGIC_LINE.sub(r"\1# \2", line) for line in source.split("\n"))


def display_path(path: Path) -> str:
    """The notebook path as a learner reads it: relative to the working directory when inside it."""
    try:
        return str(path.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path.resolve())


def _register_source(filename: str, source: str) -> None:
    """Puts a cell's source in linecache; mtime None keeps `linecache.checkcache` from dropping it."""
    lines = [line + "\n" for line in source.split("\n")]
    linecache.cache[filename] = (len(source), None, lines, filename)


def _format_error(exc: BaseException, filename: str) -> str:
    """The traceback from the learner's cell down, without the loader's own frame."""
    tb = exc.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename != filename:
        tb = tb.tb_next
    return "".join(traceback.format_exception(type(exc), exc, tb))


class NotebookModule(types.ModuleType):
    """A module built from notebook cells; remembers which cells failed so errors name them."""

    __notebook__: str
    __cell_errors__: list[CellError]
    __sources__: dict[str, str]  # "cell N of <notebook>" -> the code that ran (grader/delegation.py scans it)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        errors = self.__dict__.get("__cell_errors__", [])
        if errors:
            reasons = "; ".join(str(e) for e in errors)
            raise StudentCodeError(f"`{name}` is not defined because {reasons}")
        raise StudentCodeError(
            f"{self.__dict__.get('__notebook__', 'the notebook')} defines no `{name}` in its "
            f"graded cells (solution cells or cells tagged '{SETUP_TAG}'): keep the name the "
            f"exercise gives"
        )


def load_notebook(
    path: str | os.PathLike[str],
    *,
    cell_filter: Callable[[dict], bool] = is_graded_code,
    edits: list[tuple[str, str]] | None = None,
) -> NotebookModule:
    """Executes the notebook's graded cells in a new module and returns it.

    `edits` are (old, new) text replacements applied to the selected cells' sources
    (the meta-test plants bugs with them); an edit that matches no cell is a ValueError.
    Raises OSError / ValueError only when the file itself cannot be read as a notebook.
    """
    path = Path(path)
    cells = read_cells(path)
    label = display_path(path)
    numbered = [(i + 1, cell) for i, cell in enumerate(cells) if cell_filter(cell)]
    sources = [_source(cell) for _, cell in numbered]
    for old, new in edits or []:
        hits = [k for k, src in enumerate(sources) if old in src]
        if not hits:
            raise ValueError(f"edits: the text {old!r} occurs in no graded cell of {label}")
        for k in hits:
            sources[k] = sources[k].replace(old, new)

    name = f"student_{re.sub(r'[^0-9a-zA-Z_]', '_', path.stem)}_{next(_module_ids)}"
    module = NotebookModule(name, f"graded code of {label}")
    module.__notebook__ = label
    module.__cell_errors__ = []
    module.__sources__ = {}
    module.__file__ = str(path.resolve())
    sys.modules[name] = module  # dataclasses and pickle look modules up by name
    for (number, _), source in zip(numbered, sources):
        filename = f"cell {number} of {label}"
        code_text = _strip_magics(source)
        _register_source(filename, code_text)
        module.__sources__[filename] = code_text
        try:
            exec(compile(code_text, filename, "exec", dont_inherit=True), module.__dict__)
        except BaseException as exc:  # noqa: BLE001 - any learner error, even SystemExit, is data
            if isinstance(exc, KeyboardInterrupt):
                raise
            summary = traceback.format_exception_only(type(exc), exc)[-1].strip()
            module.__cell_errors__.append(CellError(filename, summary, _format_error(exc, filename)))
    return module


def module_from_namespace(namespace: dict[str, Any], label: str = "the notebook") -> NotebookModule:
    """Wraps a live namespace (a notebook's `globals()`) as a module for the `student` fixture."""
    module = NotebookModule(f"student_live_{next(_module_ids)}", f"live namespace of {label}")
    module.__dict__.update({k: v for k, v in namespace.items() if not k.startswith("__")})
    module.__notebook__ = label
    module.__cell_errors__ = []
    return module
