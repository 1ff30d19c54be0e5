"""`python -m grader batch SUBMISSIONS_DIR --lab NN_name [--jobs N]`: grade a folder of submissions.

The pass/fail decision is made here, in the trusted parent, never in a submission's process:

1. Once per batch, a trusted child process (grader/child.py) runs the lab's official tests on the
   lab's solution notebook against the real kit and records every test's observations
   (grader/observe.py): the reference log.
2. Each submission (a folder per student holding `NN_name.ipynb` anywhere below it, as in
   nbgrader's `submitted/<student>/NN_name/`) runs in its own child process, with a wall-clock and
   a memory limit, in a scratch folder holding only its notebook and a private grading kit
   (grader/kit.py): the test module with every expected value and message removed, the engine
   with the lab's seam bodies removed. It records its observations the same way.
3. The parent compares the two logs (grader/compare.py): a test passes only if every observation
   matches the reference's and the test reached its end. A test that recorded nothing is "not
   verifiable"; a test whose code ran the engine's implementation of the piece scores 0 as
   "uses the reference implementation".

A submission that hangs, crashes, edits its kit or writes into the output folder scores zero with
the reason; the rest go on. Writes `grades.csv` (student, test, points, status, message) and
`report.html`.
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, replace
from pathlib import Path

from tqdm import tqdm

from grader import integrity
from grader.compare import NOT_VERIFIABLE, TestLog, compare_test, read_log
from grader.delegation import is_delegation
from grader.kit import kit_files, write_kit
from grader.labs import REPO_ROOT, check_lab_name, official_tests
from grader.report import write_html
from grader.results import DELEGATED, FAILED, PASSED, SKIPPED, UNVERIFIABLE, Graded, TestResult

Kit = dict[str, bytes]
REFERENCE_TIMEOUT_S = 1800.0  # the trusted run of the solution: never cut short by a submission's limit


@dataclass
class Submission:
    student: str
    notebook: Path | None


@dataclass(frozen=True)
class Limits:
    timeout_s: float
    memory_bytes: int
    threads: int = 1  # torch/OpenMP threads per submission: jobs x threads <= cores, or OpenMP spin-waits thrash


@dataclass
class ChildRun:
    """What a grading process left: exit code (None: timed out), output, observation log, outcomes."""

    code: int | None
    output: str
    log: dict[str, TestLog]
    outcomes: dict | None  # {"results": [...], "cell_errors": [...]} as the child wrote it (untrusted)


@dataclass(frozen=True)
class Reference:
    """The trusted run of the lab's solution: observations and each test's outcome."""

    log: dict[str, TestLog]
    outcomes: dict[str, dict]  # test name -> TestResult.to_dict()


def find_submissions(root: Path, lab: str) -> list[Submission]:
    """One submission per folder in `root`; its notebook is the first `NN_name.ipynb` below it."""
    found = []
    for folder in sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")):
        notebooks = sorted(p for p in folder.rglob(f"{lab}.ipynb") if ".ipynb_checkpoints" not in p.parts)
        found.append(Submission(folder.name, notebooks[0] if notebooks else None))
    return found


def _official_maxima(lab: str) -> list[TestResult]:
    """Every official test at zero points, for submissions that never got to run them."""
    return [TestResult(t.name, t.task, t.points or 0.0) for t in official_tests(lab)]


def _zero(template: list[TestResult], status: str, reason: str) -> list[TestResult]:
    return [TestResult(r.name, r.task, r.max_points, status, reason) for r in template]


def run_child(notebook: Path, lab: str, scratch: Path, pythonpath: Path, limits: Limits,
              memory_limit: bool = True) -> ChildRun:
    """Runs grader/child.py on `notebook` with `pythonpath` first on the path; waits at most the time limit."""
    work = scratch / "work"
    work.mkdir()
    local = work / f"{lab}.ipynb"
    shutil.copyfile(notebook, local)
    log, outcomes = scratch / "observations.jsonl", scratch / "outcomes.json"
    env = {**os.environ, "PYTHONPATH": str(pythonpath), "PYTHONDONTWRITEBYTECODE": "1", "HF_HUB_OFFLINE": "1",
           "OMP_NUM_THREADS": str(limits.threads)}
    command = [sys.executable, "-m", "grader.child", "--lab", lab, "--notebook", str(local), "--log", str(log),
               "--results", str(outcomes), "--memory-bytes", str(limits.memory_bytes if memory_limit else 0)]
    output_path = scratch / "output.txt"
    with open(output_path, "w") as output:
        proc = subprocess.Popen(command, cwd=work, env=env, stdin=subprocess.DEVNULL, stdout=output,
                                stderr=subprocess.STDOUT, process_group=0)
        try:
            code: int | None = proc.wait(timeout=limits.timeout_s)
        except subprocess.TimeoutExpired:
            code = None
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # the child and anything it started
            except ProcessLookupError:
                pass
            proc.wait()
    try:
        data = json.loads(outcomes.read_text())
        parsed = data if isinstance(data, dict) else None
    except (OSError, ValueError):
        parsed = None
    return ChildRun(code, output_path.read_text(errors="replace"), read_log(log), parsed)


def run_reference(lab: str, limits: Limits) -> Reference:
    """The trusted run: the lab's solution notebook, the real kit, no memory limit."""
    solution = REPO_ROOT / "solutions" / lab / f"{lab}.ipynb"
    if not solution.is_file():
        raise ValueError(f"batch grading compares with the solution, and {solution} is missing")
    limits = replace(limits, timeout_s=max(limits.timeout_s, REFERENCE_TIMEOUT_S))
    with tempfile.TemporaryDirectory(prefix=f"reference-{lab}-") as tmp:
        run = run_child(solution, lab, Path(tmp), REPO_ROOT, limits, memory_limit=False)
    if run.code != 0 or run.outcomes is None:
        raise RuntimeError(f"the reference run of lab {lab}'s solution failed (exit {run.code}):\n{run.output[-3000:]}")
    return Reference(run.log, {r["name"]: r for r in run.outcomes["results"]})


