"""`python -m grader batch SUBMISSIONS_DIR --lab NN_name [--jobs N]`: grade a folder of submissions.

The pass/fail decision is made here, in the trusted parent, never in a submission's process:

1. Snapshots first: each submission's notebook (nbgrader's rule picks it, see `find_notebook`) is
   copied into the batch's private folder before anything runs; the grading kit (grader/batch/kit.py:
   the test module with every expected value and message removed, the engine with the lab's seam
   bodies removed) is written there once, and it and the lab's tests are hashed.
2. Once per batch, a trusted child process (grader/batch/child.py) runs the lab's official tests on the
   lab's solution notebook against the real kit and records every test's observations
   (grader/observe.py): the reference log.
3. Each submission runs in its own sandbox (grader/batch/sandbox.py: bubblewrap, its own uid and PID
   namespace, no network, a read-only kit and notebook, size-limited tmpfs, memory, process, file
   size and CPU limits), with a time limit per test: a test that hangs or kills the process loses
   its own points, and a new sandbox runs the tests left. It records its observations the same way.
4. The parent compares the two logs (grader/batch/compare.py): a test passes only if every observation
   matches the reference's and the test reached its end; "not verifiable" when the reference
   recorded nothing; "uses the reference implementation" when its code ran the engine's
   implementation of the piece it is graded on. Everything a submission wrote is read bounded.
5. After every sandbox is gone, the kit and the tests are checked against their hashes, and
   `grades.csv` (student, test, points, status, message) and `report.html` are written atomically.
"""
from __future__ import annotations

import argparse
import csv
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field, replace
from pathlib import Path

from tqdm import tqdm

from grader.batch import integrity, sandbox
from grader.batch.compare import NOT_VERIFIABLE, TestLog, compare_test
from grader.delegation import is_delegation
from grader.batch.kit import kit_files, write_kit
from grader.labs import REPO_ROOT, check_lab_name, official_tests, tests_path
from grader.batch.report import write_html
from grader.results import DELEGATED, FAILED, PASSED, SKIPPED, UNVERIFIABLE, Graded, TestResult
from grader.without_triton import REASON as NO_TRITON
from grader.without_triton import is_triton_skip

Kit = dict[str, bytes]
REFERENCE_TIMEOUT_S = 1800.0  # the trusted run of the solution: never cut short by a submission's limit
MAX_NOTEBOOK_BYTES = 64 << 20  # a submission's notebook larger than this is refused, not copied
MAX_LOG_BYTES = 64 << 20  # read of a submission's observation log
MAX_OUTCOMES_BYTES = 8 << 20
MAX_PROGRESS_BYTES = 1 << 20
OUTPUT_TAIL_BYTES = 64 << 10
POLL_S = 0.2
UID_STRIDE = 1024  # host uids per submission (as root): one per run, restarts included
TIMEOUT, CRASHED, TAMPERED, MISSING, REFUSED = "timeout", "crashed", "tampered", "missing", "refused"


class IntegrityError(RuntimeError):
    """The kit or the tests changed during the batch: its grades cannot be trusted."""


@dataclass
class Submission:
    student: str
    notebook: Path | None
    problem: str = ""  # why there is no notebook to grade (missing, refused)
    notes: list[str] = field(default_factory=list)
    snapshot: Path | None = None  # the private copy that is graded


@dataclass(frozen=True)
class Limits:
    timeout_s: float  # wall clock for a whole submission, every restart included
    memory_bytes: int  # address space of each of its processes
    threads: int = 1  # torch/OpenMP threads per submission: jobs x threads <= cores, or OpenMP spin-waits thrash
    test_timeout_s: float = 120.0  # wall clock per test (nbgrader_config.py: c.Execute.timeout = 120 per cell)
    load_timeout_s: float = 120.0  # wall clock to start Python, import the engine and load the notebook
    processes: int = 64  # processes and threads of one sandbox


@dataclass
class ChildRun:
    """What one grading process left (all untrusted): exit code (None: killed by a time limit), output
    tail, observation log, outcomes, the tests it started, whether it loaded the notebook."""

    code: int | None
    output: str
    log: dict[str, TestLog]
    outcomes: dict | None  # {"results": [...], "cell_errors": [...]} as the child wrote it (untrusted)
    started: list[str] = field(default_factory=list)
    loaded: bool = False
    timed_out: str = ""  # "test" (a test past its limit), "load", "total"


