"""The grading kit: what a submission's untrusted process runs against in batch grading.

Two source transforms and the kit they build:

- `kit_tests_source`: a lab's official test module without what the learner's process must not
  hold. Every `expect_*` call's expected argument and message become `...` (never evaluated),
  bare `assert` statements, docstrings and comments are blanked, and top-level helpers and
  constants no longer used (the spec functions behind expected values) are dropped. Line numbers
  are kept, so observations name the same lines as in the original module.
- `remove_seam_bodies`: an engine source file whose seam functions' bodies (after the docstring)
  raise `kit_removed(...)`: the learner's code that calls them gets "uses the reference
  implementation".
- `kit_files(lab)`: grader (only this lab's test module, transformed; no planted bugs),
  engine_core and kernels with the lab's seams and helpers removed, as {relative path: bytes}.
"""
from __future__ import annotations

import ast
import io
import tokenize
from collections import defaultdict
from pathlib import Path
from types import SimpleNamespace

from grader.labs import REPO_ROOT, check_lab_name
from grader.seams import module_of, seams_of

KIT_PACKAGES = ("grader", "engine_core", "kernels")
# expect function -> (position of the expected argument, its keyword, the other keywords that are expected values)
EXPECTED_ARGUMENT = {"expect_equal": (1, "expected", ()), "expect_close": (1, "expected", ()),
                     "expect_prediction": (1, "expected", ()), "expect_raises": (0, "exc_type", ("match",))}
MESSAGE_POSITION = {"expect_equal": 2, "expect_close": 2, "expect_prediction": 2, "expect_raises": None}
KEPT_NAMES = frozenset({"pytestmark", "__all__"})


def _offsets(data: bytes) -> list[int]:
    """Byte offset of the start of each line (1-based line numbers index it directly)."""
    starts, pos = [0, 0], 0
    for line in data.splitlines(keepends=True):
        pos += len(line)
        starts.append(pos)
    return starts


def _span(node: ast.AST, starts: list[int]) -> tuple[int, int]:
    return starts[node.lineno] + node.col_offset, starts[node.end_lineno] + node.end_col_offset


def _splice(source: str, edits: list[tuple[ast.AST, str]]) -> str:
    """Replaces each node's source by its text plus the newlines the node spanned (lines are kept);
    an edit inside another edit's span is dropped."""
    data = source.encode()
    starts = _offsets(data)
    spans = sorted((*_span(node, starts), text) for node, text in edits)
    kept: list[tuple[int, int, str]] = []
    for start, end, text in spans:
        if kept and start < kept[-1][1]:
            continue
        kept.append((start, end, text))
    for start, end, text in reversed(kept):
        newlines = data[start:end].count(b"\n")
        data = data[:start] + text.encode() + b"\n" * newlines + data[end:]
    return data.decode()


def _expect_name(call: ast.Call) -> str | None:
    func = call.func
    name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else None
    return name if name in EXPECTED_ARGUMENT else None


def _hidden_arguments(call: ast.Call, name: str) -> list[ast.AST]:
    """The nodes of an expect_* call the learner's process must not evaluate: expected values, the message."""
    position, keyword, more = EXPECTED_ARGUMENT[name]
    found = [call.args[position]] if len(call.args) > position else []
    message_at = MESSAGE_POSITION[name]
    if message_at is not None and len(call.args) > message_at:
        found.append(call.args[message_at])
    found += [k.value for k in call.keywords if k.arg in (keyword, "message", *more)]
    return found


def _docstring(node: ast.AST) -> ast.Expr | None:
    body = getattr(node, "body", None)
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
            and isinstance(body[0].value.value, str):
        return body[0]
    return None


def _strip_comments(source: str) -> str:
    lines = source.splitlines(keepends=True)
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            row, col = token.start
            line = lines[row - 1]
            lines[row - 1] = line[:col].rstrip() + ("\n" if line.endswith("\n") else "")
    return "".join(lines)


def _with_decorators(stmt: ast.stmt) -> ast.AST:
    """A statement's span including its decorators (`@` sits one column left of the decorator)."""
    decorators = getattr(stmt, "decorator_list", [])
    if not decorators:
        return stmt
    first = decorators[0]
    return SimpleNamespace(lineno=first.lineno, col_offset=first.col_offset - 1, end_lineno=stmt.end_lineno,
                           end_col_offset=stmt.end_col_offset)


def _dead_definitions(tree: ast.Module) -> list[ast.stmt]:
    """Top-level functions (not tests, fixtures or hooks) and constants nothing else in the module refers to."""
    used: dict[str, int] = defaultdict(int)
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load):
            used[node.id] += 1
    dead = []
    for stmt in tree.body:
        kept = stmt.name.startswith(("test_", "pytest_")) if isinstance(stmt, ast.FunctionDef) else True
        if isinstance(stmt, ast.FunctionDef) and not kept and not any(
                "fixture" in ast.unparse(d) or "hookimpl" in ast.unparse(d) for d in stmt.decorator_list):
            inside = sum(1 for n in ast.walk(stmt) if isinstance(n, ast.Name) and n.id == stmt.name)
            if used[stmt.name] == inside:
                dead.append(stmt)
        elif isinstance(stmt, ast.Assign) and all(isinstance(t, ast.Name) for t in stmt.targets):
            names = [t.id for t in stmt.targets]
            if not any(used[n] or n in KEPT_NAMES or n.startswith("__") for n in names):
                dead.append(stmt)
    return dead