def _crash_reason(code: int, output: str) -> str:
    if code < 0:
        return f"crashed: the grading process died of {signal.Signals(-code).name}"
    tail = [line for line in output.strip().splitlines() if line.strip()][-1:] or [""]
    return f"crashed: the grading process exited with code {code} before finishing ({tail[0][:200]})"


def _learner_messages(outcomes: dict | None) -> dict[str, str]:
    """Each test's failure message as the submission's process reported it (explanations only)."""
    found: dict[str, str] = {}
    try:
        for r in (outcomes or {}).get("results", []):
            found[str(r["name"])] = str(r.get("message", ""))
    except (TypeError, KeyError, AttributeError):
        pass
    return found


def judge(template: list[TestResult], reference: Reference, run: ChildRun) -> list[TestResult]:
    """Each official test's result from the two logs; the child's own messages only explain failures."""
    said = _learner_messages(run.outcomes)
    results = []
    for t in template:
        ref_outcome = reference.outcomes.get(t.name, {})
        if ref_outcome.get("status") == SKIPPED:
            results.append(TestResult(t.name, t.task, t.max_points, SKIPPED, ref_outcome.get("message", "")))
            continue
        mine = run.log.get(t.name)
        passed, message = compare_test(reference.log.get(t.name), mine)
        delegation = next((m for m in (said.get(t.name, ""), mine.error if mine else "") if is_delegation(m)), None)
        if passed:
            status = PASSED
        elif delegation is not None:
            status, message = DELEGATED, delegation
        elif message.startswith(NOT_VERIFIABLE):
            status = UNVERIFIABLE
        else:
            status = FAILED
        results.append(TestResult(t.name, t.task, t.max_points, status, "" if passed else message))
    return results