@dataclass(frozen=True)
class Reference:
    """The trusted run of the lab's solution: observations and each test's outcome."""

    log: dict[str, TestLog]
    outcomes: dict[str, dict]  # test name -> TestResult.to_dict()


# ---- finding and snapshotting submissions -------------------------------------------------------

def _notebooks_below(folder: Path, name: str | None = None) -> list[Path]:
    """Files called `name` (None: any notebook) below `folder`, never through a link to a folder,
    checkpoints left out."""
    found = []
    for here, dirs, files in os.walk(folder):  # os.walk does not follow links to folders
        dirs[:] = sorted(d for d in dirs if d != ".ipynb_checkpoints" and not d.startswith("."))
        found += [Path(here) / f for f in files if f == name or (name is None and f.endswith(".ipynb"))]
    return sorted(found)


def find_notebook(folder: Path, lab: str) -> tuple[Path | None, str, list[str]]:
    """(notebook, problem, notes) for one student's folder, by nbgrader's rule: autograde grades
    `<student>/<lab>/<lab>.ipynb` and skips any other notebook. Also accepted: `<student>/<lab>.ipynb`,
    or the only `<lab>.ipynb` below the folder. Several elsewhere: refused with the reason."""
    name = f"{lab}.ipynb"
    candidates = _notebooks_below(folder, name)
    usable = [p for p in candidates if not p.is_symlink()]
    notes = [f"{p.relative_to(folder)} is a symbolic link: not graded" for p in candidates if p.is_symlink()]
    chosen = next((p for p in (folder / lab / name, folder / name) if p in usable), None)
    if chosen is None and len(usable) == 1:
        chosen = usable[0]
    if chosen is None:
        others = [str(p.relative_to(folder)) for p in _notebooks_below(folder) if not p.is_symlink()][:5]
        if len(usable) > 1:
            return None, (f"{len(usable)} notebooks named {name} ({', '.join(str(p.relative_to(folder)) for p in usable)})"
                          f" and none at {lab}/{name}: nbgrader grades only <student>/{lab}/{name}; put the one "
                          f"to grade there"), notes
        seen = f" (found: {', '.join(others)}; nbgrader grades only the notebook named {name})" if others else ""
        return None, f"no {name} in the submission{seen}", notes
    ignored = [str(p.relative_to(folder)) for p in usable if p != chosen]
    if ignored:
        notes.append(f"graded {chosen.relative_to(folder)}; ignored {', '.join(ignored)} (nbgrader's rule)")
    return chosen, "", notes


def find_submissions(root: Path, lab: str) -> list[Submission]:
    """One submission per folder in `root` (links to folders are not followed)."""
    found = []
    for folder in sorted(p for p in root.iterdir() if p.is_dir() and not p.is_symlink() and not p.name.startswith(".")):
        notebook, problem, notes = find_notebook(folder, lab)
        found.append(Submission(folder.name, notebook, problem, notes))
    return found


def snapshot(subs: list[Submission], private: Path) -> None:
    """Copies every submission's notebook into `private` before anything runs (a later edit of the
    submissions folder, by anyone, changes nothing); a notebook past MAX_NOTEBOOK_BYTES is refused."""
    folder = private / "snapshots"
    folder.mkdir(mode=0o755)
    for k, sub in enumerate(subs):
        if sub.notebook is None:
            continue
        data = integrity.read_bounded(sub.notebook, MAX_NOTEBOOK_BYTES + 1)
        if data is None:
            sub.notebook, sub.problem = None, f"{sub.notebook.name} is not a regular file"
        elif len(data) > MAX_NOTEBOOK_BYTES:
            sub.notebook, sub.problem = None, f"refused: the notebook is larger than {MAX_NOTEBOOK_BYTES >> 20} MiB"
        else:
            sub.snapshot = folder / f"{k}.ipynb"
            sub.snapshot.write_bytes(data)
            sub.snapshot.chmod(0o644)


