"""`python -m grader.selftest NN_name`: one lab's tests against every variant the meta-test checks.

Prints one JSON object (tests/labs/test_labs_meta.py runs it once per lab in a subprocess: one
interpreter start and one engine import per lab, not per variant):

- "solution": results on solutions/NN/NN.ipynb, observations recorded (the batch reference);
  "plugs": every `plug` block of that run (test, plugged functions and their call counts);
- "stub": results on the released labs/NN/NN.ipynb; "bugs": results per planted bug;
- "engine": the unit tests (not end_to_end) with the engine's own functions as the student: the
  tests and the engine agree;
- "engine_tests": the engine's own unit tests (ENGINE_TESTS) with the solution's functions
  plugged in: the solution and the engine agree;
- "delegation": results of a notebook whose functions call the engine's captured originals, in
  self-grading; "batch": `python -m grader batch` results of the solution (sandboxed kit, compared
  with this process's observations).
"""
from __future__ import annotations

import contextlib
import functools
import importlib
import io
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType
from unittest import mock

import pytest

from grader import delegation
from grader.labs import REPO_ROOT, bugs_path, check_lab_name, tests_module_name, tests_path
from grader.loader import load_notebook
from grader.plug import PLUG_LOG, plug
from grader.runner import QUIET_PLUGINS, run_tests, stderr_to_stdout, test_names
from grader.seams import SEAMLESS_LABS, resolve, seams_of

PER_TEST_TIMEOUT_S = 120  # generous for the solution: a loaded 2-core machine
BUG_TEST_TIMEOUT_S = 20  # a planted bug that loops forever fails its test instead of hanging
# The engine's own unit tests of each lab's pieces, run with the solution's functions plugged in
# (pytest arguments: files or node ids, and a -k filter leaving out what runs whole models).
ENGINE_TESTS = {
    "00_warmup": ("tests/core/test_kv_cache_manager.py",),
    "01_kv_cache_math": ("tests/engine/test_memory.py", "tests/engine/test_capacity_planner.py", "-k",
                         "not matches_transformers"),
    "02_paged_kv_blocks": ("tests/core/test_block_pool.py", "tests/core/test_kv_cache_manager.py"),
    "03_preemption": ("tests/core/test_preemption.py", "-k", "not test_engine_"),
    "04_chunked_prefill": ("tests/core/test_scheduler.py",),
    "05_prefix_caching": ("tests/core/test_prefix_caching.py", "tests/core/test_block_pool.py", "-k", "not test_engine_"),
    # the lab's kernel has num_splits 1 and no fp8 (later labs add them)
    "06_paged_attention_kernel": tuple(f"tests/kernels/test_kernels_decode.py::test_decode_matches_oracle"
                                       f"[torch.{dtype}-{group}-{block_size}-1]" for dtype in ("float32", "float16")
                                       for group in (1, 2, 4) for block_size in (8, 16)),
    # the split kernel with 2 and 4 splits (fp32, fp16), many empty splits, empty rows; the merge through the
    # PyTorch split decode; the policy as the engine applies it (the rest of test_split_policy.py imports its own)
    "07_flash_decoding": (*(f"tests/kernels/test_kernels_decode.py::test_decode_matches_oracle"
                            f"[torch.{dtype}-{group}-8-{splits}]" for dtype in ("float32", "float16")
                            for group in (1, 4) for splits in (2, 4)),
                          "tests/kernels/test_kernels_decode.py::test_many_splits_on_short_sequences_leave_empty_splits_harmless",
                          "tests/kernels/test_kernels_decode.py::test_empty_rows_give_zeros_not_nan",
                          "tests/kernels/test_flash_decoding.py", "tests/kernels/test_split_policy.py"),
    "08_fp8_kv_cache": ("tests/kernels/test_fp8.py",),
    "09_multi_lora": ("tests/lora/test_lora_slots.py", "tests/lora/test_lora_scheduler.py"),
    # the sampler's distribution tests, the proposer's cases, the scheduler's lookahead and rollback (no model)
    "10_speculative_decoding": ("tests/worker/test_rejection_sampler.py", "tests/spec_decode/test_ngram_proposer.py",
                                "tests/engine/test_spec_decode.py::test_rejected_drafts_roll_back_and_their_slots_are_reused",
                                "tests/engine/test_spec_decode.py::test_drafts_fall_back_to_a_plain_decode_without_budget_or_blocks"),
    "11_parallelism": ("tests/distributed/test_parallel_units.py",),
    # the queue and victim through the scheduler; the load generator's statistics; the router's choices
    "12_serving": ("tests/core/test_request_queue.py", "tests/benchmarks/test_bench_serve.py",
                   "tests/entrypoints/test_router_policies.py"),
    "13_weight_quantization": ("tests/models/test_quantization.py", "-k", "not engine and not lora and not stats"),
    # the sampler (not its engine-run test: 7 s of whole runs), the block tables and the scheduler; the KV
    # write and attention run in the lab's own tests
    "14_find_the_bottleneck": ("tests/worker/test_sampler.py", "tests/worker/test_input_batch.py",
                               "tests/core/test_scheduler.py", "-k", "not whatever_shares_the_batch"),
    # NF4's levels, quantizer, forward and the engine serving it
    "15_fine_tune_to_serve": ("tests/models/test_nf4.py",),
    # the window's block rule and the manager freeing it, the eviction choices, the offload tier and the engine's
    # connector (tiny-llama: tokens with and without offload, torn copies, collisions)
    "16_long_context_kv": ("tests/core/test_sliding_window.py", "tests/core/test_kv_eviction.py",
                           "tests/core/test_kv_offload.py", "tests/worker/test_kv_offload_connector.py"),
    # the PyTorch loop nest and the early exit; the Triton prefill kernel's oracle cases in fp32 and fp16
    "18_flash_attention": ("tests/kernels/test_tiled_attention.py",
                           *(f"tests/kernels/test_kernels_prefill.py::test_prefill_matches_oracle[torch.{dtype}-{group}-8]"
                             for dtype in ("float32", "float16") for group in (1, 2, 4))),
}


