"""The presets cache: `$INFERENCE_LABS_CACHE` (default `~/.cache/inference-labs`), and `build_once`,
which fills one of its folders exactly once even when several processes ask at the same time."""
from __future__ import annotations

import fcntl
import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable


def cache_root() -> Path:
    return Path(os.environ.get("INFERENCE_LABS_CACHE", Path.home() / ".cache" / "inference-labs"))


def build_once(target: Path, marker: str, build: Callable[[Path], None]) -> Path:
    """`target`, built by `build(folder)` unless it already holds `marker`; under a file lock, into a
    temporary folder renamed at the end, so concurrent callers never see a half-written folder."""
    if (target / marker).is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (target / marker).is_file():
            tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}-"))
            try:
                build(tmp)
                shutil.rmtree(target, ignore_errors=True)
                os.rename(tmp, target)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
    return target