def manual_cells(lab: str, path: Path | None = None) -> list[tuple[str, float]]:
    """(grade_id, points) of the solution's manually graded cells (nbgrader `grade` and `solution`
    markdown cells): batch grading reports them as the instructor's to grade, never as earned."""
    path = path or REPO_ROOT / "solutions" / lab / f"{lab}.ipynb"
    try:
        cells = json.loads(path.read_text())["cells"]
    except (OSError, ValueError, KeyError):
        return []
    found = []
    for cell in cells:
        meta = cell.get("metadata", {}).get("nbgrader", {})
        if cell.get("cell_type") == "markdown" and meta.get("grade") and meta.get("solution"):
            found.append((str(meta.get("grade_id", "manual")), float(meta.get("points", 0))))
    return found


# ---- running one grading process -----------------------------------------------------------------

def _official_maxima(lab: str) -> list[TestResult]:
    """Every official test at zero points, for submissions that never got to run them."""
    return [TestResult(t.name, t.task, t.points or 0.0) for t in official_tests(lab)]


def _zero(template: list[TestResult], status: str, reason: str) -> list[TestResult]:
    return [TestResult(r.name, r.task, r.max_points, status, reason) for r in template]


def parse_log(text: str) -> dict[str, TestLog]:
    """The JSON-lines observation log (grader/batch/compare.py's format); malformed lines are skipped."""
    logs: dict[str, TestLog] = {}
    for line in text.splitlines():
        try:
            entry = json.loads(line)
            test, observations = str(entry["test"]), list(entry["observations"])
            logs[test] = TestLog([o for o in observations if isinstance(o, dict)], bool(entry["completed"]),
                                 str(entry.get("error", ""))[:5000])
        except (ValueError, KeyError, TypeError, RecursionError):
            continue
    return logs


def _read_text(path: Path, limit: int, tail: bool = False) -> str:
    data = integrity.read_bounded(path, limit, tail)
    return "" if data is None else data.decode(errors="replace")


def _parse_progress(text: str) -> tuple[bool, list[str]]:
    loaded, started = False, []
    for line in text.splitlines():
        if line == "loaded":
            loaded = True
        elif line.startswith("start "):
            started.append(line[len("start "):][:200])
    return loaded, started


def real_model_binds() -> dict[Path, str]:
    """The real presets the instructor's cache holds already converted, bound read-only where the sandbox's
    cache looks for them (HOME is /tmp there): their fp32 conversion (513 MB for SmolLM2-135M) fits no
    sandbox tmpfs or file-size limit, so a child could not build them itself."""
    from engine_core.cache import cache_root
    from engine_core.presets_real import REAL_PRESET_VERSION, REAL_PRESETS

    folders = [cache_root() / "presets" / f"{name}-v{REAL_PRESET_VERSION}" for name in REAL_PRESETS]
    built = [f for f in folders if (f / "config.json").is_file()]
    for folder in built:  # build_once's mkdtemp left it 0700: a run dropped to a fresh uid could not read it
        if folder.stat().st_uid == os.getuid():
            folder.chmod(0o755)
            for path in folder.iterdir():
                path.chmod(0o755 if path.is_dir() else 0o644)
    return {f: f"/tmp/.cache/inference-labs/presets/{f.name}" for f in built}


def _env(threads: int, pythonpath: str) -> dict[str, str]:
    return {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": "/tmp", "LANG": "C.UTF-8", "PYTHONPATH": pythonpath,
            "PYTHONDONTWRITEBYTECODE": "1", "PYTHONNOUSERSITE": "1", "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": str(threads),
            "MKL_NUM_THREADS": str(threads), "OMP_WAIT_POLICY": "PASSIVE", "TMPDIR": "/tmp"}


@dataclass(frozen=True)
class Setup:
    """How this batch runs children: the kit folder, the sandbox (None: unsafe), the limits."""

    lab: str
    kit: Path
    limits: Limits
    sandboxed: bool
    trusted: bool = False  # the reference run: the real repository, no limits, no sandbox


