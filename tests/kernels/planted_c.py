"""Bugs planted in a C kernel's source file, compiled alone: each must fail the tests that claim to catch it."""
from __future__ import annotations

import ctypes
import subprocess
from pathlib import Path
from typing import Callable

from kernels.cpu.build import CSRC, detected
from kernels.cpu.interface import SIGNATURES


def planted_library(tmp_path: Path, name: str, line: str, planted: str, exports: list[str]) -> ctypes.CDLL:
    """csrc/`name` with `line` replaced by `planted` (as it is when `line` is empty), compiled alone with the
    library's flags, `exports` declared from the interface's signature table."""
    source = (CSRC / name).read_text()
    assert not line or source.count(line) == 1, f"{name}: the planted line must occur once: {line!r}"
    src, out = tmp_path / name, tmp_path / f"planted{len(list(tmp_path.glob('planted*.so')))}.so"
    src.write_text(source.replace(line, planted) if line else source)
    tc = detected()
    done = subprocess.run([tc.cc, *tc.flags, f"-I{CSRC}", str(src), "-o", str(out)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    lib = ctypes.CDLL(str(out))
    for export in exports:
        fn = getattr(lib, export)
        fn.argtypes, fn.restype = SIGNATURES[export]
    return lib


def assert_each_bug_caught(tmp_path: Path, name: str, exports: list[str], bugs: list[tuple[str, str, str]],
                           checks: list[Callable[[ctypes.CDLL], None]]) -> None:
    """The file as it is passes every check; each (what, line, planted form) in `bugs` fails at least one."""
    for what, line, planted in [("nothing", "", ""), *bugs]:
        lib = planted_library(tmp_path, name, line, planted, exports)
        failed = 0
        for check in checks:
            try:
                check(lib)
            except AssertionError:
                failed += 1
        assert failed if line else not failed, f"planted bug not caught: {what}" if line else f"{name} as it is"