def planted_bugs(lab: str) -> list:
    if not bugs_path(lab).is_file():
        return []
    return list(importlib.import_module(f"{tests_module_name(lab)}_bugs").BUGS)


@functools.cache
def graded_cells(solution: Path) -> dict[str, str]:
    """The solution notebook's source by nbgrader grade_id."""
    return {cell["metadata"]["nbgrader"]["grade_id"]: "".join(cell["source"])
            for cell in json.loads(solution.read_text())["cells"]
            if cell.get("metadata", {}).get("nbgrader", {}).get("grade_id")}


def marked_tests(lab: str, mark: str) -> dict[str, tuple]:
    """The lab's tests carrying `@pytest.mark.<mark>`, with the mark's arguments (the module is imported
    after pytest ran it once, so its assertions are already rewritten)."""
    from _pytest.mark.structures import get_unpacked_marks

    from grader.labs import import_tests

    module = import_tests(lab)
    return {name: m.args for name in test_names(lab) for m in get_unpacked_marks(getattr(module, name)) if m.name == mark}


def tests_for_bug(lab: str, solution: Path, bug) -> list[str]:
    """The lab's tests, those of the task whose cell the bug edits first (a task's tests carry
    `@pytest.mark.task(<the cell's grade_id>)`): with --exitfirst the sweep then stops at the first
    failure without running the other tasks' tests first. The order changes the time, not the verdict."""
    touched = {grade_id for grade_id, source in graded_cells(solution).items()
               if any(old in source for old, _ in bug.edits)}
    tasks = {name: args[0] for name, args in marked_tests(lab, "task").items()}
    return sorted(test_names(lab), key=lambda name: tasks.get(name) not in touched)


