"""The seam table is the contract between the engine and the labs: it must match both sides.

Every seam and helper resolves in the engine; the private state a seam may touch exists (a rename
fails here, not in a learner's class); each seam's signature in the released stub notebook equals
the engine's; the solution's functions touch only declared state.
"""
from __future__ import annotations

import ast
import inspect
import json
import re
import textwrap
from types import ModuleType

import pytest

from grader.labs import REPO_ROOT
from grader.loader import is_graded_code
from grader.release import solution_labs
from grader.seams import SEAMLESS_LABS, SEAMS, Seam, labs_with_seams, resolve, seams_of

SEAM_IDS = [f"{s.lab}:{s.student_name}" for s in SEAMS]


def graded_functions(notebook) -> dict[str, ast.FunctionDef]:
    """Top-level functions of a notebook's graded cells, by name."""
    cells = json.loads(notebook.read_text())["cells"]
    found = {}
    for cell in cells:
        if is_graded_code(cell):
            source = "".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"]
            for node in ast.parse(source).body:
                if isinstance(node, ast.FunctionDef):
                    found[node.name] = node
    return found


def engine_function(seam: Seam) -> ast.FunctionDef:
    fn = resolve(seam.dotted)
    return ast.parse(textwrap.dedent(inspect.getsource(fn))).body[0]


def parameters(fn: ast.FunctionDef, names: bool = True) -> list[tuple]:
    """(name, kind, default) of each parameter; names left out when the seam allows other names."""
    a = fn.args
    positional = a.posonlyargs + a.args
    defaults = [None] * (len(positional) - len(a.defaults)) + [ast.unparse(d) for d in a.defaults]
    rows = [(p.arg, "positional", d) for p, d in zip(positional, defaults)]
    rows += [(f"*{a.vararg.arg}", "var", None)] if a.vararg else []
    rows += [(p.arg, "keyword", None if d is None else ast.unparse(d)) for p, d in zip(a.kwonlyargs, a.kw_defaults)]
    rows += [(f"**{a.kwarg.arg}", "var", None)] if a.kwarg else []
    return rows if names else [row[1:] for row in rows]


def instance_attributes(cls: type) -> set[str]:
    """Attributes a class's methods assign on `self`, plus its slots and dataclass fields."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    found = set(getattr(cls, "__slots__", ())) | set(getattr(cls, "__dataclass_fields__", {}))
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and \
                isinstance(node.value, ast.Name) and node.value.id == "self":
            found.add(node.attr)
    return found


def test_every_lab_has_seams_and_every_seam_names_a_lab():
    """Every lab has seams, except the seamless ones (SEAMLESS_LABS: graded on classes written from a blank page),
    which have none and exist."""
    assert labs_with_seams() == sorted(set(solution_labs()) - set(SEAMLESS_LABS))
    assert set(SEAMLESS_LABS) <= set(solution_labs()) and not set(SEAMLESS_LABS) & set(labs_with_seams())
    for lab in SEAMLESS_LABS:
        assert seams_of(lab) == ()


@pytest.mark.parametrize("seam", SEAMS, ids=SEAM_IDS)
def test_every_seam_and_helper_resolves(seam):
    owner = resolve(seam.owner)
    assert isinstance(owner, (type, ModuleType)), f"{seam.owner} is neither a class nor a module"
    assert callable(resolve(seam.dotted)), f"{seam.dotted} is not a function"
    for helper in seam.helpers:
        resolve(helper)


@pytest.mark.parametrize("seam", [s for s in SEAMS if s.private_state], ids=[i for s, i in zip(SEAMS, SEAM_IDS)
                                                                             if s.private_state])
def test_private_state_exists(seam):
    """Renaming engine state a learner's function touches must fail here."""
    for dotted in seam.private_state:
        owner, _, attr = dotted.rpartition(".")
        cls = resolve(owner)
        assert hasattr(cls, attr) or attr in instance_attributes(cls), (
            f"{seam.lab}: {dotted} (private state of seam {seam.qualname}) no longer exists in the engine")


@pytest.mark.parametrize("seam", SEAMS, ids=SEAM_IDS)
def test_stub_signature_equals_the_engines(seam):
    stub = graded_functions(REPO_ROOT / "labs" / seam.lab / f"{seam.lab}.ipynb")
    assert seam.student_name in stub, f"labs/{seam.lab} defines no `{seam.student_name}` in its graded cells"
    got = parameters(stub[seam.student_name], seam.same_parameter_names)
    want = parameters(engine_function(seam), seam.same_parameter_names)
    assert got == want, f"{seam.lab}: `{seam.student_name}` takes {got}, the engine's {seam.qualname} {want}"


@pytest.mark.parametrize("seam", [s for s in SEAMS if isinstance(resolve(s.owner), type)],
                         ids=[i for s, i in zip(SEAMS, SEAM_IDS) if isinstance(resolve(s.owner), type)])
def test_the_solution_touches_only_declared_state(seam):
    """Every `self.x` the solution reads or writes is a public method/property of the owner or declared
    private state of the seam: the contract is complete."""
    cls = resolve(seam.owner)
    fn = graded_functions(REPO_ROOT / "solutions" / seam.lab / f"{seam.lab}.ipynb")[seam.student_name]
    used = {n.attr for n in ast.walk(fn) if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name)
            and n.value.id == "self"}
    declared = {d.rpartition(".")[2] for d in seam.private_state if d.rpartition(".")[0] == seam.owner}
    public = {name for name in dir(cls) if not name.startswith("_")}
    undeclared = sorted(used - declared - public)
    assert not undeclared, f"{seam.lab}: the solution's {seam.student_name} touches undeclared state {undeclared}"


@pytest.mark.parametrize("seam", SEAMS, ids=SEAM_IDS)
def test_the_engine_marks_each_seam_with_its_lab(seam):
    """A comment at the seam's definition (the `def` line or the lines just above it) names the lab."""
    lines, start = inspect.getsourcelines(resolve(seam.dotted))
    module_lines = inspect.getsource(inspect.getmodule(resolve(seam.dotted))).splitlines()
    above = module_lines[max(0, start - 4):start - 1]
    marks = [re.search(r"seam: labs? ([\d, ]+)", line) for line in [*above, lines[0]]]
    assert any(seam.lab[:2] in m.group(1).replace(",", " ").split() for m in marks if m), (
        f"{seam.dotted}: no comment naming lab {seam.lab[:2]} at its definition")
