"""The engine's threading contract, checked instead of assumed.

An LLMEngine is single-threaded: one caller drives it. Two threads stepping it would each take
the other's finished outputs (each then waits forever for outputs it will never see), and a step
re-entered from inside a step (a callback, a hook on the model) would run on half-updated state.
So every state-changing call enters a `ThreadGuard` and a second caller gets an EngineBusyError
at once, naming both, instead of a deadlock or a corrupted engine:

- `session(what)`: one caller across many calls (`LLM.generate` holds one for its whole loop);
  a second session, from any thread, is refused.
- `call(what)`: one operation (`step`, `add_request`); allowed only in the session holder's
  thread (or with no session), and never inside another call.

`abort_request` is the exception: it may come from any thread (a watchdog, a request handler);
when the engine is busy it is queued for the next step boundary (`guarded(..., when_busy=...)`).
"""
from __future__ import annotations

import functools
import threading
from contextlib import contextmanager
from typing import Any, Callable, Iterator, TypeVar

from engine_core.interrupts import sigint_deferred

Method = TypeVar("Method", bound=Callable[..., Any])


class EngineBusyError(RuntimeError):
    """The engine is in use by another thread, or was re-entered from inside its own step."""


class ThreadGuard:
    def __init__(self) -> None:
        self._mutex = threading.Lock()  # held only while the two slots below are read or written
        self._session: tuple[int, str] | None = None  # (thread id, what) across calls
        self._call: tuple[int, str] | None = None  # (thread id, what) running now

    def _refusal(self, what: str) -> str | None:
        """Why `what` may not run now (another thread holds the engine, or a call is running in this
        one), or None."""
        me = threading.get_ident()
        for holder in (self._session, self._call):
            if holder is not None and holder[0] != me:
                return (f"{what} called from thread {me} while thread {holder[0]} is in {holder[1]}: the engine is "
                        f"single-threaded (use one engine per thread, or one thread that drives it)")
        if self._call is not None:
            return f"{what} called from inside {self._call[1]} (re-entered from a callback or hook during a step?)"
        return None

    @contextmanager
    def session(self, what: str) -> Iterator[None]:
        with self._mutex:
            refusal = self._refusal(what)
            if refusal is None and self._session is not None:  # held by this thread
                refusal = (f"{what} called while {self._session[1]} is running in this thread: the engine "
                           f"serves one caller at a time (pass all prompts to one call)")
            if refusal is not None:
                raise EngineBusyError(refusal)
            self._session = (threading.get_ident(), what)
        try:
            yield
        finally:
            self._session = None

    @contextmanager
    def call(self, what: str, defer_if_busy: bool = False) -> Iterator[bool]:
        """One operation: yields True once entered; when the engine is busy raises EngineBusyError,
        or with `defer_if_busy` yields False (the caller defers its work, it does not block)."""
        with self._mutex:
            refusal = self._refusal(what)
            if refusal is None:
                self._call = (threading.get_ident(), what)
        if refusal is not None and not defer_if_busy:
            raise EngineBusyError(refusal)
        try:
            yield refusal is None
        finally:
            if refusal is None:
                self._call = None


def guarded(what: str, when_busy: Callable[..., None] | None = None) -> Callable[[Method], Method]:
    """Decorate a method of an object with a `guard` (ThreadGuard): each call is one `call(what)`
    with Ctrl-C held until it returns (engine_core.interrupts). When the engine is busy a second
    caller gets EngineBusyError, or, given `when_busy`, that runs instead with the same arguments."""
    def wrap(method: Method) -> Method:
        @functools.wraps(method)
        def run(self: Any, *args: Any, **kwargs: Any) -> Any:
            with sigint_deferred(), self.guard.call(what, defer_if_busy=when_busy is not None) as entered:
                return method(self, *args, **kwargs) if entered else when_busy(self, *args, **kwargs)
        return run  # type: ignore[return-value]
    return wrap


def guarded_session(what: str) -> Callable[[Method], Method]:
    """Decorate a method of an object with a `guard` (ThreadGuard): the whole call is one
    `session(what)`, so other threads cannot step the engine until it returns."""
    def wrap(method: Method) -> Method:
        @functools.wraps(method)
        def run(self: Any, *args: Any, **kwargs: Any) -> Any:
            with self.guard.session(what):
                return method(self, *args, **kwargs)
        return run  # type: ignore[return-value]
    return wrap