def end_to_end_tests(lab: str) -> list[str]:
    """The lab's tests marked `end_to_end`."""
    return list(marked_tests(lab, "end_to_end"))


def delegation_source(lab: str) -> str:
    """A graded cell that redefines each of the lab's functions as a call of the engine's own, captured at load."""
    lines = []
    for k, seam in enumerate(seams_of(lab)):
        module, _, name = seam.owner.rpartition(".")
        if isinstance(resolve(seam.owner), ModuleType):
            lines.append(f"import {seam.owner} as _owner_{k}")
        else:
            lines.append(f"from {module} import {name} as _owner_{k}")
        lines += [f"_captured_{k} = _owner_{k}.{seam.attr}",
                  f"def {seam.student_name}(*args, **kwargs):",
                  f"    return _captured_{k}(*args, **kwargs)"]
    return "\n".join(lines) + "\n"


def write_delegation_notebook(lab: str, path: Path) -> None:
    nb = json.loads((REPO_ROOT / "solutions" / lab / f"{lab}.ipynb").read_text())
    nb["cells"].append({"cell_type": "code", "execution_count": None, "id": "delegation", "outputs": [],
                        "metadata": {"nbgrader": {"grade": False, "grade_id": "delegation", "locked": False,
                                                  "schema_version": 3, "solution": True}},
                        "source": delegation_source(lab)})
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(nb))


class Collect:
    """A pytest plugin: each test's outcome as {"name", "status", "message"}."""

    def __init__(self) -> None:
        self.results: list[dict] = []

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if report.when == "call" or report.outcome != "passed":
            message = "" if report.passed else str(report.longrepr)[-1500:]
            self.results.append({"name": report.nodeid, "status": report.outcome, "message": message})


class PlugEachTest:
    """A pytest plugin: every test, fixtures included (a test's own monkeypatch of a seam is undone inside
    the plug), runs inside `plug(module, lab)`: the engine's unit tests with the solution plugged in."""

    def __init__(self, module: ModuleType, lab: str) -> None:
        self.module, self.lab = module, lab

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_protocol(self, item: pytest.Item, nextitem: pytest.Item | None):
        with plug(self.module, self.lab):
            return (yield)


def run_engine_tests(lab: str, solution: ModuleType) -> list[dict]:
    """The engine's unit tests of the lab's pieces with the solution's functions in place (no tripwires:
    these tests also call the engine's helpers directly)."""
    collect = Collect()
    args = [str(REPO_ROOT / a) if a.startswith("tests/") else a for a in ENGINE_TESTS[lab]]
    args += ["-q", "-p", "no:cacheprovider", "-o", "addopts=", *QUIET_PLUGINS, f"--timeout={PER_TEST_TIMEOUT_S}"]
    sink = io.StringIO()
    with mock.patch.object(delegation, "arm", lambda *a, **k: None), contextlib.redirect_stdout(sink):
        pytest.main(args, plugins=[PlugEachTest(solution, lab), collect])
    return collect.results


def selftest(lab: str) -> dict:
    """Every variant of the lab's tests (see the module's docstring), in a scratch folder removed after."""
    check_lab_name(lab)
    with tempfile.TemporaryDirectory(prefix=f"selftest-{lab}-") as tmp:
        return _selftest(lab, Path(tmp))


