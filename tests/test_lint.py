"""The code passes `ruff check` with the project's configuration ([tool.ruff] in pyproject.toml:
pyflakes and syntax errors), so an unused import or an undefined name fails the suite, not a review."""
from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CHECKED = ("engine_core", "kernels", "grader", "benchmarks", "examples", "tests")


def ruff_check(*paths: str, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", *paths], cwd=cwd, capture_output=True,
                          text=True, timeout=120)


def test_the_code_passes_ruff() -> None:
    result = ruff_check(*CHECKED)
    assert result.returncode == 0, f"ruff check {' '.join(CHECKED)}:\n{result.stdout}{result.stderr}"


def test_the_configuration_catches_an_unused_import_and_an_undefined_name(tmp_path: Path) -> None:
    """The same configuration on a planted file: the check above can fail."""
    (tmp_path / "pyproject.toml").write_text((ROOT / "pyproject.toml").read_text())
    (tmp_path / "planted.py").write_text(textwrap.dedent("""\
        import os


        def f():
            return undefined_name
        """))
    result = ruff_check("planted.py", cwd=tmp_path)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "F401" in result.stdout and "F821" in result.stdout, result.stdout
