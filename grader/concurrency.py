"""Bounded waits for tests of learner code that runs its own threads (lab 17's coding round).

A test never blocks on the learner's code without a deadline: every call that may block runs in a daemon
thread joined with a timeout, and a wait that runs out fails with `Deadlock`, whose text holds each
thread's stack (where the step thread and the request threads stood), so a lost wake-up or a lock-order
deadlock is reported as a failure within the per-test limit, never as a hang. CPU time is read per thread
(`pthread_getcpuclockid`): an idle thread's CPU time stays ~0 however loaded the machine is, where wall
time would not.
"""
from __future__ import annotations

import contextlib
import sys
import threading
import time
import traceback
import weakref
from typing import Any, Callable, Iterable, Iterator


class Deadlock(AssertionError):
    """A bounded wait on the learner's code ran out: a deadlock, a lost wake-up or a thread that died."""


def thread_stacks(skip: Iterable[int] = ()) -> str:
    """Every live thread's name and stack, innermost frame last (the test's own harness threads left out)."""
    names = {t.ident: f"{t.name}{' (daemon)' if t.daemon else ''}" for t in threading.enumerate()}
    skipped = {threading.get_ident(), *skip}
    parts = []
    for ident, frame in sys._current_frames().items():
        if ident in skipped:
            continue
        stack = "".join(traceback.format_stack(frame)[-6:])
        parts.append(f"--- thread {names.get(ident, ident)}:\n{stack}")
    return "\n".join(parts)


_died: list[str] = []  # threads of the current watched test ended by an exception, one line each
_quiet: weakref.WeakSet[threading.Thread] = weakref.WeakSet()  # threads left running by earlier watched tests
_watched_since: set[threading.Thread] | None = None  # the threads alive when the current watched test began
_delegate: Callable[[threading.ExceptHookArgs], Any] | None = None  # the hook other threads' deaths go to


def _record_death(args: threading.ExceptHookArgs) -> None:
    thread = args.thread
    ours = thread is not None and (thread in _quiet or (_watched_since is not None and thread not in _watched_since))
    if not ours:
        (_delegate or threading.__excepthook__)(args)
    elif args.exc_type is not SystemExit:
        _died.append(f"{thread.name} died: {args.exc_type.__name__}: {args.exc_value}")


@contextlib.contextmanager
def watch_threads() -> Iterator[list[str]]:
    """While inside, a thread started inside that ends by an exception is recorded in the yielded list (and named
    in any `Deadlock`) instead of reported by the hook in place, and so is one left running that dies later.

    Why: pytest's hook (and Python's default one) format the traceback in the dying thread, and Python 3.11's
    traceback carets run `ast.parse`, which is not thread-safe: a learner's thread dying while the main thread
    parsed raised SystemError there and stopped the pytest session. The hook stays installed after the block
    (a leftover thread may die any time); every other thread's death goes to the hook it replaced."""
    global _delegate, _watched_since
    if threading.excepthook is not _record_death:
        _delegate, threading.excepthook = threading.excepthook, _record_death
    _died.clear()
    _watched_since = set(threading.enumerate())
    try:
        yield _died
    finally:
        _quiet.update(t for t in threading.enumerate() if t not in _watched_since)
        _watched_since = None


def _deadlock(what: str, timeout: float, skip: Iterable[int] = ()) -> Deadlock:
    died = "".join(f"\n{line}" for line in _died[:5])
    return Deadlock(f"{what}: still blocked after {timeout:g} s (a deadlock or a lost wake-up?).{died}\n"
                    f"Each thread's stack:\n{thread_stacks(skip)}")


def run_bounded(fn: Callable[..., Any], *args: Any, timeout: float, what: str) -> Any:
    """`fn(*args)` in a daemon thread: its result, its exception re-raised, or `Deadlock` after `timeout` s."""
    outcome: dict[str, Any] = {}

    def target() -> None:
        try:
            outcome["value"] = fn(*args)
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread
            outcome["error"] = exc

    worker = threading.Thread(target=target, name=f"grader: {what}", daemon=True)
    worker.start()
    worker.join(timeout)
    if worker.is_alive():
        raise _deadlock(what, timeout)
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


def wait_for(event: threading.Event, timeout: float, what: str) -> None:
    """Waits for `event`; `Deadlock` with every thread's stack if it is not set within `timeout` s."""
    if not event.wait(timeout):
        raise _deadlock(what, timeout)


def started_threads(before: set[threading.Thread]) -> list[threading.Thread]:
    """The live threads that were not in `before` (the ones the learner's constructor started)."""
    return [t for t in threading.enumerate() if t not in before and not t.name.startswith("grader: ")]


def thread_cpu_seconds(threads: Iterable[threading.Thread]) -> float:
    """CPU time the live `threads` have used so far (a thread that ended counts 0: measure while they run).
    Where a thread's CPU clock cannot be read (macOS has no pthread_getcpuclockid), the whole process's CPU time:
    the other threads of a test measuring idleness sleep too, so the difference over a window still tells."""
    if not hasattr(time, "pthread_getcpuclockid"):
        return time.process_time()
    total = 0.0
    for t in threads:
        if t.ident is None or not t.is_alive():
            continue
        try:
            total += time.clock_gettime(time.pthread_getcpuclockid(t.ident))
        except (OSError, ProcessLookupError):  # the thread ended between the check and the read
            continue
    return total


class StepGate:
    """A fake model step the test drives: each call records its batch, announces it, and (while held) blocks
    until the test releases it, so the test knows exactly what the step thread is doing.

    `step_fn(batch)` computes each sequence's next token with `next_token`; `held=False` lets every step run
    freely (the batches are still recorded). Waiting for a step is bounded: `Deadlock` with stacks."""

    def __init__(self, next_token: Callable[[list[int]], int], held: bool = True, timeout: float = 10.0) -> None:
        self._next_token = next_token
        self._timeout = timeout
        self._cond = threading.Condition()
        self._held = held
        self._released = 0  # steps the test let through
        self.batches: list[list[str]] = []  # request ids of each step, in batch order
        self.in_step = False

    def step_fn(self, batch: list[tuple[str, list[int]]]) -> list[int]:
        with self._cond:
            index = len(self.batches)
            self.batches.append([request_id for request_id, _ in batch])
            self.in_step = True
            self._cond.notify_all()
            # a test that failed may never release it: the step then goes on by itself (raising here would kill
            # the learner's thread after the test, see watch_threads)
            self._cond.wait_for(lambda: not self._held or self._released > index, self._timeout * 3)
            self.in_step = False
            self._cond.notify_all()
        return [self._next_token(list(tokens)) for _, tokens in batch]

    def wait_for_step(self, n: int, what: str = "") -> list[str]:
        """Blocks until step `n` (1-based) has started; returns its batch's request ids."""
        with self._cond:
            if not self._cond.wait_for(lambda: len(self.batches) >= n, self._timeout):
                raise _deadlock(what or f"waiting for the batcher to start step {n}", self._timeout)
            return list(self.batches[n - 1])

    def release(self, steps: int = 1) -> None:
        """Lets `steps` more held steps finish."""
        with self._cond:
            self._released += steps
            self._cond.notify_all()

    def open(self) -> None:
        """Every step from now on runs freely."""
        with self._cond:
            self._held = False
            self._cond.notify_all()