def _selftest(lab: str, scratch: Path) -> dict:
    solution = REPO_ROOT / "solutions" / lab / f"{lab}.ipynb"
    stub = REPO_ROOT / "labs" / lab / f"{lab}.ipynb"
    args = [f"--timeout={PER_TEST_TIMEOUT_S}"]
    bug_args = [f"--timeout={BUG_TEST_TIMEOUT_S}", "--exitfirst"]  # one failing test is enough to catch a bug
    seconds: dict[str, float] = {}

    def run(variant: str, path, edits=None, pytest_args=args, tests=None, observe_to=None, module=None) -> list[dict]:
        start = time.perf_counter()
        provider = functools.cache(lambda: module if module is not None else load_notebook(path, edits=edits))
        results = run_tests(lab, provider, tests, pytest_args=pytest_args, observe_to=observe_to)
        seconds[variant] = round(time.perf_counter() - start, 2)
        return [r.to_dict() for r in results]

    report: dict = {"seconds": seconds}
    PLUG_LOG.clear()
    report["solution"] = run("solution", solution, observe_to=scratch / "reference.jsonl")
    report["plugs"] = [vars(r) for r in PLUG_LOG]
    report["end_to_end"] = end_to_end_tests(lab)
    report["stub"] = run("stub", stub) if stub.is_file() else None
    report["bugs"] = {}
    for bug in planted_bugs(lab):
        try:
            order = tests_for_bug(lab, solution, bug)
            results = run(bug.name, solution, bug.edits, bug_args, tests=order)
            if not any(r["status"] == "failed" and r["max_points"] > 0 for r in results):
                results = run(bug.name, solution, bug.edits, bug_args[:1], tests=order)  # the first failure was ungraded
            report["bugs"][bug.name] = results
        except ValueError as exc:  # the edit's `old` text is not in the solution any more
            report["bugs"][bug.name] = str(exc)

    if lab in SEAMLESS_LABS:  # no engine function to run as the student, to plug the solution into or to delegate to
        report["engine"] = report["engine_tests"] = report["delegation"] = []
        start = time.perf_counter()
        report["batch"] = batch_results(lab, solution, scratch, report["solution"])
        seconds["batch"] = round(time.perf_counter() - start, 2)
        return report

    engine_student = load_notebook(solution)
    for seam in seams_of(lab):
        setattr(engine_student, seam.student_name, resolve(seam.dotted))
    unit_tests = [t for t in test_names(lab) if t not in report["end_to_end"]]
    with mock.patch.object(delegation, "arm", lambda *a, **k: None):  # the engine's functions are the student here
        report["engine"] = run("engine", None, tests=unit_tests, module=engine_student)

    start = time.perf_counter()
    report["engine_tests"] = run_engine_tests(lab, load_notebook(solution))
    seconds["engine_tests"] = round(time.perf_counter() - start, 2)

    delegating = scratch / "delegation" / f"{lab}.ipynb"
    write_delegation_notebook(lab, delegating)
    report["delegation"] = run("delegation", delegating)
    start = time.perf_counter()
    report["batch"] = batch_results(lab, solution, scratch, report["solution"])
    seconds["batch"] = round(time.perf_counter() - start, 2)
    return report


def batch_results(lab: str, solution: Path, scratch: Path, solution_results: list[dict]) -> list[dict]:
    """`grade_all` on the solution, for a lab converted to observations (an unconverted one is all "not
    verifiable" there), against this process's solution run; [] for an unconverted lab. (Delegation in
    batch grading needs no run per lab: tests/grader/test_grader_kit.py checks that each lab's kit holds no body
    of its seams and helpers, and tests/adversarial grades a delegating submission.)"""
    from grader.batch.grade import Limits, Reference, grade_all
    from grader.batch.compare import read_log
    from grader.batch.kit import comparisons_left

    if comparisons_left(tests_path(lab).read_text()):
        return []
    root = scratch / "submitted"
    (root / "solution").mkdir(parents=True, exist_ok=True)
    shutil.copyfile(solution, root / "solution" / f"{lab}.ipynb")
    reference = Reference(read_log(scratch / "reference.jsonl"), {r["name"]: r for r in solution_results})
    graded = grade_all(root, lab, Limits(600, 8 * 2**30), scratch / "grades", jobs=1, reference=reference)
    return [r.to_dict() for r in graded[0].results]


if __name__ == "__main__":
    with stderr_to_stdout():
        result = selftest(sys.argv[1])
    sys.stdout.write("\n@@SELFTEST@@" + json.dumps(result) + "\n")
