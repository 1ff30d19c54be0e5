"""`make gpu-compile`: every Triton kernel specialization the engine and the labs launch, compiled for every
NVIDIA generation from the T4 (sm_75) on, on a machine without a GPU.

Triton lowers a kernel to PTX and the wheel's bundled `ptxas` assembles it for any `GPUTarget`; no device is
needed. The interpreter (the CPU tests) accepts code the compiler rejects (an fp8 e4m3 type on sm_80, a
non-constexpr global, a tile too big for shared memory), so this is the check that stands in for a GPU. Each
cubin's resources come from the bundled `cuobjdump --dump-resource-usage`: registers per thread, local memory
(spills), static shared memory, plus the dynamic shared memory Triton launches with.

One table, kernel case x target. A cell is `ok` (compiled), `refused` (the engine's own selection refuses the
case on that target before launch, with its reason) or `ERROR`. The check fails on an error, on any spill, on
shared memory over the target's per-block limit, on registers over the case's budget, and on an empty table.
Results are cached on disk keyed by the kernel's source (Triton's `cache_key`, which covers the jit functions it
calls), the specialization, the target and the triton version, so a warm run compiles nothing.

The cases: `benchmarks/gpu_kernels.py`. `--cases FILE.py` adds the `CASES` list of another file (how a new
kernel is tried before it is registered; how the planted-failure tests plant theirs).
"""
from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

from benchmarks.gpu_targets import KIB, TARGETS, Case, Launch, Target

__all__ = ["Case", "Launch", "TARGETS", "Target", "main", "run_matrix", "table", "problems"]


@dataclass
class Cell:
    status: str  # "ok", "refused", "error"
    regs: int = 0
    local: int = 0  # local memory per thread, bytes (spills)
    smem: int = 0  # dynamic + static shared memory per block, bytes
    note: str = ""
    seconds: float = 0.0
    cached: bool = False


def cache_dir() -> Path:
    return Path(os.environ.get("GPU_COMPILE_CACHE", Path.home() / ".cache" / "inference-labs" / "gpu-compile"))


def _bin(name: str) -> Path:
    import triton
    return Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name


def _source(launch: Launch) -> tuple[dict, dict, dict]:
    fn = launch.fn
    signature = {n: "constexpr" if n in launch.constexprs else launch.types.get(n, "i32") for n in fn.arg_names}
    unknown = (set(launch.types) | set(launch.constexprs)) - set(fn.arg_names)
    if unknown:
        raise ValueError(f"{fn.__name__} has no argument(s) {sorted(unknown)}")
    attrs = {(i,): [["tt.divisibility", 16]] for i, (n, t) in enumerate(signature.items())
             if (t.startswith("*") or t == "i32") and n not in launch.unaligned}
    return signature, dict(launch.constexprs), attrs


def _key(launch: Launch, target: Target) -> str:
    import triton
    signature, constexprs, attrs = _source(launch)
    text = json.dumps([launch.fn.cache_key, launch.fn.__name__, signature, repr(sorted(constexprs.items())),
                       sorted((str(k), v) for k, v in attrs.items()), launch.num_warps, launch.num_stages,
                       target.cap, triton.__version__], default=str)
    return hashlib.sha256(text.encode()).hexdigest()


def resource_usage(cubin: bytes) -> dict[str, int]:
    """REG, STACK, SHARED, LOCAL of the cubin's one function, from `cuobjdump --dump-resource-usage`."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([str(_bin("cuobjdump")), "--dump-resource-usage", f.name], capture_output=True,
                             text=True, check=True).stdout
    found = {k: int(v) for k, v in re.findall(r"\b(REG|STACK|SHARED|LOCAL):(\d+)", out)}
    if "REG" not in found:
        raise RuntimeError(f"cuobjdump printed no register count:\n{out}")
    return found


def compile_cell(launch: Launch, target: Target) -> Cell:
    """Compile one specialization for one target (or read its cached result)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    path = cache_dir() / f"{_key(launch, target)}.json"
    if path.is_file():  # the note is the launch's (which variant this target gets), not part of the result
        cached = json.loads(path.read_text())
        return Cell(**{**cached, "cached": True, **({"note": launch.note} if cached["status"] == "ok" else {})})
    start = time.perf_counter()
    signature, constexprs, attrs = _source(launch)
    try:
        kernel = triton.compile(ASTSource(launch.fn, signature, constexprs=constexprs, attrs=attrs),
                                target=GPUTarget("cuda", target.cap, 32),
                                options=dict(num_warps=launch.num_warps, num_stages=launch.num_stages))
        use = resource_usage(kernel.asm["cubin"])
        cell = Cell("ok", use["REG"], use.get("LOCAL", 0) + use.get("STACK", 0),
                    kernel.metadata.shared + use.get("SHARED", 0), launch.note)
    except Exception as e:  # a compiler error is a result to report, not a crash of the matrix
        cell = Cell("error", note=f"{type(e).__name__}: {_reason(e)[:300]}")
    cell.seconds = time.perf_counter() - start
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(asdict(cell)))
    tmp.replace(path)  # atomic: parallel runs never read half a file
    return cell