def kit_tests_source(source: str) -> str:
    """The kit version of an official test module (see the module docstring); line numbers kept."""
    tree = ast.parse(source)
    edits: list[tuple[ast.AST, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and (name := _expect_name(node)):
            edits += [(arg, "...") for arg in _hidden_arguments(node, name)]
        elif isinstance(node, ast.Assert):
            edits.append((node, "pass"))
        elif isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            doc = _docstring(node)
            if doc is not None:
                edits.append((doc, "pass"))
    source = _splice(source, edits)
    while dead := _dead_definitions(ast.parse(source)):
        source = _splice(source, [(_with_decorators(stmt), "pass") for stmt in dead])
    return _strip_comments(source)


SANITY = "(a test bug)"  # how a bare assert that checks the test itself, not the learner, ends its message


def comparisons_left(source: str) -> list[str]:
    """Checks of the learner's code that are not observations, in a test module: bare `assert`s whose
    message does not end in SANITY, pytest.raises / pytest.fail, AssertionError. [] for a lab
    converted to observations (the kit removes them, so batch grading would not see them)."""
    tree = ast.parse(source)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Assert):
            message = node.msg.value if isinstance(node.msg, ast.Constant) else ""
            if not str(message).endswith(SANITY):
                found.append(f"assert on line {node.lineno}")
        elif isinstance(node, ast.Call) and ast.unparse(node.func) in ("pytest.raises", "pytest.fail", "AssertionError"):
            found.append(f"{ast.unparse(node.func)} on line {node.lineno}")
    return found


def _find_function(tree: ast.Module, qualname: str) -> ast.FunctionDef:
    scope: list[ast.stmt] = tree.body
    *classes, name = qualname.split(".")
    for cls in classes:
        scope = next(n for n in scope if isinstance(n, ast.ClassDef) and n.name == cls).body
    return next(n for n in scope if isinstance(n, ast.FunctionDef) and n.name == name)


def remove_seam_bodies(source: str, removed: dict[str, str]) -> str:
    """`source` with each function `qualname` in `removed` (qualname -> what it is, for the message)
    reduced to its docstring and `raise kit_removed(...)`."""
    tree = ast.parse(source)
    lines = source.splitlines(keepends=True)
    targets = []
    for qualname, what in removed.items():
        fn = _find_function(tree, qualname)
        body = fn.body[1:] if _docstring(fn) is not None and len(fn.body) > 1 else fn.body
        targets.append((body[0].lineno, body[-1].end_lineno, body[0].col_offset, what))
    for first, last, indent, what in sorted(targets, reverse=True):
        raise_line = (" " * indent + "raise __import__('grader.delegation', fromlist=['kit_removed'])"
                      f".kit_removed({what!r})\n")
        lines[first - 1:last] = [raise_line]
    return "".join(lines)


def _removed_by_file(lab: str, root: Path) -> dict[Path, dict[str, str]]:
    """For each engine file holding one of the lab's seams or helpers: {qualname inside it: description}."""
    found: dict[Path, dict[str, str]] = defaultdict(dict)
    for seam in seams_of(lab):
        for dotted, what in [(seam.dotted, f"lab {lab}'s seam {seam.qualname}"),
                             *[(h, f"{h.rsplit('.', 1)[-1]}, a helper of lab {lab}'s seam {seam.qualname}")
                               for h in seam.helpers]]:
            module = module_of(dotted)
            path = root / (module.replace(".", "/") + ".py")
            if not path.is_file():  # a package: the name lives in its __init__.py
                path = root / module.replace(".", "/") / "__init__.py"
            found[path][dotted[len(module) + 1:]] = what
    return found


def _package_files(root: Path, package: str) -> list[Path]:
    return [p for p in sorted((root / package).rglob("*"))
            if p.is_file() and "__pycache__" not in p.parts and p.suffix != ".pyc"]


def kit_files(lab: str, root: Path = REPO_ROOT) -> dict[str, bytes]:
    """The kit for grading `lab`: {path relative to the kit root: contents}."""
    check_lab_name(lab)
    removed = _removed_by_file(lab, root)
    files: dict[str, bytes] = {}
    for package in KIT_PACKAGES:
        for path in _package_files(root, package):
            rel = path.relative_to(root)
            if rel.parts[:2] == ("grader", "labtests"):
                if path.name == "__init__.py":
                    files[str(rel)] = path.read_bytes()
                elif path.name == f"lab{lab}.py":
                    files[str(rel)] = kit_tests_source(path.read_text()).encode()
                continue
            data = path.read_bytes()
            if path in removed:
                data = remove_seam_bodies(data.decode(), removed[path]).encode()
            files[str(rel)] = data
    return files


def write_kit(files: dict[str, bytes], root: Path) -> None:
    for name, data in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
