"""Tamper evidence for batch grading, judged by the parent: files a submission's process changed.

`tree_digest` / `changed_files` catch a submission that edits its private grading kit or writes
into the output folder; `restore` puts the output folder back. The pass/fail decision itself does
not trust the submission's process at all (grader/compare.py).
"""
from __future__ import annotations

from pathlib import Path


def tree_digest(root: Path) -> dict[str, bytes]:
    """Contents of every file under `root` (no caches), to compare and to restore."""
    return {
        str(p.relative_to(root)): p.read_bytes()
        for p in sorted(root.rglob("*"))
        if p.is_file() and "__pycache__" not in p.parts
    }


def changed_files(before: dict[str, bytes], root: Path) -> list[str]:
    after = tree_digest(root)
    return sorted(name for name in before.keys() | after.keys() if before.get(name) != after.get(name))


def restore(before: dict[str, bytes], root: Path) -> None:
    """Puts the folder back as it was (a tampering submission must not affect the next one)."""
    for name in changed_files(before, root):
        path = root / name
        if name in before:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(before[name])
        else:
            path.unlink()
