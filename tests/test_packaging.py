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