def grade_submission(sub: Submission, lab: str, limits: Limits, kit: Kit, reference: Reference,
                     out_dir: Path) -> Graded:
    """Grades one submission in a child process against the grading kit and judges its log."""
    template = _official_maxima(lab)
    if sub.notebook is None:
        return Graded(sub.student, _zero(template, "missing", f"no {lab}.ipynb in the submission"), "missing notebook")
    out_before = integrity.tree_digest(out_dir)
    tampering = []
    with tempfile.TemporaryDirectory(prefix=f"grade-{lab}-") as tmp:
        scratch = Path(tmp)
        write_kit(kit, scratch / "kit")
        run = run_child(sub.notebook, lab, scratch, scratch / "kit", limits)
        changed = integrity.changed_files(kit, scratch / "kit")
        if changed:
            tampering.append(f"edited the kit's files {changed[:10]}")

    out_changed = integrity.changed_files(out_before, out_dir)
    if out_changed:
        tampering.append(f"wrote into the grading output folder {out_changed}")
        integrity.restore(out_before, out_dir)

    if run.code is None:
        return Graded(sub.student, _zero(template, "timeout", f"timed out after {limits.timeout_s:g} s"),
                      f"timed out after {limits.timeout_s:g} s (an endless loop?)")
    if tampering:
        reason = "tampered: " + "; ".join(tampering)
        return Graded(sub.student, _zero(template, "tampered", reason), reason)
    if run.code != 0 or run.outcomes is None:
        reason = _crash_reason(run.code, run.output)
        return Graded(sub.student, _zero(template, "crashed", reason), reason)
    notes = run.outcomes.get("cell_errors", []) if isinstance(run.outcomes.get("cell_errors"), list) else []
    results = judge(template, reference, run)
    delegated = [r.name for r in results if r.status == DELEGATED]
    reason = f"uses the reference implementation in {len(delegated)} tests" if delegated else ""
    return Graded(sub.student, results, reason, notes=[str(n) for n in notes])


def write_csv(graded: list[Graded], path: Path) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["student", "test", "points", "status", "message"])
        for g in graded:
            for r in g.results:
                writer.writerow([g.student, r.name, f"{r.points:g}", r.status, r.message])


def grade_all(root: Path, lab: str, limits: Limits, out_dir: Path, jobs: int = 1,
              reference: Reference | None = None) -> list[Graded]:
    """Grades every submission under `root` (`jobs` at a time) against the reference run (made
    here once unless given); writes grades.csv and report.html."""
    check_lab_name(lab)
    if not root.is_dir():
        raise ValueError(f"SUBMISSIONS_DIR must be a folder, got {root}")
    if jobs < 1:
        raise ValueError(f"--jobs must be >= 1, got {jobs}")
    if limits.timeout_s <= 0 or limits.memory_bytes < 2**28:
        raise ValueError(f"--timeout must be > 0 s and --memory-gb >= 0.25, got {limits}")
    limits = replace(limits, threads=max(1, (os.cpu_count() or 1) // jobs))
    out_dir.mkdir(parents=True, exist_ok=True)
    submissions = find_submissions(root, lab)
    kit = kit_files(lab)
    reference = reference or run_reference(lab, replace(limits, threads=os.cpu_count() or 1))
    graded: dict[str, Graded] = {}
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        futures = [pool.submit(grade_submission, s, lab, limits, kit, reference, out_dir) for s in submissions]
        for future in tqdm(as_completed(futures), total=len(futures), desc=f"grading {lab}", unit="submission"):
            g = future.result()
            graded[g.student] = g
    ordered = [graded[s.student] for s in submissions]
    write_csv(ordered, out_dir / "grades.csv")
    write_html(ordered, lab, out_dir / "report.html")
    return ordered


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("submissions", type=Path, help="folder with one sub-folder per student")
    parser.add_argument("--lab", required=True, help="NN_name")
    parser.add_argument("--jobs", type=int, default=1, help="submissions graded at once (default 1)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per submission (default 600)")
    parser.add_argument("--memory-gb", type=float, default=8.0, help="memory limit per submission (default 8)")
    parser.add_argument("--out", type=Path, default=None, help="output folder (default out/grades_NN_name)")


def run_batch_cli(args: argparse.Namespace) -> int:
    out = args.out or Path("out") / f"grades_{args.lab}"
    limits = Limits(args.timeout, int(args.memory_gb * 2**30))
    try:
        graded = grade_all(args.submissions, args.lab, limits, out, args.jobs)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    width = max([len(g.student) for g in graded] + [7])
    for g in graded:
        print(f"{g.student:<{width}}  {g.points:g} / {g.max_points:g}  {g.reason}")
    print(f"wrote {out / 'grades.csv'} and {out / 'report.html'}")
    return 0