def _kill(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # bwrap (its PID namespace dies with it) or the unsafe child's group
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()


def run_child(setup: Setup, notebook: Path, scratch: Path, tests: list[str], deadline: float,
              uid: int | None = None) -> ChildRun:
    """One grading process on `notebook` (already a private copy) for `tests`, watched: killed when a
    test (or the load) runs past the per-test limit or the submission's deadline passes."""
    lab, limits = setup.lab, setup.limits
    scratch.mkdir(parents=True, exist_ok=False)
    files = {name: scratch / name for name in ("observations.jsonl", "outcomes.json", "progress.txt")}
    for path in files.values():
        path.touch()
        if uid is not None:
            os.chown(path, uid, uid)
    output_path = scratch / "output.txt"
    child_args = ["--lab", lab, "--tests", ",".join(tests)]
    if setup.trusted or not setup.sandboxed:
        work = scratch / "work"
        work.mkdir()
        local = work / f"{lab}.ipynb"
        shutil.copyfile(notebook, local)
        kit = REPO_ROOT if setup.trusted else setup.kit
        env = {**os.environ, "PYTHONPATH": str(kit), "PYTHONDONTWRITEBYTECODE": "1", "HF_HUB_OFFLINE": "1",
               "OMP_NUM_THREADS": str(limits.threads)}  # the instructor's environment (caches, HOME) as it is
        command = [sys.executable, "-m", "grader.batch.child", *child_args, "--notebook", str(local),
                   "--log", str(files["observations.jsonl"]), "--results", str(files["outcomes.json"]),
                   "--progress", str(files["progress.txt"])]
        if not setup.trusted:
            command = sandbox.limited(_sandbox_limits(limits)) + command
        cwd: Path | None = work
    else:
        names = {"observations.jsonl": "observations.jsonl", "outcomes.json": "outcomes.json",
                 "progress.txt": "progress.txt"}
        inside = [sys.executable, "-m", "grader.batch.child", *child_args, "--notebook", f"{lab}.ipynb",
                  "--log", f"{sandbox.OUT}/observations.jsonl", "--results", f"{sandbox.OUT}/outcomes.json",
                  "--progress", f"{sandbox.OUT}/progress.txt"]
        command = sandbox.limited(_sandbox_limits(limits)) + sandbox.command(
            sandbox.drop_to(uid) + inside if uid is not None else inside, kit=setup.kit,
            notebook=(notebook, f"{lab}.ipynb"), outputs={files[n]: names[n] for n in names},
            env=_env(limits.threads, sandbox.KIT), limits=_sandbox_limits(limits), shared=real_model_binds())
        cwd, env = None, None  # bwrap sets the sandbox's environment itself
    timed_out, loaded, started = "", False, []
    with open(output_path, "wb") as output:
        proc = subprocess.Popen(command, cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=output,
                                stderr=subprocess.STDOUT, process_group=0)
        try:
            last_event, seen = time.monotonic(), 0
            while proc.poll() is None:
                time.sleep(POLL_S)
                now = time.monotonic()
                text = _read_text(files["progress.txt"], MAX_PROGRESS_BYTES)
                events = text.count("\n")
                if events != seen:
                    seen, last_event = events, now
                    loaded, started = _parse_progress(text)
                if now > deadline:
                    timed_out = "total"
                elif not setup.trusted and now - last_event > (limits.test_timeout_s if loaded else
                                                               max(limits.test_timeout_s, limits.load_timeout_s)):
                    timed_out = "test" if loaded else "load"
                if timed_out:
                    break
        finally:
            _kill(proc)
    if uid is not None:
        _reap_uid(uid)
    loaded, started = _parse_progress(_read_text(files["progress.txt"], MAX_PROGRESS_BYTES))
    outcomes_text = _read_text(files["outcomes.json"], MAX_OUTCOMES_BYTES)
    try:
        data = json.loads(outcomes_text)
        parsed = data if isinstance(data, dict) else None
    except (ValueError, RecursionError):
        parsed = None
    return ChildRun(None if timed_out else proc.returncode, _read_text(output_path, OUTPUT_TAIL_BYTES, tail=True),
                    parse_log(_read_text(files["observations.jsonl"], MAX_LOG_BYTES)), parsed, started, loaded,
                    timed_out)


def _sandbox_limits(limits: Limits) -> sandbox.Limits:
    return sandbox.Limits(memory_bytes=limits.memory_bytes, cpu_seconds=int(limits.timeout_s * limits.threads) + 10,
                          processes=limits.processes)


def _reap_uid(uid: int) -> None:
    """As root: nothing of the run's uid may outlive it (its PID namespace is gone; this checks it)."""
    for _ in range(50):
        pids = sandbox.processes_of({uid})
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.1)


