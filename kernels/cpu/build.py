"""Build csrc/*.c (and its headers) into one shared library with the system C compiler, on first use, cached.

Plain C with OpenMP and no torch headers, so a build takes about a second (a torch C++ extension spends
10-15 s per file parsing headers). `detect` picks the compiler (`$CC`, else cc, gcc or clang: GCC, clang
or Apple's clang), the ISA flags (`-march=native` on x86-64, `-mcpu=native` on Linux ARM, the compiler's
default on Apple Silicon; none for a portable build) and OpenMP (GCC's `-fopenmp`; clang's needs libomp:
torch's own copy or Homebrew's on macOS). Each choice is proven by compiling a probe: a compiler that
cannot build a shared library is no compiler, and where OpenMP does not link the kernels run on one
thread. The library is cached under `$INFERENCE_LABS_CACHE/kernels` (default
`~/.cache/inference-labs/kernels`), named by a hash of the sources, the flags, the compiler's version and
this CPU's feature flags (`-march=native` code must not run on another CPU). A file lock makes concurrent
first uses build once. GCC's build links libgomp by soname, so once torch is imported it shares torch's
OpenMP runtime and thread count.
"""
from __future__ import annotations

import dataclasses
import fcntl
import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Callable

CSRC = Path(__file__).parent / "csrc"
FLAGS = ["-O3", "-std=gnu11", "-shared", "-fPIC", "-Wall", "-Werror"]
# Homebrew's prefixes (Apple Silicon, Intel); `brew install libomp` puts the library under opt/libomp
HOMEBREW_PREFIXES = ("/opt/homebrew", "/usr/local")
_PROBE = "int probe(int n) {\n    int s = 0;\n#pragma omp parallel for reduction(+ : s)\n" \
         "    for (int i = 0; i < n; i++) s += i;\n    return s;\n}\n"

Run = Callable[[list[str]], "subprocess.CompletedProcess[str]"]


class BuildError(RuntimeError):
    """The library could not be built; the message's first line says why (compiler missing, compile error)."""


@dataclasses.dataclass(frozen=True)
class Toolchain:
    """How this machine builds the kernels: the compiler, its kind, the ISA flags and the OpenMP flags (None:
    one thread, `openmp_hint` says how to get threads)."""

    cc: str
    kind: str  # "gcc", "clang" or "apple-clang"
    system: str  # uname -s: Linux, Darwin
    machine: str  # uname -m: x86_64, aarch64, arm64
    version: str
    arch_flags: tuple[str, ...]
    openmp_flags: tuple[str, ...] | None
    openmp_hint: str = ""

    @property
    def flags(self) -> list[str]:
        """Every flag of a build, the OpenMP link flags included."""
        extra = list(self.openmp_flags) if self.openmp_flags is not None else ["-Wno-unknown-pragmas"]
        if not self.arch_flags and self.machine in ("x86_64", "amd64"):
            # without AVX the compiler notes that 32-byte vectors would pass differently across calls: every v8 function
            # is static inline in one library, so no such call exists
            extra.append("-Wno-psabi")
        return [*FLAGS, *self.arch_flags, *extra]


def cache_dir() -> Path:
    root = os.environ.get("INFERENCE_LABS_CACHE") or Path.home() / ".cache" / "inference-labs"
    return Path(root) / "kernels"


def _run(cmd: list[str]) -> subprocess.CompletedProcess[str]:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    except OSError as e:
        return subprocess.CompletedProcess(cmd, 127, "", str(e))


def _uname() -> tuple[str, str]:
    u = os.uname()
    return u.sysname, u.machine


def find_compiler(which: Callable[[str], str | None] = shutil.which) -> str:
    """`$CC`, else the first of cc, gcc, clang on PATH. Raises BuildError."""
    wanted = os.environ.get("CC")
    for cc in [wanted] if wanted else ["cc", "gcc", "clang"]:
        if which(cc):
            return cc
    named = f"CC={wanted!r} is not" if wanted else "none of cc, gcc, clang is"
    raise BuildError(f"no C compiler: {named} on PATH (install clang or gcc, or set CC)")


