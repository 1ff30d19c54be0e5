"""docs/architecture.md stays true to the code: every engine, benchmark and example module is on its map,
the import graph of engine_core, kernels, grader, benchmarks and examples has no cycle, and imports point
down the layers the map draws, the tools at the top (imports inside functions and under TYPE_CHECKING count
too: a back import hidden there is still one in the design)."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

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
    graph = import_graph()
    assert find_cycle(graph) is None, f"import cycle: {' -> '.join(find_cycle(graph))}"


def test_the_cycle_finder_finds_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


# The layers of docs/architecture.md, bottom first: a module imports only modules of its own layer or a
# lower one (the longest matching prefix names a module's layer).
LAYERS: tuple[tuple[str, ...], ...] = (
    ("kernels",),  # the ops library: imports nothing of the engine
    ("engine_core.validation", "engine_core.prompts", "engine_core.interrupts", "engine_core.guard",
     "engine_core.request", "engine_core.outputs", "engine_core.metrics", "engine_core.memory",
     "engine_core.capacity_planner",  # lab 01's sizing questions, on memory's bytes and FLOPs
     "engine_core.presets", "engine_core.presets_real", "engine_core.cache", "engine_core.config",
     "engine_core.exceptions", "engine_core.gguf_file",
     "engine_core.spec_decode",  # the n-gram proposer: token lists in, token lists out
     "engine_core.distributed"),  # leaves every layer above uses (process groups: torch only)
    ("engine_core.core", "engine_core.models"),  # the scheduler and its KV bookkeeping; the model and its layers
    ("engine_core.lora",),
    ("engine_core.worker",),
    ("engine_core.executor",),  # the executors and their worker processes
    ("engine_core.engine",),
    ("engine_core.entrypoints", "engine_core.calibrate"),
    ("engine_core",),  # the package's facade (engine_core/__init__.py)
    ("grader",),  # the learner's and the instructor's tools (grader.slow_engine: lab 14's slowed engine step)
    TOOLS,  # nothing below imports them (so they stay out of the grading kit too)
)
# Within a layer: core and models know nothing of each other, and core picks no kernel.
FORBIDDEN = (("engine_core.core", "engine_core.models"), ("engine_core.models", "engine_core.core"),
             ("engine_core.core", "kernels"))


def layer_of(module: str) -> int:
    best = max(((len(p), i) for i, layer in enumerate(LAYERS) for p in layer
                if module == p or module.startswith(p + ".")), default=None)
    assert best is not None, f"{module} is on no layer of tests/test_architecture.py's LAYERS (and the map)"
    return best[1]


def _under(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def layering_violations(graph: dict[str, set[str]]) -> list[str]:
    """Every import that points up the layers, or across one of the FORBIDDEN pairs."""
    found = []
    for src, targets in sorted(graph.items()):
        for dst in sorted(targets):
            if layer_of(dst) > layer_of(src):
                found.append(f"{src} imports {dst}, a higher layer")
            elif any(_under(src, a) and _under(dst, b) for a, b in FORBIDDEN):
                found.append(f"{src} imports {dst}, which its layer must not")
    return found


def import_graph() -> dict[str, set[str]]:
    mods = modules()
    known = set(mods)
    return {name: imports_of(name, path, known) for name, path in mods.items()}


def test_imports_point_down_the_layers():
    violations = layering_violations(import_graph())
    assert not violations, "\n".join(violations)


@pytest.mark.parametrize("src, dst", [
    ("engine_core.models.llama", "engine_core.worker.kv_cache"),  # the model reaching into the worker
    ("engine_core.config", "engine_core.models.config"),  # a leaf reaching a layer above it
    ("engine_core.core.scheduler", "engine_core.models.attention"),  # core into its sibling
    ("engine_core.core.scheduler_output", "kernels.fp8"),  # core picking a kernel
    ("kernels.reference", "engine_core.request"),  # the ops library importing the engine
    ("grader.harness", "benchmarks.workload"),  # the grader (and its kit) reaching for a tool
])
def test_the_layering_check_fails_on_a_planted_back_import(src, dst):
    graph = import_graph()
    assert dst in graph, dst
    graph[src] = graph[src] | {dst}
    assert any(v.startswith(f"{src} imports {dst}") for v in layering_violations(graph))


def folder_of(module: str) -> str:
    """The folder a module lives in, as the map draws it: a sub-package of engine_core (its own sub-packages
    included), or a module at engine_core's top, or one of the other packages."""
    parts = module.split(".")
    if parts[0] == "engine_core" and len(parts) > 1:
        return ".".join(parts[:2])
    return parts[0]