def run_reference(lab: str, limits: Limits) -> Reference:
    """The trusted run: the lab's solution notebook, the real kit, no limits."""
    solution = REPO_ROOT / "solutions" / lab / f"{lab}.ipynb"
    if not solution.is_file():
        raise ValueError(f"batch grading compares with the solution, and {solution} is missing")
    setup = Setup(lab, REPO_ROOT, limits, sandboxed=False, trusted=True)
    names = [t.name for t in official_tests(lab)]
    with tempfile.TemporaryDirectory(prefix=f"reference-{lab}-") as tmp:
        run = run_child(setup, solution, Path(tmp) / "run", names, time.monotonic() + REFERENCE_TIMEOUT_S)
    if run.code != 0 or run.outcomes is None:
        raise RuntimeError(f"the reference run of lab {lab}'s solution failed (exit {run.code}):\n{run.output[-3000:]}")
    return Reference(run.log, {r["name"]: r for r in run.outcomes["results"]})


# ---- judging -------------------------------------------------------------------------------------

def _crash_reason(code: int, output: str) -> str:
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"crashed: the grading process died of {name}"
    if code > 128 and code - 128 in signal.valid_signals():  # bwrap reports a signal death as 128 + N
        return _crash_reason(128 - code, output)
    tail = [line for line in output.strip().splitlines() if line.strip()][-1:] or [""]
    return f"crashed: the grading process exited with code {code} before finishing ({tail[0][:200]})"


def _learner_messages(outcomes: dict | None) -> dict[str, str]:
    """Each test's failure message as the submission's process reported it (explanations only)."""
    found: dict[str, str] = {}
    try:
        for r in (outcomes or {}).get("results", []):
            found[str(r["name"])] = str(r.get("message", ""))[:5000]
    except (TypeError, KeyError, AttributeError):
        pass
    return found


def judge(template: list[TestResult], reference: Reference, run: ChildRun,
          verdicts: dict[str, tuple[str, str]] | None = None) -> list[TestResult]:
    """Each official test's result from the two logs; the child's own messages only explain failures.
    `verdicts`: test -> (status, message) decided by the parent (a hang, a crash) before any comparison."""
    said = _learner_messages(run.outcomes)
    verdicts = verdicts or {}
    results = []
    for t in template:
        ref_outcome = reference.outcomes.get(t.name, {})
        if ref_outcome.get("status") == SKIPPED:
            results.append(TestResult(t.name, t.task, t.max_points, SKIPPED, ref_outcome.get("message", "")))
            continue
        if t.name in verdicts:
            status, message = verdicts[t.name]
            results.append(TestResult(t.name, t.task, t.max_points, status, message))
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