def compiler_kind(version_text: str) -> str:
    """GCC, clang or Apple's clang, from `cc --version` (cc is often one of them under another name)."""
    first = version_text.splitlines()[0] if version_text else ""
    if "Apple" in first and "clang" in first:
        return "apple-clang"
    return "clang" if "clang" in first else "gcc"


def _torch_lib() -> Path | None:
    """torch's library folder (found, not imported: a build runs before or without torch)."""
    spec = importlib.util.find_spec("torch")
    return Path(spec.submodule_search_locations[0]) / "lib" if spec and spec.submodule_search_locations else None


def _libomp_dirs(system: str, exists: Callable[[str], bool]) -> list[tuple[str, str]]:
    """(include, lib) folders that hold libomp on macOS: torch's own copy first (then the process has one
    OpenMP runtime, not two), then Homebrew's."""
    if system != "Darwin":
        return []
    found = []
    torch_lib = _torch_lib()
    if torch_lib is not None and exists(str(torch_lib / "libomp.dylib")):
        found.append(("", str(torch_lib)))  # the kernels include no omp.h: the pragmas need only the library
    prefixes = [os.environ["HOMEBREW_PREFIX"]] if os.environ.get("HOMEBREW_PREFIX") else []
    for prefix in [*prefixes, *HOMEBREW_PREFIXES]:
        root = f"{prefix}/opt/libomp"
        if exists(f"{root}/lib/libomp.dylib"):
            found.append((f"{root}/include", f"{root}/lib"))
    return found


def _openmp_candidates(kind: str, system: str, exists: Callable[[str], bool]) -> list[tuple[str, ...]]:
    if kind != "apple-clang":
        return [("-fopenmp",)]  # GCC's libgomp; clang's libomp where its package is installed
    return [("-Xpreprocessor", "-fopenmp", *((f"-I{inc}",) if inc else ()), f"-L{lib}", "-lomp",
             f"-Wl,-rpath,{lib}") for inc, lib in _libomp_dirs(system, exists)]


def _openmp_hint(kind: str, system: str) -> str:
    if system == "Darwin":
        return "install Homebrew's libomp (`brew install libomp`) for threads"
    if kind == "clang":
        return "install libomp-dev (Debian: `apt-get install libomp-dev`) or build with GCC (CC=gcc) for threads"
    return "install GCC's libgomp for threads"


def _arch_flags(system: str, machine: str, portable: bool) -> tuple[str, ...]:
    if portable or system == "Darwin":  # Apple's clang targets the running Mac's generation by default
        return ()
    return ("-mcpu=native",) if machine in ("aarch64", "arm64") else ("-march=native",)


def _probe(cc: str, flags: list[str], run: Run) -> subprocess.CompletedProcess[str]:
    """Compile and link the probe as the library is built (a shared object) with `flags`."""
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "probe.c"
        src.write_text(_PROBE)
        return run([cc, *flags, str(src), "-o", str(Path(tmp) / "probe.so")])


def detect(portable: bool = False, openmp: bool = True, run: Run = _run,
           uname: Callable[[], tuple[str, str]] = _uname, which: Callable[[str], str | None] = shutil.which,
           exists: Callable[[str], bool] = os.path.exists) -> Toolchain:
    """This machine's toolchain. `portable`: no ISA flags (the path Linux on ARM and older x86 CPUs run);
    `openmp=False`: one thread even where OpenMP links. Raises BuildError when no compiler builds the probe.
    `run`, `uname`, `which`, `exists` are the machine's answers (tests fake them)."""
    cc = find_compiler(which)
    system, machine = uname()
    version = run([cc, "--version"]).stdout
    kind = compiler_kind(version)
    arch = _arch_flags(system, machine, portable)
    base = Toolchain(cc, kind, system, machine, version, arch, None, _openmp_hint(kind, system))
    result = _probe(cc, base.flags, run)
    if result.returncode != 0 and arch:  # e.g. a compiler without -mcpu=native: its default target
        base = Toolchain(cc, kind, system, machine, version, (), None, base.openmp_hint)
        result = _probe(cc, base.flags, run)
    if result.returncode != 0:
        reason = (result.stderr.strip().splitlines() or ["no output"])[-1]
        raise BuildError(f"no working C compiler: {cc} cannot build a shared library ({reason}); install clang or "
                         f"gcc, or set CC")
    for flags in _openmp_candidates(kind, system, exists) if openmp else []:
        with_omp = Toolchain(cc, kind, system, machine, version, base.arch_flags, flags)
        if _probe(cc, with_omp.flags, run).returncode == 0:
            return with_omp
    return base


