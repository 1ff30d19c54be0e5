"""Build csrc/*.c (and its headers) into one shared library with the system C compiler, on first use, cached.

Plain C with OpenMP and no torch headers, so a build takes about a second (a torch C++
extension spends 10-15 s per file parsing headers). The library is cached under
`$INFERENCE_LABS_CACHE/kernels` (default `~/.cache/inference-labs/kernels`), named by a hash of
the sources, the flags, the compiler's version and this CPU's feature flags (`-march=native`
code must not run on another CPU). A file lock makes concurrent first uses build once. The
library links libgomp by soname, so once torch is imported it shares torch's OpenMP runtime and
thread count.
"""
from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

CSRC = Path(__file__).parent / "csrc"
FLAGS = ["-O3", "-march=native", "-fopenmp", "-std=gnu11", "-shared", "-fPIC", "-Wall", "-Werror"]


class BuildError(RuntimeError):
    """The library could not be built; the message says why (compiler missing, compile error)."""


def cache_dir() -> Path:
    root = os.environ.get("INFERENCE_LABS_CACHE") or Path.home() / ".cache" / "inference-labs"
    return Path(root) / "kernels"


def compiler() -> str:
    cc = os.environ.get("CC", "cc")
    if shutil.which(cc) is None:
        raise BuildError(f"no C compiler: {cc!r} is not on PATH (install gcc, or set CC)")
    return cc


def library_path(cc: str, extra_flags: tuple[str, ...] = ()) -> Path:
    """Where the library for these sources, flags, compiler and CPU lives."""
    h = hashlib.sha256()
    for src in sorted(CSRC.iterdir()):  # sources and headers
        h.update(src.name.encode() + src.read_bytes())
    h.update(" ".join(FLAGS + list(extra_flags)).encode())
    h.update(subprocess.run([cc, "--version"], capture_output=True, text=True).stdout.encode())
    h.update(_cpu_flags().encode())
    return cache_dir() / f"cpu-kernels-{h.hexdigest()[:16]}.so"


def build(extra_flags: tuple[str, ...] = ()) -> Path:
    """The cached library's path, compiling it first if needed. Raises BuildError. `extra_flags` go after
    FLAGS (tests build the portable paths of a kernel with e.g. `-mno-avx512vnni`)."""
    cc = compiler()
    target = library_path(cc, extra_flags)
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process may be building the same file
        if target.is_file():
            return target
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
        os.close(fd)
        cmd = [cc, *FLAGS, *extra_flags, *map(str, sorted(CSRC.glob("*.c"))), "-o", tmp, "-lm"]
        result = subprocess.run(cmd, capture_output=True, text=True)
        if result.returncode != 0:
            os.unlink(tmp)
            raise BuildError(f"`{' '.join(cmd)}` failed:\n{result.stderr.strip()}")
        os.replace(tmp, target)
    return target


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        return ""
