"""Tamper evidence used by batch grading: replaced functions, edited files, forged results."""
from __future__ import annotations

import grader.results
from grader import integrity


def test_a_replaced_function_or_property_is_named(monkeypatch):
    before = integrity.snapshot()
    monkeypatch.setattr(grader.results.TestResult, "points", property(lambda self: self.max_points))
    monkeypatch.setattr(grader.results, "format_points_table", lambda results: "all full marks")
    changed = integrity.changed_callables(before, integrity.snapshot())
    assert changed == ["grader.results.TestResult.points", "grader.results.format_points_table"]


def test_nothing_changed_means_nothing_reported():
    before = integrity.snapshot()
    import json  # noqa: F401 - a new import adds modules, which is not tampering

    assert integrity.changed_callables(before, integrity.snapshot()) == []


def test_edited_added_and_removed_files_are_listed(tmp_path):
    (tmp_path / "a.py").write_text("x = 1\n")
    (tmp_path / "b.py").write_text("y = 2\n")
    before = integrity.tree_digest(tmp_path)
    (tmp_path / "a.py").write_text("x = 2\n")
    (tmp_path / "b.py").unlink()
    (tmp_path / "c.py").write_text("z = 3\n")
    assert integrity.changed_files(before, tmp_path) == ["a.py", "b.py", "c.py"]
    integrity.restore(before, tmp_path)
    assert integrity.changed_files(before, tmp_path) == []


def test_a_result_signed_with_another_key_or_altered_is_rejected():
    key, payload = b"k" * 32, '{"results": []}'
    signature = integrity.sign(key, payload)
    assert integrity.verify(key, payload, signature)
    assert not integrity.verify(b"x" * 32, payload, signature)
    assert not integrity.verify(key, payload + " ", signature)
