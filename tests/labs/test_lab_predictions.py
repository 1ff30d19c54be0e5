"""Graded predictions never print their answer before grading (issue #39, item 1).

A prediction whose failure says "expected 5605" is pasted in on the next run and stops being a prediction.
Every lab's prediction tests (each `test_predicted_*`, and the answers recalled from memory: lab 14's OOM hunt
and hardware quiz) check with `grader.observe.expect_prediction`, and each is run here on the solution's answer
made wrong: its failure must say which way it is off and must not contain the expected value in any usual
spelling (repr, %g, 3 or 4 significant digits, thousands separators). The expected values come from the run's
own observation log (the trusted side records them), so the check holds whatever the answer is.
"""
from __future__ import annotations

import ast
import functools
import json
import math
import re
import types
from pathlib import Path

import pytest

from grader import labs as lab_files
from grader.labs import REPO_ROOT
from grader.loader import load_notebook
from grader.observe import how_far, prediction_ok, render
from grader.release import solution_labs
from grader.runner import run_tests

LABS = [lab for lab in solution_labs() if lab < "15" or lab in ("15_fine_tune_to_serve", "16_long_context_kv",
                                                                 "17_coding_round", "18_flash_attention")]
RECALLED = {"14_find_the_bottleneck": ("test_oom_hunt", "test_hardware_numbers", "test_slips_caught")}
HINT_WORDS = re.compile(r"by (more|less) than (a factor )?\d+%?|passes within [^)]*|element \[[\d, ]+\]")


def prediction_tests(lab: str) -> dict[str, set[str]]:
    """{test: the learner's functions it calls} for the lab's prediction tests."""
    tree = ast.parse(lab_files.tests_path(lab).read_text())
    found = {}
    for fn in tree.body:
        if isinstance(fn, ast.FunctionDef) and (fn.name.startswith("test_predict") or fn.name in RECALLED.get(lab, ())):
            found[fn.name] = {n.attr for n in ast.walk(fn) if isinstance(n, ast.Attribute)
                              and isinstance(n.value, ast.Name) and n.value.id == "student"}
    return found


def uses_expect_prediction(lab: str, test: str) -> bool:
    tree = ast.parse(lab_files.tests_path(lab).read_text())
    fn = next(f for f in tree.body if isinstance(f, ast.FunctionDef) and f.name == test)
    return any(isinstance(n, ast.Name) and n.id == "expect_prediction" for n in ast.walk(fn))


def wrong(value, strings: bool):
    """`value` with every number off by about 37% (ints by at least 1), bools flipped; names too if `strings`."""
    if isinstance(value, bool):
        return not value
    if isinstance(value, int):
        return value + max(1, round(abs(value) * 0.37))
    if isinstance(value, float):
        return value * 1.37 if value else 1.0
    if isinstance(value, str):
        return value + "_wrong" if strings else value
    if isinstance(value, (list, tuple)):
        return type(value)(wrong(v, strings) for v in value)
    if isinstance(value, dict):
        return {k: wrong(v, strings) for k, v in value.items()}
    return value


@functools.cache
def solution(lab: str) -> types.ModuleType:
    return load_notebook(REPO_ROOT / "solutions" / lab / f"{lab}.ipynb")


def spellings(x: float) -> set[str]:
    """How a failure message could print the number x."""
    forms = {repr(x), f"{x:g}", f"{x:.3g}", f"{x:.4g}", f"{x:.3f}", f"{x:.2f}"}
    if abs(x) >= 1000:
        forms |= {f"{x:,.0f}", f"{x:.0f}"}
    if float(x).is_integer():
        forms.add(str(int(x)))
    return {f for f in forms if f not in ("0", "0.0", "-0")}


def numbers(value) -> list[float]:
    if isinstance(value, bool):
        return []
    if isinstance(value, (int, float)):
        return [float(value)] if math.isfinite(value) else []
    if isinstance(value, list):
        return [x for v in value for x in numbers(v)]
    if isinstance(value, dict):
        return [x for v in value.values() for x in numbers(v)]
    return []


