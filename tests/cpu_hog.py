"""A loaded machine on demand: the lab experiments' lessons must hold when the wall clock lies."""
from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from typing import Iterator


@contextlib.contextmanager
def cpu_hog() -> Iterator[None]:
    """One busy-looping process per core for the duration of the block (killed by their own ids)."""
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(os.cpu_count() or 2)]
    try:
        yield
    finally:
        for p in procs:
            p.kill()
            p.wait()