def _reason(e: BaseException) -> str:
    """A compiler error in one line: Triton's CompilationError prints "at L:C:", the source and a caret; the
    reason is its innermost cause's message."""
    while e.__cause__ is not None:
        e = e.__cause__
    args = [a for a in getattr(e, "args", ()) if isinstance(a, str)]
    text = args[-1] if args and type(e).__name__ == "CompilationError" else str(e)
    lines = [line.strip() for line in text.splitlines() if line.strip() and line.strip() != "^"]
    return lines[-1] if lines else type(e).__name__


def plan(case: Case, target: Target) -> Launch | Cell:
    """The case's launch on `target`, or a finished cell (refused by design, or a broken case)."""
    try:
        launch = case.launch(target.cap)
    except Exception as e:
        return Cell("error", note=f"the case itself failed: {type(e).__name__}: {e}")
    return Cell("refused", note=launch) if isinstance(launch, str) else launch


_JOBS: list[tuple[Launch, Target]] = []  # read by forked workers


def _run_job(i: int) -> Cell:
    return compile_cell(*_JOBS[i])


def run_matrix(cases: list[Case], targets: tuple[Target, ...], jobs: int = 1) -> dict[tuple[str, str], Cell]:
    """Every case on every target: compiled in `jobs` forked processes (the cases hold jit functions, which a
    fork inherits and a pickle would not)."""
    cells: dict[tuple[str, str], Cell] = {}
    todo: list[tuple[tuple[str, str], Launch, Target]] = []
    for case in cases:
        for target in targets:
            planned = plan(case, target)
            if isinstance(planned, Cell):
                cells[case.name, target.name] = planned
            else:
                todo.append(((case.name, target.name), planned, target))
    _JOBS[:] = [(launch, target) for _, launch, target in todo]
    if jobs > 1 and len(todo) > 1:
        import multiprocessing
        with ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("fork")) as pool:
            results = list(pool.map(_run_job, range(len(todo)), chunksize=4))
    else:
        results = [_run_job(i) for i in range(len(todo))]
    for (key, _, _), cell in zip(todo, results):
        cells[key] = cell
    return cells


def problems(cases: list[Case], targets: tuple[Target, ...],
             cells: dict[tuple[str, str], Cell]) -> tuple[list[str], list[str]]:
    """(failures, open): every reason the matrix fails, and the problems of cells a case lists as `known`
    (open issues, printed, not failing). An empty table (nothing compiled) fails, and so does a known entry
    whose cell has no problem any more (remove the entry)."""
    found, still_open = [], []
    for case in cases:
        for target in targets:
            here = _cell_problems(case, target, cells[case.name, target.name])
            if target.cap in case.known:
                where = f"{case.name} on {target.name}"
                if here:
                    still_open += [f"{p} [open: {case.known[target.cap]}]" for p in here]
                else:
                    found.append(f"{where} is listed as an open failure ({case.known[target.cap]}) but has none: "
                                 f"remove it from the case's `known`")
            else:
                found += here
    if not any(c.status == "ok" for c in cells.values()):
        found.insert(0, "no kernel compiled on any target: an empty table proves nothing")
    return found, still_open


def failures(cases: list[Case], targets: tuple[Target, ...], cells: dict[tuple[str, str], Cell]) -> list[str]:
    return problems(cases, targets, cells)[0]


def _cell_problems(case: Case, target: Target, cell: Cell) -> list[str]:
    where = f"{case.name} on {target.name} ({target.gpus})"
    if cell.status == "error":
        return [f"{where}: does not compile: {cell.note}"]
    if cell.status != "ok":
        return []  # refused by design, before launch
    found = []
    if cell.local:
        found.append(f"{where}: {cell.local} B of local memory per thread (register spills)")
    if cell.smem > target.smem_per_block:
        found.append(f"{where}: {cell.smem} B of shared memory, over the {target.smem_per_block} B a block may use")
    if cell.regs > case.max_registers:
        found.append(f"{where}: {cell.regs} registers per thread, over its budget of {case.max_registers}")
    return found


