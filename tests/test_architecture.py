"""docs/architecture.md stays true to the code: every engine, benchmark and example module is on its map,
the import graph of engine_core, kernels, grader, benchmarks and examples has no cycle, and nothing below
the tools imports them (imports inside functions and under
TYPE_CHECKING count too: a cycle hidden there is still a cycle in the design)."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("engine_core", "kernels", "grader", "benchmarks", "examples")
TOOLS = ("benchmarks", "examples")  # measurement and demo programs: above everything, imported by nothing


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))}


def imports_of(name: str, path: Path, known: set[str]) -> set[str]:
    """Project modules `name` imports anywhere in its file (a package's __init__ counts as the package)."""
    found = set()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            submodules = [f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in known]
            targets = submodules or [base]  # `from pkg import module` depends on the module, not pkg's __init__
        else:
            continue
        for t in targets:
            while t and t not in known:
                t = t.rpartition(".")[0]
            if t and t != name:
                found.add(t)
    return found


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1 on the stack, 2 done
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_no_import_cycles():
    mods = modules()
    known = set(mods)
    graph = {name: imports_of(name, path, known) for name, path in mods.items()}
    assert find_cycle(graph) is None, f"import cycle: {' -> '.join(find_cycle(graph))}"


def test_the_cycle_finder_finds_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_every_engine_module_is_on_the_architecture_map():
    doc = (ROOT / "docs" / "architecture.md").read_text()
    missing = [str(p.relative_to(ROOT)) for pkg in ("engine_core", *TOOLS) for p in sorted((ROOT / pkg).rglob("*.py"))
               if p.name != "__init__.py" and f"`{p.relative_to(ROOT)}`" not in doc
               and f"`{p.relative_to(ROOT / pkg)}`" not in doc and f"`{p.name}`" not in doc]
    assert not missing, f"docs/architecture.md does not list {missing}"


def test_the_engine_kernels_and_grader_never_import_the_tools():
    """benchmarks/ and examples/ stay out of the engine's import graph (and so out of the grading kit)."""
    mods = modules()
    known = set(mods)
    back = sorted(f"{name} -> {t}" for name, path in mods.items() if not name.startswith(TOOLS)
                  for t in imports_of(name, path, known) if t.startswith(TOOLS))
    assert not back, f"imports of benchmarks/examples from below them: {back}"


def test_subpackage_inits_import_nothing():
    """Sub-package __init__ files stay empty, so importing one module never drags in its siblings."""
    for pkg in ("core", "worker", "models", "entrypoints"):
        tree = ast.parse((ROOT / "engine_core" / pkg / "__init__.py").read_text())
        assert not [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))], f"engine_core/{pkg}/__init__.py"