def leaks(text: str, observation: dict) -> list[str]:
    """The spellings of the observation's expected value (numbers, or names) that `text` shows, outside the
    question's own text, the learner's answer and the hint's fixed words."""
    text = text.replace(observation.get("message", ""), "").replace(render(observation["actual"]), "")
    text = HINT_WORDS.sub("", text)
    expected = observation["expected"]
    found = [f for x in numbers(expected) for f in spellings(x)
             if re.search(rf"(?<![\w.]){re.escape(f)}(?![\w]|\.\d)", text)]
    names = [expected] if isinstance(expected, str) else [v for v in expected if isinstance(v, str)] \
        if isinstance(expected, list) else []
    return found + [n for n in names if n in text]


CASES = [(lab, test) for lab in LABS for test in prediction_tests(lab)]


def test_every_lab_from_01_has_a_graded_prediction():
    assert {lab for lab, _ in CASES} >= {lab for lab in LABS if lab >= "01"}, "a lab lost its prediction"


@pytest.mark.parametrize("lab,test", CASES, ids=[f"{lab}-{test}" for lab, test in CASES])
def test_a_wrong_prediction_fails_without_showing_the_answer(lab, test, tmp_path: Path, monkeypatch):
    monkeypatch.delenv("NBGRADER_EXECUTION", raising=False)
    assert uses_expect_prediction(lab, test), f"{lab}: {test} must check with expect_prediction"
    failed_once = False
    for strings in (False, True):
        sol = solution(lab)
        module = types.ModuleType(f"wrong_{lab}")
        module.__dict__.update(sol.__dict__)
        for name in prediction_tests(lab)[test] | {n for n in vars(sol) if n.startswith("predicted_")}:
            if callable(getattr(sol, name, None)):
                module.__dict__[name] = (lambda f: lambda *a, **k: wrong(f(*a, **k), strings))(getattr(sol, name))
        log = tmp_path / f"{strings}.jsonl"
        [result] = run_tests(lab, lambda: module, [test], observe_to=log)
        if result.status == "passed":
            continue
        failed_once = True
        observations = [o for line in log.read_text().splitlines() for o in json.loads(line)["observations"]]
        predictions = [o for o in observations if o["kind"] == "prediction"]
        assert predictions, f"{lab}: {test} failed before any prediction check: {result.message}"
        missed = [o for o in predictions if not prediction_ok(o["actual"], o["expected"], o["rtol"], o["atol"])]
        assert missed, f"{lab}: {test} failed on a check that is not the prediction: {result.message}"
        shown = [f for o in missed for f in leaks(result.message, o)]
        assert not shown, f"{lab}: {test}'s failure shows the expected value ({shown}):\n{result.message}"
        assert "not shown before grading" in result.message, result.message
    assert failed_once, f"{lab}: {test} passes with every answer off by 37%"


def test_the_autograde_run_shows_the_value_as_feedback(monkeypatch):
    """nbgrader's autograde output becomes the learner's feedback: there the value is shown."""
    from grader.observe import expect_prediction
    monkeypatch.setenv("NBGRADER_EXECUTION", "autograde")
    with pytest.raises(AssertionError, match=r"expected: 5605"):
        expect_prediction(1800, 5605, "replicas", rtol=0.005)
    monkeypatch.setenv("NBGRADER_EXECUTION", "validate")  # the learner's Validate button: no value
    with pytest.raises(AssertionError) as caught:
        expect_prediction(1800, 5605, "replicas", rtol=0.005)
    assert "5605" not in str(caught.value) and "too low by more than a factor 2" in str(caught.value)


def test_how_far_bands():
    assert [how_far(a, 100.0) for a in (95, 120, 250, 2000, 40, 5, -3)] == [
        "too low by less than 10%", "too high by more than 10%", "too high by more than a factor 2",
        "too high by more than a factor 10", "too low by more than a factor 2", "too low by more than a factor 10",
        "the wrong sign"]


def test_batch_grading_does_not_show_the_value_either():
    from grader.batch.compare import TestLog, compare_test
    ref = TestLog([{"kind": "prediction", "line": 7, "actual": 5605, "expected": 5605, "message": "replicas",
                    "rtol": 0.005, "atol": 0.0}], completed=True)
    got = TestLog([{"kind": "prediction", "line": 7, "actual": 1800}], completed=True)
    passed, message = compare_test(ref, got)
    assert not passed and "5605" not in message and "too low" in message, message
    assert compare_test(ref, TestLog([{"kind": "prediction", "line": 7, "actual": 5620}], completed=True))[0]
