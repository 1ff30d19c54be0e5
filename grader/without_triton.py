"""The kit where triton is not installed (macOS, Windows: triton publishes Linux wheels only).

The Triton tasks (tests marked `triton`) skip with `REASON`, which `grader.check`, `pytest labs/NN` and the
batch summary print with the routes; every other task still grades. A lab notebook's setup cell takes
`triton`, `tl` and `knobs` from here when `import triton` fails, so its cells still define every name: a
`@triton.jit` kernel becomes a `MissingKernel` that raises `TritonMissing` (with the routes) when launched.
"""
from __future__ import annotations

import importlib.util
import types
from typing import Any

REASON = "not gradable on this machine: Triton needs Linux"
ROUTES = ("triton publishes Linux wheels only. Do this task on a Linux machine or in a Linux container "
          "(`make lab` there), or in a hosted GPU notebook: docs/hosted.md")
MARKER = "triton"


def triton_installed() -> bool:
    """Whether `import triton` can work here (without importing it: importing fixes the interpreter choice)."""
    return importlib.util.find_spec("triton") is not None


def is_triton_skip(message: str) -> bool:
    """Whether a skipped test's message is this module's reason."""
    return REASON in message


class TritonMissing(ModuleNotFoundError):
    """A Triton kernel was launched on a machine without triton."""

    def __init__(self, what: str = "this Triton kernel") -> None:
        super().__init__(f"{what} cannot run: {REASON}. {ROUTES}", name="triton")

    def _render_traceback_(self) -> list[str]:
        """IPython shows this one line in a notebook instead of a traceback into the stand-in."""
        return [f"TritonMissing: {self}"]


class MissingKernel:
    """What `@triton.jit` gives without triton: the function, kept for reading, that raises when launched."""

    def __init__(self, fn: Any) -> None:
        self.fn = fn
        self.__name__ = getattr(fn, "__name__", "kernel")
        self.__doc__ = getattr(fn, "__doc__", None)

    def __getitem__(self, grid: Any) -> Any:
        raise TritonMissing(f"the Triton kernel `{self.__name__}`")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise TritonMissing(f"the Triton kernel `{self.__name__}`")


def _jit(fn: Any = None, **_options: Any) -> Any:
    """`@triton.jit` and `@triton.jit(...)`."""
    return MissingKernel(fn) if fn is not None else MissingKernel


def _next_power_of_2(n: int) -> int:
    return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class _Language(types.ModuleType):
    """`triton.language`: any name (tl.constexpr in a signature, tl.float32 ...) is a placeholder."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return type(name, (), {"__doc__": f"tl.{name}: a placeholder (triton is not installed)"})


triton = types.ModuleType("triton", "A stand-in for triton where it is not installed (grader/without_triton.py).")
triton.__version__ = "not installed (Linux only)"
triton.jit = _jit
triton.next_power_of_2 = _next_power_of_2
triton.cdiv = _cdiv
tl = _Language("triton.language")
triton.language = tl
knobs = types.SimpleNamespace(runtime=types.SimpleNamespace(interpret=False))
triton.knobs = knobs
