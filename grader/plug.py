"""The one way lab tests put the learner's functions into the engine: `with plug(student, lab) as p:`.

Inside the block the engine's seams of `lab` (grader/seams.py) are the learner's functions,
wrapped to count their calls (`p.calls`), and the engine's own functions of those seams and
their helpers are tripwired (grader/delegation.py): any call of them, through a reference the
learner captured or imported, raises DelegationError, and so does leaving the block after one
was caught and swallowed. Everything is restored on exit. So a test computes reference values
with the engine *outside* the block, never inside.
"""
from __future__ import annotations

import contextlib
import functools
import os
import sys
from dataclasses import dataclass, field
from types import ModuleType, TracebackType
from typing import Any, Callable, Iterable, Iterator

from grader import delegation
from grader.seams import Seam, current, fused_block_switch, resolve, seams_of
from grader.without_triton import triton_installed

ENGINE_PACKAGES = ("engine_core", "kernels")


@dataclass
class PlugRecord:
    """One finished `plug` block: which test, which seams were plugged, how often each was called."""

    test: str
    lab: str
    calls: dict[str, int]


PLUG_LOG: list[PlugRecord] = []  # every finished block in this process (the meta-test reads it)


@dataclass
class Plugged:
    """What a test sees of its plug: calls of each plugged function through the engine."""

    lab: str
    calls: dict[str, int] = field(default_factory=dict)

    def uncalled(self) -> list[str]:
        """The plugged functions the engine never called (an end-to-end test expects none)."""
        return sorted(name for name, n in self.calls.items() if n == 0)


def _counted(fn: Callable, seam: Seam, calls: dict[str, int]) -> Callable:
    """The learner's function as plugged: counts calls, and refuses to be re-entered (the learner's
    function calling the engine's seam by name reaches itself while graded, the answer otherwise)."""
    name, active = seam.student_name, [False]

    @functools.wraps(fn)
    def counted(*args: Any, **kwargs: Any) -> Any:
        __tracebackhide__ = True
        if active[0]:
            raise delegation.DelegationError(
                f"{delegation.VERDICT}: your `{name}` calls the engine's {seam.qualname}, which is your own function "
                f"while it is graded and the engine's implementation otherwise. {delegation.SCORES_ZERO}")
        calls[name] += 1
        active[0] = True
        try:
            return fn(*args, **kwargs)
        finally:
            active[0] = False

    counted.__grader_plugged__ = True
    return counted


def _current_test() -> str:
    """The running pytest test's name (pytest sets PYTEST_CURRENT_TEST), or ""."""
    node = os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" ", 1)[0]
    return node.rsplit("::", 1)[-1]


class plug:  # noqa: N801 - used like a function: `with plug(student, lab):`
    """Plugs the learner's functions into `lab`'s seams for the duration of a `with` block.

    `only`: the student names to plug (default: every seam of the lab). Seams left out keep
    the engine's function, tripwired: a test must never reach them. `overrides`: student name ->
    a function to plug instead of the learner's (a test's wrapper around it).
    """

    def __init__(self, student: ModuleType | Any, lab: str, only: Iterable[str] | None = None,
                 overrides: dict[str, Callable] | None = None) -> None:
        # without triton the Triton backend's seams cannot be imported, nor called (their tests skip)
        self.seams: tuple[Seam, ...] = tuple(s for s in seams_of(lab)
                                             if triton_installed() or not s.owner.startswith("kernels.triton"))
        names = [s.student_name for s in self.seams]
        self.only = list(names if only is None else only)
        unknown = [n for n in [*self.only, *(overrides or {})] if n not in names]
        if unknown:
            raise ValueError(f"plug: {unknown} are not seams of lab {lab}; its seams are {names}")
        self.student, self.lab, self.overrides = student, lab, dict(overrides or {})
        self.plugged = Plugged(lab)
        self.wires = delegation.Tripwires()
        self.restore: list[tuple[Any, str, Any]] = []  # (holder, attribute, old value)
        self.originals: dict[Seam, Any] = {}

    def __enter__(self) -> Plugged:
        __tracebackhide__ = True
        verdict = delegation.source_verdict(self.student)
        if verdict:
            raise delegation.DelegationError(verdict)
        chosen = [s for s in self.seams if s.student_name in self.only]
        functions = {s.student_name: self.overrides.get(s.student_name) or getattr(self.student, s.student_name)
                     for s in chosen}  # a missing name raises StudentCodeError here, before anything changes
        originals = self.originals = {s: current(s) for s in self.seams}
        nested = [s.qualname for s, fn in originals.items() if getattr(fn, "__grader_plugged__", False)]
        if nested:
            raise RuntimeError(f"plug: {nested} are plugged already (one plug of a lab at a time)")
        try:
            for seam in chosen:
                name = seam.student_name
                self.plugged.calls[name] = 0
                self._replace(seam, originals[seam], _counted(functions[name], seam, self.plugged.calls))
            if switch := fused_block_switch(chosen):  # the fused block would bypass the learner's functions
                self.restore.append((*switch, getattr(*switch)))
                setattr(*switch, False)
            self._arm(originals)
        except BaseException:
            self._undo()
            raise
        delegation.activate(self.wires)
        return self.plugged

    def _arm(self, originals: dict[Seam, Any]) -> None:
        for seam in self.seams:
            delegation.arm(self.wires, originals[seam], f"the engine's own {seam.qualname} (lab {self.lab}'s "
                                                        f"seam `{seam.student_name}`)")
            for helper in seam.helpers:
                delegation.arm(self.wires, resolve(helper), f"the engine's {helper.rsplit('.', 2)[-2]}."
                               f"{helper.rsplit('.', 1)[-1]}, which holds the answer to `{seam.student_name}`")

    @contextlib.contextmanager
    def suspended(self) -> Iterator[None]:
        """The engine's own functions work again inside this block (the learner's stay plugged): only for
        a test that must run the reference while plugged, as a throughput test timing both in turn."""
        delegation.disarm(self.wires)
        try:
            yield
        finally:
            self._arm(self.originals)

    def _replace(self, seam: Seam, original: Any, new: Callable) -> None:
        owner = resolve(seam.owner)
        holders = [owner]
        if isinstance(owner, ModuleType):  # `from module import fn` elsewhere in the engine holds its own name
            holders += [m for name, m in list(sys.modules.items())
                        if m is not owner and name.split(".")[0] in ENGINE_PACKAGES
                        and getattr(m, seam.attr, None) is original]
        for holder in holders:
            self.restore.append((holder, seam.attr, original))
            setattr(holder, seam.attr, new)

    def _undo(self) -> None:
        delegation.deactivate(self.wires)
        delegation.disarm(self.wires)
        for holder, attr, old in reversed(self.restore):
            setattr(holder, attr, old)
        self.restore.clear()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> bool:
        __tracebackhide__ = True
        self._undo()
        PLUG_LOG.append(PlugRecord(_current_test(), self.lab, dict(self.plugged.calls)))
        if self.wires.trips and not isinstance(exc, delegation.DelegationError):
            raise delegation.DelegationError(self.wires.trips[0]) from exc
        return False
