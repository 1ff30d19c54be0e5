"""The vocabulary of `make gpu-compile` (benchmarks/gpu_compile.py): the GPU targets, and a kernel case, one
launch specialization per target (benchmarks/gpu_kernels.py holds the kit's cases)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

KIB = 1024


@dataclass(frozen=True)
class Target:
    """A GPU generation: compute capability (major * 10 + minor), examples, max shared memory per block
    (the opt-in limit, CUDA C++ Programming Guide, "Technical Specifications per Compute Capability")."""

    cap: int
    gpus: str
    smem_per_block: int

    @property
    def name(self) -> str:
        return f"sm_{self.cap}"


TARGETS = (
    Target(75, "T4, RTX 20xx", 64 * KIB),
    Target(80, "A100, A30", 163 * KIB),
    Target(86, "A10G, RTX 30xx", 99 * KIB),
    Target(89, "L4, RTX 40xx", 99 * KIB),
    Target(90, "H100, H200", 227 * KIB),
    Target(100, "B200", 227 * KIB),  # newer targets the pinned triton (3.7.1) compiles for
    Target(120, "RTX 50xx", 99 * KIB),
)


@dataclass(frozen=True)
class Launch:
    """One specialization as a launcher passes it: argument types (`*bf16`, `fp32`, ...; an argument not
    named is an i32 size or stride), constexprs, launch options. Like the runtime JIT for fresh allocations,
    pointers and i32 arguments are taken as divisible by 16, except those in `unaligned`."""

    fn: object  # a triton.JITFunction
    types: dict[str, str]
    constexprs: dict[str, object]
    num_warps: int = 4
    num_stages: int = 1
    unaligned: frozenset[str] = frozenset()
    note: str = ""  # shown in the cell (which variant this target gets)


@dataclass(frozen=True)
class Case:
    """A row: `launch(cap)` is what the engine (or a lab) launches on a GPU of that capability, or a string,
    the engine's reason for refusing it there before launch. `max_registers`: the budget per thread."""

    name: str
    max_registers: int
    launch: Callable[[int], Launch | str]
    known: dict[int, str] = field(default_factory=dict)  # cap -> why this case is an open failure there
