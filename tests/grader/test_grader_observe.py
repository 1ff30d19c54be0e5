"""Observations (grader/observe.py) and the trusted comparison of logs (grader/batch/compare.py)."""
from __future__ import annotations

import enum
import json

import pytest
import torch

from grader.batch.compare import NOT_VERIFIABLE, TestLog, compare, compare_test, read_log
from grader.observe import (Recorder, expect_close, expect_equal, expect_raises, normalize, same,
                            set_recorder)


class Color(enum.Enum):
    RED = 1


class FoolsEquality(list):
    """A learner's trick: an object equal to anything."""

    def __eq__(self, other):
        return True


@pytest.fixture
def recorded(tmp_path):
    """Records observations of the `run` callback as one test, and returns its parsed log entry."""
    def record(run, test="test_x"):
        rec = Recorder(tmp_path / "log.jsonl")
        set_recorder(rec)
        try:
            rec.start(test)
            try:
                run()
            except AssertionError:
                rec.finish(False, "failed")
            else:
                rec.finish(True)
        finally:
            set_recorder(None)
        return read_log(tmp_path / "log.jsonl")[test]
    return record


def test_normalize_makes_plain_json_and_keeps_what_matters():
    value = {"b": (1, 2.5), "a": {3, 1}, "n": None, "t": True, "e": Color.RED, "f": float("nan")}
    got = normalize(value)
    assert json.loads(json.dumps(got)) == got
    assert got == {"$dict": [["a", {"$set": [1, 3]}], ["b", [1, 2.5]], ["e", {"$enum": "Color.RED"}],
                             ["f", {"$float": "nan"}], ["n", None], ["t", True]]}
    assert normalize(torch.tensor([[1.0, 2.0]])) == {"$tensor": {"dtype": "float32", "shape": [1, 2],
                                                                "values": [[1.0, 2.0]]}}
    assert normalize(FoolsEquality([1])) == [1]


def test_same_keeps_bools_apart_from_numbers():
    assert same(1, 1.0) and same([1, [2]], [1.0, [2]])
    assert not same(True, 1) and not same([1, 2], [1, 2, 3]) and not same("1", 1)


def test_expect_equal_explains_expected_got_and_where():
    expect_equal((0, 1), [0, 1], "a tuple equals a list once normalized")
    with pytest.raises(AssertionError) as info:
        expect_equal([2, 3, 9], [2, 3, 4], "get_new_blocks(3) on free queue [2, 3, 4]")
    assert str(info.value) == ("get_new_blocks(3) on free queue [2, 3, 4]\n  expected: [2, 3, 4]\n"
                               "  got:      [2, 3, 9] (first difference at index 2: 9 instead of 4)")
    with pytest.raises(AssertionError):
        expect_equal(FoolsEquality([5]), [1], "an object equal to everything is compared as its plain data")


def test_expect_close_uses_the_tolerance_and_shapes():
    expect_close(1.0 + 1e-7, 1.0, "close", atol=1e-6)
    expect_close(torch.tensor([1.0, 2.0]), [1.0, 2.0 + 1e-9], "a tensor against a list", rtol=1e-6)
    with pytest.raises(AssertionError, match=r"element \[1\] of shape \[2\]"):
        expect_close([1.0, 2.5], [1.0, 2.0], "off by 0.5", atol=0.1)
    with pytest.raises(AssertionError, match="shape"):
        expect_close([1.0], [1.0, 2.0], "wrong shape", atol=0.1)
    with pytest.raises(AssertionError):
        expect_close(float("nan"), 1.0, "NaN is never close", atol=1e9)


def test_expect_raises_checks_type_and_text():
    def bad(n):
        raise ValueError(f"num_blocks must be >= 0, got {n}")

    assert isinstance(expect_raises(ValueError, bad, -1, match="num_blocks", message="bad(-1)"), ValueError)
    with pytest.raises(AssertionError, match="expected: raises ValueError matching 'num_tokens'"):
        expect_raises(ValueError, bad, -1, match="num_tokens", message="bad(-1)")
    with pytest.raises(AssertionError, match="got:      returned 3"):
        expect_raises(ValueError, lambda: 3, message="returns instead")
    with pytest.raises(AssertionError, match="raised TypeError"):
        expect_raises(ValueError, lambda: 1 + "a", message="another error")


