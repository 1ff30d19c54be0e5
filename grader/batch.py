"""`python -m grader batch SUBMISSIONS_DIR --lab NN_name [--jobs N]`: grade a folder of submissions.

Each submission (a folder per student holding `NN_name.ipynb` anywhere below it, as in
nbgrader's `submitted/<student>/NN_name/`) is graded by its own process (grader/child.py)
with a wall-clock and a memory limit, in a scratch folder holding only its notebook and a
private copy of the kit (grader, engine_core, kernels as they were when the batch started),
so no file of the submission is ever imported and an edited kit file is caught and
attributed without touching the real one. A
submission that hangs, crashes or tampers scores zero with the reason; the rest go on.
Writes `grades.csv` (student, test, points, status, message) and `report.html`.
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field, replace
from pathlib import Path

from tqdm import tqdm

from grader import integrity
from grader.labs import REPO_ROOT, check_lab_name, official_tests
from grader.report import write_html
from grader.results import TestResult

KIT_PACKAGES = ("grader", "engine_core", "kernels")  # copied for each child; it must not change them
Kit = dict[str, dict[str, bytes]]


@dataclass
class Submission:
    student: str
    notebook: Path | None


@dataclass
class Graded:
    """One student's results; `reason` is set when the whole submission scored zero."""

    student: str
    results: list[TestResult]
    reason: str = ""
    notes: list[str] = field(default_factory=list)

    @property
    def points(self) -> float:
        return sum(r.points for r in self.results)

    @property
    def max_points(self) -> float:
        return sum(r.max_points for r in self.results)


@dataclass(frozen=True)
class Limits:
    timeout_s: float
    memory_bytes: int
    threads: int = 1  # torch/OpenMP threads per submission: jobs x threads <= cores, or OpenMP spin-waits thrash


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


def snapshot_kit() -> Kit:
    return {package: integrity.tree_digest(REPO_ROOT / package) for package in KIT_PACKAGES}


def _write_kit(kit: Kit, root: Path) -> None:
    for package, files in kit.items():
        for name, data in files.items():
            path = root / package / name
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(data)


def _run_child(sub: Submission, lab: str, limits: Limits, kit_files: Kit, scratch: Path) -> tuple[int | None, str, Path, bytes]:
    """Starts and waits for the grading process; returns (exit code or None on timeout, log, result, key)."""
    work, kit = scratch / "work", scratch / "kit"
    work.mkdir()
    _write_kit(kit_files, kit)
    notebook = work / f"{lab}.ipynb"
    shutil.copyfile(sub.notebook, notebook)
    result = scratch / "result.json"
    key = secrets.token_bytes(32)
    env = {**os.environ, "PYTHONPATH": str(kit), "PYTHONDONTWRITEBYTECODE": "1", "HF_HUB_OFFLINE": "1",
           "OMP_NUM_THREADS": str(limits.threads)}
    log_path = scratch / "log.txt"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "grader.child", "--lab", lab, "--notebook", str(notebook),
             "--result", str(result), "--memory-bytes", str(limits.memory_bytes)],
            cwd=work, env=env, stdin=subprocess.PIPE, stdout=log, stderr=subprocess.STDOUT,
            process_group=0,
        )
        try:
            proc.stdin.write(key.hex().encode() + b"\n")
            proc.stdin.close()
        except BrokenPipeError:
            pass
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
    return code, log_path.read_text(errors="replace"), result, key


def _crash_reason(code: int, log: str) -> str:
    if code < 0:
        return f"crashed: the grading process died of {signal.Signals(-code).name}"
    tail = [line for line in log.strip().splitlines() if line.strip()][-1:] or [""]
    return f"crashed: the grading process exited with code {code} before finishing ({tail[0][:200]})"


def grade_submission(sub: Submission, lab: str, limits: Limits, kit: Kit, out_dir: Path) -> Graded:
    """Grades one submission in a child process and judges what came back."""
    template = _official_maxima(lab)
    if sub.notebook is None:
        return Graded(sub.student, _zero(template, "missing", f"no {lab}.ipynb in the submission"), "missing notebook")
    out_before = integrity.tree_digest(out_dir)
    tampering = []
    with tempfile.TemporaryDirectory(prefix=f"grade-{lab}-") as tmp:
        scratch = Path(tmp)
        code, log, result_path, key = _run_child(sub, lab, limits, kit, scratch)
        for package, before in kit.items():
            changed = integrity.changed_files(before, scratch / "kit" / package)
            if changed:
                tampering.append(f"edited the kit's files {[f'{package}/{c}' for c in changed]}")
        payload = result_path.read_text() if result_path.is_file() else ""

    out_changed = integrity.changed_files(out_before, out_dir)
    if out_changed:
        tampering.append(f"wrote into the grading output folder {out_changed}")
        integrity.restore(out_before, out_dir)

    if code is None:
        return Graded(sub.student, _zero(template, "timeout", f"timed out after {limits.timeout_s:g} s"),
                      f"timed out after {limits.timeout_s:g} s (an endless loop?)")
    if tampering:
        reason = "tampered: " + "; ".join(tampering)
        return Graded(sub.student, _zero(template, "tampered", reason), reason)
    if code != 0 or not payload:
        reason = _crash_reason(code, log)
        return Graded(sub.student, _zero(template, "crashed", reason), reason)
    body, _, signature = payload.rstrip("\n").rpartition("\n")
    if not integrity.verify(key, body, signature.strip()):
        reason = "tampered: the result file was forged or altered"
        return Graded(sub.student, _zero(template, "tampered", reason), reason)
    data = json.loads(body)
    if data["tampered"]:
        reason = f"tampered: replaced grader/pytest functions {data['tampered'][:10]}"
        return Graded(sub.student, _zero(template, "tampered", reason), reason)
    results = [TestResult(r["name"], r["task"], r["max_points"], r["status"], r["message"]) for r in data["results"]]
    return Graded(sub.student, results, notes=data.get("cell_errors", []))


def write_csv(graded: list[Graded], path: Path) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["student", "test", "points", "status", "message"])
        for g in graded:
            for r in g.results:
                writer.writerow([g.student, r.name, f"{r.points:g}", r.status, r.message])


def grade_all(root: Path, lab: str, limits: Limits, out_dir: Path, jobs: int = 1) -> list[Graded]:
    """Grades every submission under `root` (`jobs` at a time); writes grades.csv and report.html."""
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
    graded: dict[str, Graded] = {}
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        kit = snapshot_kit()
        futures = [pool.submit(grade_submission, s, lab, limits, kit, out_dir) for s in submissions]
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
