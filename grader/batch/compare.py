"""The trusted side of batch grading: a learner's observation log against the reference run's.

A test passes only if the learner's run recorded the same checks as the reference run (same
kind, same source line, in order), every observed value matches what the reference run
expected (floats and tensors within the tolerance the *reference* run recorded), and the
learner's test reached its end. A test whose reference run recorded nothing is never passed
on trust: it is "not verifiable" until it is converted to `expect_*` checks.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from grader.observe import close, explain, explain_prediction, prediction_ok, raises_ok, same

NOT_VERIFIABLE = "not verifiable"


@dataclass
class TestLog:
    """One test's record: its observations in order, whether it reached its end, and why not."""

    __test__ = False  # not a pytest test class

    observations: list[dict] = field(default_factory=list)
    completed: bool = False
    error: str = ""


def read_log(path: str | Path) -> dict[str, TestLog]:
    """The JSON-lines log a Recorder wrote; malformed lines (a learner's process wrote them) are skipped."""
    logs: dict[str, TestLog] = {}
    if not Path(path).is_file():
        return logs
    for line in Path(path).read_text(errors="replace").splitlines():
        try:
            entry = json.loads(line)
            test, observations = str(entry["test"]), list(entry["observations"])
            logs[test] = TestLog([o for o in observations if isinstance(o, dict)], bool(entry["completed"]),
                                 str(entry.get("error", "")))
        except (ValueError, KeyError, TypeError):
            continue
    return logs


def _tolerances(ref: dict) -> tuple[float, float]:
    return float(ref.get("rtol", 0.0)), float(ref.get("atol", 0.0))


def _matches(ref: dict, got: dict) -> tuple[bool, str]:
    """(match?, detail) of one learner observation against the reference run's."""
    kind = ref.get("kind")
    if kind == "equal":
        return same(got.get("actual"), ref.get("expected")), ""
    if kind == "close":
        return close(got.get("actual"), ref.get("expected"), *_tolerances(ref))
    if kind == "raises":
        return raises_ok(ref["expected"], got.get("actual")), ""
    if kind == "prediction":
        return prediction_ok(got.get("actual"), ref.get("expected"), *_tolerances(ref)), ""
    return False, f"unknown kind {kind!r}"


def compare_test(ref: TestLog | None, got: TestLog | None) -> tuple[bool, str]:
    """(passed, message) of one test."""
    if ref is None or not ref.completed:
        reason = "" if ref is None else f": {ref.error}"
        return False, f"the reference solution did not complete this test (a grading error, tell the instructor){reason}"
    if not ref.observations:
        return False, (f"{NOT_VERIFIABLE}: this test records no observations, so batch grading cannot check its "
                       f"result outside your process")
    if got is None:
        return False, "the test never ran in your submission's process"
    for i, (r, g) in enumerate(zip(ref.observations, got.observations)):
        if (g.get("kind"), g.get("line")) != (r.get("kind"), r.get("line")):
            return False, (f"check {i + 1} of the test: your run reached the check on line {g.get('line')}, the "
                           f"reference run the one on line {r.get('line')}")
        ok, detail = _matches(r, g)
        if not ok and r.get("kind") == "prediction":  # which way, never the value (it is in the solution notebook)
            return False, explain_prediction(str(r.get("message", "")), r.get("expected"), g.get("actual"),
                                             *_tolerances(r))
        if not ok:
            return False, explain(str(r.get("message", "")), r.get("expected"), g.get("actual"), detail)
    if len(got.observations) < len(ref.observations):
        if not got.completed:
            return False, got.error or "the test stopped before its end"
        return False, f"your run made {len(got.observations)} checks, the reference run {len(ref.observations)}"
    if len(got.observations) > len(ref.observations):
        return False, f"your run made {len(got.observations)} checks, the reference run {len(ref.observations)}"
    if not got.completed:
        return False, got.error or "the test stopped before its end"
    return True, ""


def compare(reference_log: dict[str, TestLog], learner_log: dict[str, TestLog]) -> dict[str, tuple[bool, str]]:
    """(passed, message) for every test of the reference log."""
    return {test: compare_test(ref, learner_log.get(test)) for test, ref in reference_log.items()}