def table(cases: list[Case], targets: tuple[Target, ...], cells: dict[tuple[str, str], Cell]) -> str:
    """Markdown: one row per case, one column per target; a compiled cell reads `regs/local B/smem KiB`."""
    head = "| case (register budget) | " + " | ".join(f"{t.name} (smem <= {t.smem_per_block // KIB} KiB)"
                                                    for t in targets) + " |"
    lines = [head, "|" + "---|" * (len(targets) + 1)]
    notes: dict[str, int] = {}
    for case in cases:
        row = []
        for target in targets:
            cell = cells[case.name, target.name]
            if cell.status == "ok":
                text = f"{cell.regs} r / {cell.local} B / {cell.smem / KIB:.1f} KiB"
                text += f" {cell.note}" if cell.note else ""
            else:
                ref = notes.setdefault(cell.note, len(notes) + 1)
                text = f"{cell.status} [{ref}]"
            row.append(text)
        lines.append(f"| {case.name} ({case.max_registers}) | " + " | ".join(row) + " |")
    lines += ["", "A compiled cell: registers per thread / local memory (spills) per thread / shared memory per "
              "block."] + [f"[{i}] {note}" for note, i in notes.items()]
    return "\n".join(lines)


def load_cases_file(path: Path) -> list[Case]:
    """The `CASES` list of a Python file (kernels to try before registering them in gpu_kernels.py)."""
    spec = importlib.util.spec_from_file_location(f"gpu_compile_cases_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return list(module.CASES)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--targets", default=",".join(str(t.cap) for t in TARGETS),
                        help="compute capabilities, comma-separated (default: all: %(default)s)")
    parser.add_argument("--only", default="", help="only the cases whose name contains this text")
    parser.add_argument("--cases", type=Path, action="append", default=[],
                        help="a Python file with a CASES list, added to (with --no-registry: instead of) the kit's")
    parser.add_argument("--no-registry", action="store_true", help="leave out the kit's own cases")
    parser.add_argument("--labs-dir", type=Path, default=None,
                        help="read the lab kernels from this folder's notebooks (labs: your own work; default "
                             "solutions)")
    parser.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1), help="compiler processes")
    parser.add_argument("--quiet", action="store_true", help="print the failures only, not the table")
    args = parser.parse_args(argv)
    if "TRITON_INTERPRET" in os.environ:
        os.environ.pop("TRITON_INTERPRET")  # the interpreter's jit functions cannot be compiled
    for tool in ("ptxas", "cuobjdump"):
        if not _bin(tool).is_file():
            print(f"gpu-compile: this triton wheel has no bundled {tool} at {_bin(tool)}", file=sys.stderr)
            return 2
    by_cap = {t.cap: t for t in TARGETS}
    caps = [int(c) for c in args.targets.split(",") if c.strip()]
    if bad := [c for c in caps if c not in by_cap]:
        parser.error(f"--targets: unknown capability {bad}; known: {sorted(by_cap)}")
    targets = tuple(by_cap[c] for c in caps)
    cases: list[Case] = []
    if not args.no_registry:
        from benchmarks import gpu_kernels
        cases += gpu_kernels.cases(args.labs_dir)
    for path in args.cases:
        cases += load_cases_file(path)
    cases = [c for c in cases if args.only in c.name]
    start = time.perf_counter()
    cells = run_matrix(cases, targets, args.jobs)
    compiled = [c for c in cells.values() if c.status != "refused" and not c.cached]
    if not args.quiet:
        print(table(cases, targets, cells))
    counts = {s: sum(c.status == s for c in cells.values()) for s in ("ok", "refused", "error")}
    print(f"\ngpu-compile: {len(cases)} cases x {len(targets)} targets: {counts['ok']} compiled, {counts['refused']} "
          f"refused by design, {counts['error']} errors; {len(compiled)} compiled now "
          f"({sum(c.seconds for c in compiled):.0f} s of compiler time), the rest from {cache_dir()}; "
          f"{time.perf_counter() - start:.0f} s")
    failed, still_open = problems(cases, targets, cells)
    for p in still_open:
        print(f"OPEN {p}")
    for p in failed:
        print(f"FAIL {p}")
    print(f"gpu-compile: FAIL ({len(failed)} problems)" if failed
          else f"gpu-compile: PASS ({len(still_open)} open problems listed above)" if still_open
          else "gpu-compile: PASS")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
