"""What the trusted parent of batch grading does with files a submission could have touched.

- `tree_hashes` / `changed_files`: the grading kit and the lab's tests are hashed when the batch
  starts and checked when it ends (streamed: a file is never read whole into memory).
- `read_bounded`: every file a submission's process wrote (its observation log, outcomes, output)
  is read through this: no symbolic links followed, regular files only, at most `limit` bytes (a
  sparse file of many GiB costs nothing).
"""
from __future__ import annotations

import hashlib
import os
import stat
from pathlib import Path

CHUNK = 1 << 20


def file_hash(path: Path) -> str:
    h = hashlib.sha256()
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    try:
        while chunk := os.read(fd, CHUNK):
            h.update(chunk)
    finally:
        os.close(fd)
    return h.hexdigest()


def tree_hashes(root: Path) -> dict[str, str]:
    """sha256 of every file under `root` (a file, or a folder walked without following links), by
    path relative to `root`'s folder; links are recorded as "link -> target"."""
    root = Path(root)
    if not root.is_dir():
        return {root.name: file_hash(root)} if root.is_file() else {}
    found: dict[str, str] = {}
    for folder, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        for name in [*files, *(d for d in dirs if os.path.islink(os.path.join(folder, d)))]:
            path = Path(folder) / name
            rel = str(path.relative_to(root))
            found[rel] = f"link -> {os.readlink(path)}" if path.is_symlink() else file_hash(path)
    return found


def changed_files(before: dict[str, str], root: Path) -> list[str]:
    """Files added, removed or changed under `root` since `before = tree_hashes(root)`."""
    after = tree_hashes(root)
    return sorted(name for name in before.keys() | after.keys() if before.get(name) != after.get(name))


def read_bounded(path: Path, limit: int, tail: bool = False) -> bytes | None:
    """At most `limit` bytes of a regular file (its last ones with `tail`); None when the file is
    missing, a link or not a regular file."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            return None
        if tail and info.st_size > limit:
            os.lseek(fd, info.st_size - limit, os.SEEK_SET)
        parts, left = [], limit
        while left > 0 and (chunk := os.read(fd, min(CHUNK, left))):
            parts.append(chunk)
            left -= len(chunk)
        return b"".join(parts)
    finally:
        os.close(fd)
