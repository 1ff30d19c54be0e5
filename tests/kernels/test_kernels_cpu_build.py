"""kernels.cpu.build: the compiler, ISA and OpenMP detection on machines this project has none of (macOS on
Apple Silicon with and without Homebrew's libomp, Linux on ARM, no compiler), from faked `uname`, `--version`
and compile answers; the notices `load()` gives; and the portable path cross-compiled for aarch64 with
Debian's cross compiler, warnings as errors."""
from __future__ import annotations

import importlib
import shutil
import subprocess
import warnings
from pathlib import Path

import pytest

from kernels import cpu
from kernels.cpu.build import BuildError, Toolchain, build, compile_command, detect

APPLE_CLANG = "Apple clang version 15.0.0 (clang-1500.3.9.4)\nTarget: arm64-apple-darwin23.4.0\n"
DEBIAN_GCC = "aarch64-linux-gnu-gcc (Debian 12.2.0-14) 12.2.0\nCopyright (C) 2022 Free Software Foundation, Inc.\n"
DEBIAN_CLANG = "Debian clang version 14.0.6\nTarget: x86_64-pc-linux-gnu\n"
BREW_LIBOMP = "/opt/homebrew/opt/libomp"


class FakeMachine:
    """A compiler's answers: `--version` gives `version`; a compile succeeds unless it asks for something in
    `refuse` (a flag this compiler lacks) or links `-lomp` from a folder that is not in `files`."""

    def __init__(self, version: str, files: tuple[str, ...] = (), refuse: tuple[str, ...] = ()) -> None:
        self.version, self.files, self.refuse, self.calls = version, set(files), refuse, []

    def run(self, cmd: list[str]) -> subprocess.CompletedProcess[str]:
        self.calls.append(cmd)
        if "--version" in cmd:
            return subprocess.CompletedProcess(cmd, 0, self.version, "")
        lib_dirs = [f[2:] for f in cmd if f.startswith("-L")]
        bad = [f for f in cmd if f in self.refuse]
        if "-lomp" in cmd and not any(f"{d}/libomp.dylib" in self.files for d in lib_dirs):
            bad.append("-lomp")
        return subprocess.CompletedProcess(cmd, 1 if bad else 0, "", f"error: {bad}" if bad else "")

    def exists(self, path: str) -> bool:
        return path in self.files


def _detect(machine: FakeMachine, uname: tuple[str, str], monkeypatch: pytest.MonkeyPatch, cc: str = "cc",
            **kw: bool) -> Toolchain:
    monkeypatch.delenv("CC", raising=False)
    monkeypatch.delenv("HOMEBREW_PREFIX", raising=False)
    return detect(run=machine.run, uname=lambda: uname, which=lambda name: f"/usr/bin/{name}" if name == cc else None,
                  exists=machine.exists, **kw)


def test_a_mac_with_homebrews_libomp_gets_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    mac = FakeMachine(APPLE_CLANG, files=(f"{BREW_LIBOMP}/lib/libomp.dylib",))
    tc = _detect(mac, ("Darwin", "arm64"), monkeypatch)
    assert tc.kind == "apple-clang" and tc.arch_flags == ()  # Apple's clang targets the Mac it runs on
    assert tc.openmp_flags == ("-Xpreprocessor", "-fopenmp", f"-I{BREW_LIBOMP}/include", f"-L{BREW_LIBOMP}/lib",
                               "-lomp", f"-Wl,-rpath,{BREW_LIBOMP}/lib")
    assert "-march=native" not in tc.flags and "-Wno-unknown-pragmas" not in tc.flags


def test_a_mac_without_libomp_runs_on_one_thread_and_says_how_to_get_threads(monkeypatch) -> None:
    tc = _detect(FakeMachine(APPLE_CLANG), ("Darwin", "arm64"), monkeypatch)
    assert tc.kind == "apple-clang" and tc.openmp_flags is None
    assert "brew install libomp" in tc.openmp_hint
    assert "-Wno-unknown-pragmas" in tc.flags and not any("openmp" in f for f in tc.flags)


