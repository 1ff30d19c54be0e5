"""`make grade-class-bench`: a class of 40 lab 03 submissions graded by `python -m grader batch --jobs 2`
in its sandbox, timed. 30 are the solution, 8 carry one of lab 03's planted bugs each, 2 hang in
`swap_out` (every test that swaps loses its points to the per-test limit, the rest are graded).
Checks every grade and prints the wall time (docs/instructors.md records it; the target is < 10 min
on 2 cores)."""
from __future__ import annotations

import csv
import importlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
LAB = "03_preemption"
SOLUTION = REPO / "solutions" / LAB / f"{LAB}.ipynb"
HANG = ("    ### BEGIN SOLUTION\n    rid = request.request_id", "    ### BEGIN SOLUTION\n    while True:\n        pass\n    rid = request.request_id")
TEST_TIMEOUT_S = 30


def write(path: Path, edits: list[tuple[str, str]]) -> None:
    nb = json.loads(SOLUTION.read_text())
    for cell in nb["cells"]:
        if cell["cell_type"] == "code" and cell.get("metadata", {}).get("nbgrader", {}).get("solution"):
            source = "".join(cell["source"])
            for old, new in edits:
                source = source.replace(old, new)
            cell["source"] = source
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps(nb))


def main() -> int:
    bugs = importlib.import_module(f"grader.labtests.lab{LAB}_bugs").BUGS[:8]
    with tempfile.TemporaryDirectory(prefix="grade-class-bench-") as tmp:
        root, out = Path(tmp) / "submitted", Path(tmp) / "out"
        kinds = {}
        for k in range(30):
            write(root / f"s{k:02d}_solution" / LAB / f"{LAB}.ipynb", [])
            kinds[f"s{k:02d}_solution"] = "solution"
        for k, bug in enumerate(bugs):
            write(root / f"s{30 + k:02d}_bug" / LAB / f"{LAB}.ipynb", [(bug.old, bug.new), *bug.more])
            kinds[f"s{30 + k:02d}_bug"] = "bug"
        for k in range(2):
            write(root / f"s{38 + k:02d}_hangs" / LAB / f"{LAB}.ipynb", [HANG])
            kinds[f"s{38 + k:02d}_hangs"] = "hangs"
        start = time.monotonic()
        done = subprocess.run([sys.executable, "-m", "grader", "batch", str(root), "--lab", LAB, "--jobs", "2",
                               "--test-timeout", str(TEST_TIMEOUT_S), "--out", str(out)], cwd=REPO)
        seconds = time.monotonic() - start
        if done.returncode != 0:
            print(f"grade-class-bench: the batch failed (exit {done.returncode})")
            return 1
        rows: dict[str, list[dict]] = {}
        with open(out / "grades.csv") as f:
            for row in csv.DictReader(f):
                rows.setdefault(row["student"], []).append(row)
        def statuses(student: str) -> dict[str, str]:
            return {r["test"]: r["status"] for r in rows[student] if r["status"] != "manual"}

        def points(student: str) -> float:
            return sum(float(r["points"]) for r in rows[student] if r["status"] != "manual")

        # the solution's statuses: all "passed" once lab 03 records observations, "unverifiable" before
        solution, full = statuses("s00_solution"), points("s00_solution")
        problems = [] if set(solution.values()) <= {"passed", "unverifiable", "skipped"} else [f"solution: {solution}"]
        for student, kind in kinds.items():
            mine = statuses(student)
            if kind == "solution" and (mine != solution or points(student) != full):
                problems.append(f"{student}: {points(student)} / {full} {mine}")
            if kind == "bug" and full > 0 and not points(student) < full:
                problems.append(f"{student}: a planted bug scored {points(student)} / {full}")
            if kind == "hangs":
                hung = [t for t, status in mine.items() if status == "timeout"]
                rest = {t: status for t, status in mine.items() if status != "timeout"}
                if not hung or not rest or any(solution[t] != status for t, status in rest.items()):
                    problems.append(f"{student}: hanging in swap_out: {mine}")
        print(f"grade-class-bench: 40 submissions of lab {LAB} (2 hanging, --jobs 2, --test-timeout "
              f"{TEST_TIMEOUT_S}) graded in {seconds:.0f} s; the solution scores {full:g}; load average "
              f"{os.getloadavg()[0]:.1f} at the end")
        for p in problems:
            print("  problem:", p)
        return 1 if problems or seconds >= 600 else 0


if __name__ == "__main__":
    sys.exit(main())
