"""What batch grading's parent does with files a submission could have touched: hashes, bounded reads."""
from __future__ import annotations

import os

from grader.batch import integrity


def test_edited_added_and_removed_files_are_listed(tmp_path):
    (tmp_path / "a.py").write_text("x = 1\n")
    (tmp_path / "b.py").write_text("y = 2\n")
    before = integrity.tree_hashes(tmp_path)
    (tmp_path / "a.py").write_text("x = 2\n")
    (tmp_path / "b.py").unlink()
    (tmp_path / "c.py").write_text("z = 3\n")
    os.symlink("/etc/passwd", tmp_path / "d.py")
    assert integrity.changed_files(before, tmp_path) == ["a.py", "b.py", "c.py", "d.py"]


def test_a_sparse_file_is_read_only_up_to_the_limit(tmp_path):
    sparse = tmp_path / "observations.jsonl"
    with open(sparse, "wb") as f:
        f.write(b"head")
        f.truncate(64 << 30)  # 64 GiB, no disk
        f.seek(0, 2)
        f.write(b"tail")
    assert integrity.read_bounded(sparse, 10) == b"head" + b"\0" * 6
    assert integrity.read_bounded(sparse, 6, tail=True) == b"\0\0tail"


def test_links_and_non_files_are_not_read(tmp_path):
    (tmp_path / "secret").write_text("instructor's key")
    os.symlink(tmp_path / "secret", tmp_path / "outcomes.json")
    assert integrity.read_bounded(tmp_path / "outcomes.json", 100) is None
    assert integrity.read_bounded(tmp_path, 100) is None
    os.mkfifo(tmp_path / "fifo")
    assert integrity.read_bounded(tmp_path / "fifo", 100) is None  # never blocks on a pipe
    assert integrity.read_bounded(tmp_path / "missing", 100) is None