def test_linux_on_arm_builds_for_its_own_cpu_with_gcc_openmp(monkeypatch: pytest.MonkeyPatch) -> None:
    tc = _detect(FakeMachine(DEBIAN_GCC), ("Linux", "aarch64"), monkeypatch, cc="gcc")
    assert (tc.cc, tc.kind, tc.arch_flags, tc.openmp_flags) == ("gcc", "gcc", ("-mcpu=native",), ("-fopenmp",))
    assert _detect(FakeMachine(DEBIAN_GCC), ("Linux", "aarch64"), monkeypatch, portable=True).arch_flags == ()


def test_a_compiler_without_native_tuning_gets_its_default_target(monkeypatch: pytest.MonkeyPatch) -> None:
    tc = _detect(FakeMachine(DEBIAN_GCC, refuse=("-mcpu=native",)), ("Linux", "aarch64"), monkeypatch)
    assert tc.arch_flags == () and tc.openmp_flags == ("-fopenmp",)


def test_clang_without_libomp_on_linux_runs_on_one_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    tc = _detect(FakeMachine(DEBIAN_CLANG, refuse=("-fopenmp",)), ("Linux", "x86_64"), monkeypatch, cc="clang")
    assert (tc.kind, tc.arch_flags, tc.openmp_flags) == ("clang", ("-march=native",), None)
    assert "libomp-dev" in tc.openmp_hint and "CC=gcc" in tc.openmp_hint


def test_no_compiler_is_a_build_error_that_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(BuildError, match="none of cc, gcc, clang is on PATH .install clang or gcc"):
        _detect(FakeMachine(APPLE_CLANG), ("Darwin", "arm64"), monkeypatch, cc="nothing")
    monkeypatch.setenv("CC", "no-such-cc")
    with pytest.raises(BuildError, match="CC='no-such-cc' is not on PATH"):
        detect(which=lambda name: None)


def test_a_compiler_that_cannot_build_a_library_is_no_compiler(monkeypatch: pytest.MonkeyPatch) -> None:
    """Xcode's command line tools not installed: `cc` exists but every compile fails."""
    broken = FakeMachine(APPLE_CLANG, refuse=("-shared",))
    with pytest.raises(BuildError, match="no working C compiler: cc cannot build a shared library"):
        _detect(broken, ("Darwin", "arm64"), monkeypatch)


def test_the_one_thread_build_is_said_once_in_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    """`load()` with a toolchain without OpenMP (the real library stands in for the Mac's)."""
    mac = Toolchain("cc", "apple-clang", "Darwin", "arm64", APPLE_CLANG, (), None, "install Homebrew's libomp "
                    "(`brew install libomp`) for threads")
    monkeypatch.setattr(cpu, "_lib", None)
    monkeypatch.setattr(cpu, "detected", lambda: mac)
    monkeypatch.setattr(cpu, "build", lambda toolchain: build())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert cpu.load() is not None and cpu.load() is not None
    assert len(caught) == 1, [str(w.message) for w in caught]
    message = str(caught[0].message)
    assert "\n" not in message and "one thread" in message and "brew install libomp" in message


def test_a_failed_build_is_one_line_and_the_reference_ops_run(monkeypatch: pytest.MonkeyPatch) -> None:
    def fail(toolchain: Toolchain) -> Path:
        raise BuildError("cc failed to compile the C kernels (`cc ...`):\nerror: one\nerror: two")

    monkeypatch.setattr(cpu, "_lib", None)
    monkeypatch.setattr(cpu, "_load_error", None)
    monkeypatch.setattr(cpu, "build", fail)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert cpu.load() is None
    assert [str(w.message) for w in caught] == ["kernels.cpu: the C kernels are unavailable, CPU tensors use the "
                                                "slower PyTorch reference ops: cc failed to compile the C kernels "
                                                "(`cc ...`):"]
    assert "error: two" in cpu.load_error()


