"""`grader.check`: the notebook test cells' entry point, graded on live namespaces."""
from __future__ import annotations

import os
import warnings

import pytest

import grader


def namespace_with(source: str) -> dict:
    namespace: dict = {}
    exec(source, namespace)
    return namespace


CORRECT = "def num_blocks_needed(n, b):\n    return -(-n // b)"
FLOOR = "def num_blocks_needed(n, b):\n    return n // b"


def test_a_correct_namespace_passes_and_reports_points(capsys):
    grader.check("00_warmup", namespace_with(CORRECT))
    out = capsys.readouterr().out
    assert "00_warmup: 5 of 5 tests passed, 5 of 5 points" in out
    assert "[PASS] test_whole_blocks (1 pt)" in out


def test_a_wrong_answer_raises_and_says_input_expected_and_got(capsys):
    with pytest.raises(grader.CheckFailed, match="1 of 2 tests did not pass: test_partial_block"):
        grader.check("00_warmup", namespace_with(FLOOR), tests=["test_whole_blocks", "test_partial_block"])
    out = capsys.readouterr().out
    assert "[PASS] test_whole_blocks" in out
    assert "[FAIL] test_partial_block (1 pt)" in out
    assert "num_blocks_needed(1, 16)\n  expected: 1\n  got:      0" in out.replace("\n       ", "\n")


def test_a_missing_function_names_what_is_missing(capsys):
    with pytest.raises(grader.CheckFailed):
        grader.check("00_warmup", {}, tests=["test_whole_blocks"])
    assert "defines no `num_blocks_needed`" in capsys.readouterr().out


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"lab": "99_nope", "namespace": {}}, r"lab must be one of \[.*'00_warmup'"),
        ({"lab": "00_warmup", "namespace": {}, "tests": ["test_typo"]}, r"tests: \['test_typo'\] are not tests"),
        ({"lab": "00_warmup", "namespace": {}, "tests": "test_whole_blocks"}, "tests must be a list"),
        ({"lab": "00_warmup", "namespace": None}, "namespace must be a dict"),
    ],
)
def test_bad_arguments_are_value_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        grader.check(**kwargs)


def test_nothing_reaches_stderr_even_when_the_code_warns(capfd):
    """nbgrader zeroes a test cell with any stderr output; torch warns on stderr."""
    namespace = namespace_with(CORRECT)
    inner = namespace["num_blocks_needed"]

    def noisy(n, b):
        warnings.warn("a torch-style UserWarning")
        os.write(2, b"a C++ warning written straight to fd 2\n")
        return inner(n, b)

    namespace["num_blocks_needed"] = noisy
    grader.check("00_warmup", namespace, tests=["test_whole_blocks"])
    captured = capfd.readouterr()
    assert captured.err == ""
    assert "1 of 1 tests passed" in captured.out


def test_a_namespace_that_calls_the_engines_own_function_is_told_so(capsys):
    delegating = ("from engine_core.core.kv_cache_manager import cdiv as _engine_cdiv\n"
                  "def num_blocks_needed(n, b):\n    return _engine_cdiv(n, b)")
    with pytest.raises(grader.CheckFailed):
        grader.check("00_warmup", namespace_with(delegating), tests=["test_whole_blocks"])
    out = capsys.readouterr().out
    assert "[FAIL] test_whole_blocks" in out
    assert "uses the reference implementation: the engine's own kv_cache_manager.cdiv" in out
    assert "scores 0 for that test" in out
