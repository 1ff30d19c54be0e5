"""`make labs`: regenerates the learner release `labs/NN_name/` from `solutions/NN_name/` with nbgrader."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from grader.labs import REPO_ROOT

LAB_GLOB = "[0-9][0-9]_*"  # nbgrader expands it over solutions/: every lab folder, nothing else


def regenerate(release_dir: Path | None = None) -> None:
    """Writes every lab's release notebook into `release_dir` (default: labs/), replacing old ones.

    Runs `nbgrader generate_assignment` from the repo root so nbgrader_config.py applies;
    `--no-db` because a release needs no gradebook.
    """
    args = [sys.executable, "-m", "nbgrader", "generate_assignment", LAB_GLOB, "--force", "--no-db"]
    if release_dir is not None:
        args.append(f"--CourseDirectory.release_directory={Path(release_dir).resolve()}")
    done = subprocess.run(args, cwd=REPO_ROOT, capture_output=True, text=True, env={**os.environ})
    if done.returncode != 0:
        raise RuntimeError(f"nbgrader generate_assignment failed:\n{done.stdout}\n{done.stderr}")


def solution_labs() -> list[str]:
    """Lab folders in solutions/ that hold their notebook."""
    root = REPO_ROOT / "solutions"
    return sorted(p.name for p in root.glob(LAB_GLOB) if (p / f"{p.name}.ipynb").is_file())
