"""One graded test's outcome, and the points table built from many."""
from __future__ import annotations

from collections import defaultdict
from dataclasses import asdict, dataclass, field
from typing import Iterable

from grader.without_triton import is_triton_skip

PASSED, FAILED, SKIPPED = "passed", "failed", "skipped"
DELEGATED, UNVERIFIABLE = "delegated", "unverifiable"  # batch grading: uses the reference; no observations


@dataclass
class TestResult:
    """What a test earned and, when it did not pass, a message a learner can act on."""

    __test__ = False  # not a pytest test class

    name: str  # the test function's name, e.g. "test_num_blocks_partial_block"
    task: str
    max_points: float
    status: str = PASSED  # passed / failed / skipped / delegated / unverifiable, or a batch-level reason (timeout ...)
    message: str = ""

    @property
    def points(self) -> float:
        return self.max_points if self.status == PASSED else 0.0

    def to_dict(self) -> dict:
        return {**asdict(self), "points": self.points}


def points_table(results: Iterable[TestResult]) -> list[tuple[str, float, float, str]]:
    """(task, earned, possible, note) per task in first-seen order, then a "total" row."""
    earned: dict[str, float] = defaultdict(float)
    possible: dict[str, float] = defaultdict(float)
    notes: dict[str, list[str]] = defaultdict(list)
    no_triton: dict[str, int] = defaultdict(int)
    results = list(results)
    for r in results:
        earned[r.task] += r.points
        possible[r.task] += r.max_points
        if r.status == SKIPPED and is_triton_skip(r.message):
            no_triton[r.task] += 1
        elif r.status != PASSED:
            notes[r.task].append(f"{r.name} {r.status}")
    for task, n in no_triton.items():
        notes[task].append(f"{n} test{'s' if n > 1 else ''} not gradable here: Triton needs Linux")
    rows = [(t, earned[t], possible[t], ", ".join(notes[t])) for t in possible]
    rows.append(("total", sum(earned.values()), sum(possible.values()), ""))
    return rows


def format_points_table(results: Iterable[TestResult]) -> str:
    rows = points_table(results)
    width = max(len(task) for task, *_ in rows)
    lines = []
    for task, got, out_of, note in rows:
        line = f"{task:<{width}}  {got:g} / {out_of:g}"
        lines.append(f"{line}   ({note})" if note else line)
    return "\n".join(lines)


@dataclass
class Graded:
    """One student's batch results; `reason` says why the whole submission scored zero (timeout, crash ...)
    or which of its tests used the reference implementation."""

    student: str
    results: list[TestResult]
    reason: str = ""
    notes: list[str] = field(default_factory=list)
    manual: list[tuple[str, float]] = field(default_factory=list)  # (grade_id, points) the instructor grades by hand

    @property
    def points(self) -> float:
        return sum(r.points for r in self.results)

    @property
    def max_points(self) -> float:
        return sum(r.max_points for r in self.results)

    @property
    def manual_points(self) -> float:
        """Points of manually graded cells: never earned here, listed for the instructor."""
        return sum(points for _, points in self.manual)