def detected(portable: bool = False, openmp: bool = True) -> Toolchain:
    """`detect`'s answer, cached beside the libraries per compiler version, machine and option (the probes
    compile three small files; a process that loads the kernels pays for none of that again). A toolchain
    that wanted OpenMP and found none is not cached: the next process looks again (libomp installed since)."""
    cc = find_compiler()
    key = hashlib.sha256(repr((cc, shutil.which(cc), _run([cc, "--version"]).stdout, _uname(), portable, openmp,
                               os.environ.get("HOMEBREW_PREFIX"))).encode()).hexdigest()[:16]
    path = cache_dir() / f"toolchain-{key}.json"
    try:
        fields = json.loads(path.read_text())
        return Toolchain(**{**fields, "arch_flags": tuple(fields["arch_flags"]),
                            "openmp_flags": None if fields["openmp_flags"] is None else tuple(fields["openmp_flags"])})
    except (OSError, ValueError, TypeError, KeyError):
        pass
    tc = detect(portable=portable, openmp=openmp)
    if openmp and tc.openmp_flags is None:
        return tc
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".json", dir=path.parent)
    with os.fdopen(fd, "w") as f:
        json.dump(dataclasses.asdict(tc), f)
    os.replace(tmp, path)
    return tc


def library_path(tc: Toolchain, extra_flags: tuple[str, ...] = ()) -> Path:
    """Where the library for these sources, flags, compiler and CPU lives."""
    h = hashlib.sha256()
    for src in sorted(CSRC.iterdir()):  # sources and headers
        h.update(src.name.encode() + src.read_bytes())
    h.update(" ".join([tc.cc, *tc.flags, *extra_flags]).encode())
    h.update(tc.version.encode())
    h.update(_cpu_flags().encode())
    return cache_dir() / f"cpu-kernels-{h.hexdigest()[:16]}.so"


def compile_command(tc: Toolchain, output: str, extra_flags: tuple[str, ...] = ()) -> list[str]:
    """The compiler call that builds every csrc/*.c into `output`."""
    return [tc.cc, *tc.flags, *extra_flags, *map(str, sorted(CSRC.glob("*.c"))), "-o", output, "-lm"]


def build(extra_flags: tuple[str, ...] = (), portable: bool = False, openmp: bool = True,
          toolchain: Toolchain | None = None) -> Path:
    """The cached library's path, compiling it first if needed. Raises BuildError. `extra_flags` go after the
    toolchain's (tests build the portable paths of a kernel with e.g. `-mno-avx512vnni`); `portable` and
    `openmp` as in `detect`, or a `toolchain` detected before."""
    tc = toolchain or detected(portable=portable, openmp=openmp)
    target = library_path(tc, extra_flags)
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process may be building the same file
        if target.is_file():
            return target
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
        os.close(fd)
        cmd = compile_command(tc, tmp, extra_flags)
        result = subprocess.run(cmd, capture_output=True, text=True)
        if result.returncode != 0:
            os.unlink(tmp)
            raise BuildError(f"{tc.cc} failed to compile the C kernels (`{' '.join(cmd)}`):\n{result.stderr.strip()}")
        os.replace(tmp, target)
    return target


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        return ""