def grade_submission(sub: Submission, setup: Setup, reference: Reference, private: Path, index: int,
                     uid_base: int | None) -> Graded:
    """Grades one submission: sandboxed runs of the tests left until every test has an outcome."""
    lab, limits = setup.lab, setup.limits
    template = _official_maxima(lab)
    manual = manual_cells(lab)
    if sub.snapshot is None:
        status = REFUSED if sub.problem.startswith("refused") else MISSING
        reason = sub.problem or f"no {lab}.ipynb in the submission"
        return Graded(sub.student, _zero(template, status, reason), reason, notes=list(sub.notes), manual=manual)
    left = [t.name for t in template if reference.outcomes.get(t.name, {}).get("status") != SKIPPED]
    deadline = time.monotonic() + limits.timeout_s
    merged = ChildRun(0, "", {}, {"results": [], "cell_errors": []})
    verdicts: dict[str, tuple[str, str]] = {}
    restarts = 0
    whole_reason = ""
    while left:
        uid = None if uid_base is None else uid_base + index * UID_STRIDE + restarts
        run = run_child(setup, sub.snapshot, private / "runs" / f"{index}-{restarts}", left, deadline, uid)
        restarts += 1
        merged.log.update({k: v for k, v in run.log.items() if k in left})
        if isinstance(run.outcomes, dict):
            results = run.outcomes.get("results")
            if isinstance(results, list):
                merged.outcomes["results"] += results
            if isinstance(run.outcomes.get("cell_errors"), list) and not merged.outcomes["cell_errors"]:
                merged.outcomes["cell_errors"] = run.outcomes["cell_errors"][:20]
        merged.output = run.output
        done = [t for t in left if t in run.log]
        if run.code == 0 and run.outcomes is not None:
            break  # finished: tests it did not log "never ran"
        in_progress = next((t for t in reversed(run.started) if t in left and t not in done), None)
        culprit = in_progress or next((t for t in left if t not in done), None)
        if culprit is None:
            break  # every test logged before the process died
        if run.timed_out == "total":
            whole_reason = f"timed out after {limits.timeout_s:g} s in all (an endless loop?)"
            for t in left:
                if t not in done:
                    verdicts[t] = (TIMEOUT, whole_reason)
            break
        if not run.loaded:
            if run.timed_out == "load":
                whole_reason = (f"timed out after {max(limits.test_timeout_s, limits.load_timeout_s):g} s while loading the "
                                f"notebook (an endless loop?)")
                status = TIMEOUT
            else:
                whole_reason = _crash_reason(run.code, run.output) + " while loading the notebook"
                status = CRASHED
            for t in left:
                verdicts[t] = (status, whole_reason)
            break
        if run.timed_out == "test":
            verdicts[culprit] = (TIMEOUT, f"timed out after {limits.test_timeout_s:g} s in this test (an endless loop?)")
        else:
            verdicts[culprit] = (CRASHED, _crash_reason(run.code, run.output) + " in this test")
        left = [t for t in left if t not in done and t != culprit]
    notes = [str(n)[:2000] for n in merged.outcomes["cell_errors"]] + list(sub.notes)
    results = judge(template, reference, merged, verdicts)
    statuses = {r.status for r in results if r.status not in (PASSED, SKIPPED)}
    delegated = [r.name for r in results if r.status == DELEGATED]
    if whole_reason:
        reason = whole_reason
    elif delegated:
        reason = f"uses the reference implementation in {len(delegated)} tests"
    elif statuses & {TIMEOUT, CRASHED}:
        bad = [f"{r.name} {r.status}" for r in results if r.status in (TIMEOUT, CRASHED)]
        reason = "; ".join(bad[:5])
    else:
        reason = ""
    no_triton = sum(r.status == SKIPPED and is_triton_skip(r.message) for r in results)
    if no_triton:  # the grading machine has no triton: those tests earn nothing and the summary says why
        reason = "; ".join(filter(None, [reason, f"{no_triton} Triton tests {NO_TRITON} (grade on Linux for them)"]))
    return Graded(sub.student, results, reason, notes=notes, manual=manual)


# ---- the batch -------------------------------------------------------------------------------------

def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "w", newline="") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def write_csv(graded: list[Graded], path: Path) -> None:
    buffer = io.StringIO()
    writer = csv.writer(buffer)
    writer.writerow(["student", "test", "points", "status", "message"])
    for g in graded:
        for r in g.results:
            writer.writerow([g.student, r.name, f"{r.points:g}", r.status, r.message])
        for grade_id, points in g.manual:
            writer.writerow([g.student, grade_id, "", "manual", f"{points:g} points graded by the instructor"])
    _atomic_write(path, buffer.getvalue())


def _trusted_hashes(lab: str, kit_dir: Path) -> dict[str, dict[str, str]]:
    return {"kit": integrity.tree_hashes(kit_dir), "tests": integrity.tree_hashes(tests_path(lab)),
            "solution": integrity.tree_hashes(REPO_ROOT / "solutions" / lab)}


