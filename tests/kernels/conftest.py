"""Kernel tests run the Triton kernels on CUDA where there is a GPU and under the Triton
interpreter on CPU otherwise (tests/conftest.py chooses, before anything imports triton)."""
from __future__ import annotations

import os
import random

import pytest
import torch


@pytest.fixture
def seed() -> int:
    """A fresh seed per test, printed (pytest shows it on failure); KERNEL_TEST_SEED reproduces one."""
    value = int(os.environ.get("KERNEL_TEST_SEED", random.SystemRandom().randrange(2**31)))
    print(f"kernel test seed {value} (rerun with KERNEL_TEST_SEED={value})")
    return value


@pytest.fixture
def device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.fixture
def poison_allocations(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every float buffer a kernel launcher allocates starts as NaN, so a row, head or split
    the kernel forgets to write shows up as NaN in the result."""
    empty, empty_like = torch.empty, torch.empty_like

    def poisoned(x: torch.Tensor) -> torch.Tensor:
        return x.fill_(float("nan")) if x.is_floating_point() else x

    monkeypatch.setattr(torch, "empty", lambda *a, **k: poisoned(empty(*a, **k)))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **k: poisoned(empty_like(*a, **k)))