def test_the_portable_build_has_no_vector_extension_beyond_the_baseline() -> None:
    """Forcing the portable path on x86 really compiles it: no AVX macro is defined under its flags, so every
    `#ifdef __AVX...` branch is out and the kernels are the generic vector code ARM runs."""
    tc = detect(portable=True, openmp=False)
    if tc.machine not in ("x86_64", "amd64"):
        pytest.skip(f"the x86 baseline check needs an x86 machine, this is {tc.machine}")
    macros = subprocess.run([tc.cc, *tc.flags, "-dM", "-E", "-x", "c", "/dev/null"], capture_output=True, text=True,
                            check=True).stdout
    assert "__SSE2__" in macros and "__AVX__" not in macros and "__AVX512F__" not in macros


def test_the_portable_path_cross_compiles_for_aarch64_without_a_warning(monkeypatch, tmp_path) -> None:
    """Linux on ARM's build, made here by Debian's cross compiler (.ci/run installs gcc-aarch64-linux-gnu) with
    the flags `detect` picks for an aarch64 machine, -Wall -Werror: an ELF for aarch64 (e_machine 183)."""
    cross = "aarch64-linux-gnu-gcc"
    if shutil.which(cross) is None:
        pytest.skip(f"{cross} is not installed (Debian's gcc-aarch64-linux-gnu; .ci/run installs it)")
    monkeypatch.setenv("CC", cross)
    tc = detect(portable=True, uname=lambda: ("Linux", "aarch64"))
    assert tc.kind == "gcc" and tc.arch_flags == () and tc.openmp_flags == ("-fopenmp",) and "-Werror" in tc.flags
    out = tmp_path / "kernels-aarch64.so"
    result = subprocess.run(compile_command(tc, str(out)), capture_output=True, text=True)
    assert result.returncode == 0 and result.stderr == "", result.stderr
    header = out.read_bytes()[:20]
    assert header[:4] == b"\x7fELF" and int.from_bytes(header[18:20], "little") == 183


@pytest.mark.parametrize("openmp_flags", [("-fopenmp",), None], ids=["openmp", "none"])
def test_a_toolchain_is_cached_unless_it_lacks_the_openmp_it_wanted(monkeypatch, tmp_path, openmp_flags) -> None:
    """Detection runs once per compiler and machine; a toolchain without OpenMP is looked for again in the next
    process, so `brew install libomp` takes effect without clearing a cache."""
    build_module = importlib.import_module("kernels.cpu.build")  # `kernels.cpu.build` is also the function
    found = Toolchain("cc", "gcc", "Linux", "x86_64", "gcc 12", ("-march=native",), openmp_flags)
    calls = []
    monkeypatch.setenv("INFERENCE_LABS_CACHE", str(tmp_path))
    monkeypatch.setattr(build_module, "detect", lambda **kw: calls.append(kw) or found)
    assert build_module.detected() == found and build_module.detected() == found
    assert len(calls) == (1 if openmp_flags else 2)


def test_a_mac_links_torchs_own_libomp_first(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch's macOS wheels carry a libomp: linking that one keeps one OpenMP runtime in the process (two abort
    with OMP error #15); Homebrew's is the second choice."""
    torch_lib = importlib.import_module("kernels.cpu.build")._torch_lib()
    mac = FakeMachine(APPLE_CLANG, files=(f"{torch_lib}/libomp.dylib", f"{BREW_LIBOMP}/lib/libomp.dylib"))
    tc = _detect(mac, ("Darwin", "arm64"), monkeypatch)
    assert tc.openmp_flags == ("-Xpreprocessor", "-fopenmp", f"-L{torch_lib}", "-lomp", f"-Wl,-rpath,{torch_lib}")
