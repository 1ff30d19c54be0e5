"""Tamper evidence used by batch grading: files a submission's process changed."""
from __future__ import annotations

from grader import integrity


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