def folder_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    folders: dict[str, set[str]] = {}
    for src, targets in graph.items():
        folders.setdefault(folder_of(src), set()).update(folder_of(t) for t in targets)
    return {f: targets - {f} for f, targets in folders.items()}


def folder_violations(graph: dict[str, set[str]]) -> list[str]:
    """A folder whose modules sit on different layers, an arrow from one folder up to another, a folder cycle."""
    found = [f"{m} is on layer {layer_of(m)}, its folder {folder_of(m)} on {layer_of(folder_of(m))}"
             for m in sorted(graph) if folder_of(m) in graph and layer_of(m) != layer_of(folder_of(m))]
    folders = folder_graph(graph)
    found += [f"folder {src} imports folder {dst}, a higher layer" for src, targets in sorted(folders.items())
              for dst in sorted(targets) if layer_of(dst) > layer_of(src)]
    if cycle := find_cycle(folders):
        found.append(f"folder cycle: {' -> '.join(cycle)}")
    return found


def test_folders_point_down_the_layers_without_a_cycle():
    """Each folder sits on one layer as a whole: no back arrow and no cycle between folders either."""
    violations = folder_violations(import_graph())
    assert not violations, "\n".join(violations)


@pytest.mark.parametrize("edges", [
    [("engine_core.distributed.parallel_state", "engine_core.executor.multiproc_executor")],  # the leaf folder up
    # two folders of one layer importing each other through different modules: no module cycle, a folder one
    [("engine_core.calibrate", "engine_core.entrypoints.llm"), ("engine_core.entrypoints.openai.serving",
                                                                "engine_core.calibrate")],
])
def test_the_folder_check_fails_on_a_planted_folder_back_arrow(edges):
    graph = import_graph()
    assert not folder_violations(graph)
    for src, dst in edges:
        assert dst in graph, dst
        graph[src] = graph[src] | {dst}
    engine = {m: {t for t in targets if t.startswith("engine_core")} for m, targets in graph.items()
              if m.startswith("engine_core")}
    assert len(edges) == 1 or find_cycle(engine) is None  # the two-edge case: no module cycle, only a folder one
    src, dst = edges[-1]
    assert any(folder_of(src) in v and folder_of(dst) in v for v in folder_violations(graph))


def test_every_engine_module_is_on_the_architecture_map():
    """Named on the map (architecture.md, by folder) or in its module reference (modules.md)."""
    doc = (ROOT / "docs" / "architecture.md").read_text() + (ROOT / "docs" / "modules.md").read_text()
    missing = [str(p.relative_to(ROOT)) for pkg in ("engine_core", *TOOLS) for p in sorted((ROOT / pkg).rglob("*.py"))
               if p.name != "__init__.py" and f"`{p.relative_to(ROOT)}`" not in doc
               and f"`{p.relative_to(ROOT / pkg)}`" not in doc and f"`{p.name}`" not in doc]
    assert not missing, f"docs/architecture.md does not list {missing}"


# The only __init__ files that import: the package's facade and the quantization schemes' registry.
IMPORTING_INITS = ("engine_core/__init__.py", "engine_core/models/quantization/__init__.py")


def test_subpackage_inits_import_nothing():
    """Sub-package __init__ files stay empty, so importing one module never drags in its siblings; the map names
    the exceptions."""
    doc = (ROOT / "docs" / "architecture.md").read_text()
    for path in sorted((ROOT / "engine_core").rglob("__init__.py")):
        name = str(path.relative_to(ROOT))
        imports = [n for n in ast.parse(path.read_text()).body if isinstance(n, (ast.Import, ast.ImportFrom))]
        assert bool(imports) == (name in IMPORTING_INITS), name
    for name in IMPORTING_INITS:
        assert f"`{name}`" in doc, f"docs/architecture.md does not name {name} among the __init__ files that import"