def grade_all(root: Path, lab: str, limits: Limits, out_dir: Path, jobs: int = 1,
              reference: Reference | None = None, unsafe_no_sandbox: bool = False) -> list[Graded]:
    """Grades every submission under `root` (`jobs` at a time) against the reference run (made here
    once unless given); writes grades.csv and report.html. Raises sandbox.SandboxUnavailable without
    bwrap unless `unsafe_no_sandbox`."""
    check_lab_name(lab)
    if not root.is_dir():
        raise ValueError(f"SUBMISSIONS_DIR must be a folder, got {root}")
    if jobs < 1:
        raise ValueError(f"--jobs must be >= 1, got {jobs}")
    if limits.timeout_s <= 0 or limits.test_timeout_s <= 0 or limits.memory_bytes < 2**28:
        raise ValueError(f"--timeout and --test-timeout must be > 0 s and --memory-gb >= 0.25, got {limits}")
    if not unsafe_no_sandbox:
        sandbox.require()
        sandbox.check_hidden([REPO_ROOT, root, out_dir])
    limits = replace(limits, threads=max(1, (os.cpu_count() or 1) // jobs))
    out_dir.mkdir(parents=True, exist_ok=True)
    subs = find_submissions(root, lab)
    uid_base = sandbox.fresh_uid() if not unsafe_no_sandbox and os.geteuid() == 0 else None
    with tempfile.TemporaryDirectory(prefix=f"grader-{lab}-") as tmp:
        private = Path(tmp)  # 0700: only this user (the sandboxes see only what is bound into them)
        snapshot(subs, private)
        kit_dir = private / "kit"
        write_kit(kit_files(lab), kit_dir)
        for here, dirs, files in os.walk(kit_dir):
            os.chmod(here, 0o755)
            for f in files:
                os.chmod(os.path.join(here, f), 0o644)
        (private / "runs").mkdir(mode=0o755)
        hashes = _trusted_hashes(lab, kit_dir)
        reference = reference or run_reference(lab, replace(limits, threads=os.cpu_count() or 1))
        setup = Setup(lab, kit_dir, limits, sandboxed=not unsafe_no_sandbox)
        graded: dict[str, Graded] = {}
        lock = threading.Lock()
        with ThreadPoolExecutor(max_workers=jobs) as pool:
            futures = [pool.submit(grade_submission, s, setup, reference, private, k, uid_base)
                       for k, s in enumerate(subs)]
            for future in tqdm(as_completed(futures), total=len(futures), desc=f"grading {lab}", unit="submission"):
                g = future.result()
                with lock:
                    graded[g.student] = g
        if uid_base is not None:
            left = sandbox.processes_of(set(range(uid_base, uid_base + UID_STRIDE * len(subs))))
            if left:
                raise IntegrityError(f"processes of the sandboxes outlived them: {left[:10]}")
        changed = {what: integrity.changed_files(before, kit_dir if what == "kit" else
                                                 tests_path(lab) if what == "tests" else REPO_ROOT / "solutions" / lab)
                   for what, before in hashes.items()}
        changed = {what: files for what, files in changed.items() if files}
        if changed:
            raise IntegrityError(f"the grading kit or the lab's tests changed during the batch ({changed}): "
                                 f"no grades written")
    ordered = [graded[s.student] for s in subs]
    write_csv(ordered, out_dir / "grades.csv")
    write_html(ordered, lab, out_dir / "report.html")
    return ordered


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("submissions", type=Path, help="folder with one sub-folder per student")
    parser.add_argument("--lab", required=True, help="NN_name")
    parser.add_argument("--jobs", type=int, default=1, help="submissions graded at once (default 1)")
    parser.add_argument("--timeout", type=float, default=600.0,
                        help="seconds per submission, every test and restart included (default 600)")
    parser.add_argument("--test-timeout", type=float, default=120.0,
                        help="seconds per test (and to load the notebook): a test past it scores 0, the rest "
                             "still run (default 120, as nbgrader's cell timeout)")
    parser.add_argument("--memory-gb", type=float, default=8.0,
                        help="address space per process of a submission (default 8)")
    parser.add_argument("--out", type=Path, default=None, help="output folder (default out/grades_NN_name)")
    parser.add_argument("--unsafe-no-sandbox", action="store_true",
                        help="grade without bubblewrap: the submissions can read and change anything this user can "
                             "(only for trusted code)")


def run_batch_cli(args: argparse.Namespace) -> int:
    out = args.out or Path("out") / f"grades_{args.lab}"
    limits = Limits(args.timeout, int(args.memory_gb * 2**30), test_timeout_s=args.test_timeout)
    if args.unsafe_no_sandbox:
        print("warning: --unsafe-no-sandbox: submissions run as this user, unconfined", file=sys.stderr)
    try:
        graded = grade_all(args.submissions, args.lab, limits, out, args.jobs, unsafe_no_sandbox=args.unsafe_no_sandbox)
    except sandbox.SandboxUnavailable as exc:
        print(f"error: {exc}.\nRefusing to grade untrusted code without the sandbox; --unsafe-no-sandbox grades "
              f"anyway (trusted submissions only).", file=sys.stderr)
        return 2
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except IntegrityError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 3
    width = max([len(g.student) for g in graded] + [7])
    for g in graded:
        manual = f" (+ {g.manual_points:g} graded by the instructor)" if g.manual else ""
        print(f"{g.student:<{width}}  {g.points:g} / {g.max_points:g}{manual}  {g.reason}")
    print(f"wrote {out / 'grades.csv'} and {out / 'report.html'}")
    return 0