def test_recording_keeps_actual_values_and_the_trusted_side_keeps_expected(recorded):
    trusted = recorded(lambda: expect_equal([1, 2], [1, 2], "m"))
    assert trusted.completed and trusted.observations[0]["expected"] == [1, 2]
    assert trusted.observations[0]["message"] == "m"
    kit = recorded(lambda: expect_equal([1, 3], ..., ...))  # the kit never holds expected values
    assert kit.completed and kit.observations[0]["actual"] == [1, 3] and "expected" not in kit.observations[0]
    later = []
    value = [1]
    log = recorded(lambda: (expect_equal(value, ..., ...), later.append(value.append(2))))
    assert log.observations[0]["actual"] == [1], "an observation is a snapshot, not a reference"


def checks(a, b, want_a=..., want_b=..., atol=0.5):
    """One test body: trusted with expected values, as in the kit without (lines must match)."""
    expect_equal(a, want_a, "list" if want_a is not ... else ...)
    expect_close(b, want_b, "number" if want_b is not ... else ..., atol=atol)


def test_compare_passes_only_matching_complete_logs(recorded):
    ref = recorded(lambda: checks([1], 2.0, [1], 2.0))
    assert compare_test(ref, recorded(lambda: checks([1], 2.4))) == (True, "")
    # the reference run's tolerance decides, not the one the learner's process recorded
    ok, message = compare_test(ref, recorded(lambda: checks([1], 2.6, atol=10.0)))
    assert not ok and message.startswith("number\n  expected: 2.0\n  got:      2.6")
    ok, message = compare_test(ref, recorded(lambda: checks([7], 2.0)))
    assert not ok and message.startswith("list\n  expected: [1]\n  got:      [7]")
    stopped = TestLog(ref.observations[:1], completed=False, error="RuntimeError: boom")
    assert compare_test(ref, stopped) == (False, "RuntimeError: boom")
    assert compare_test(ref, TestLog([], completed=True))[0] is False
    assert compare_test(ref, None)[0] is False


def test_a_test_without_observations_is_never_passed_on_trust():
    ok, message = compare_test(TestLog([], completed=True), TestLog([], completed=True))
    assert not ok and message.startswith(NOT_VERIFIABLE)
    assert compare({"t": TestLog([], True)}, {})["t"][0] is False


def test_compare_reports_another_path_through_the_test(recorded):
    ref = recorded(lambda: expect_equal(1, 1, "m"))
    other = TestLog([{**ref.observations[0], "line": ref.observations[0]["line"] + 5}], completed=True)
    ok, message = compare_test(ref, other)
    assert not ok and "reached the check on line" in message


def test_read_log_skips_malformed_lines(tmp_path):
    path = tmp_path / "log.jsonl"
    path.write_text('not json\n{"test": "t", "observations": [], "completed": true}\n{"test": 1}\n')
    assert list(read_log(path)) == ["t"]


def test_failures_point_at_the_key_and_the_index_in_the_shape():
    """A dict names the key that differs (nested too); a tensor the index in its shape, not a flat offset."""
    with pytest.raises(AssertionError, match=r"first difference at \['rank 1'\]\['w'\]\[1\]: 5 instead of 4\)"):
        expect_equal({"rank 0": {"w": [1, 2]}, "rank 1": {"w": [3, 5]}},
                     {"rank 0": {"w": [1, 2]}, "rank 1": {"w": [3, 4]}}, "shards")
    with pytest.raises(AssertionError, match=r"missing 'b'; unexpected 'c'"):
        expect_equal({"a": 1, "c": 2}, {"a": 1, "b": 2}, "keys")
    with pytest.raises(AssertionError, match=r"element \[3, 1\] of shape \[4, 2\]"):
        expect_close(torch.tensor([[0.0, 0.0]] * 3 + [[0.0, 1.0]]), torch.zeros(4, 2), "rows", atol=1e-6)
