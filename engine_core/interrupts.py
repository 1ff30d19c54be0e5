"""Ctrl-C between steps, never inside one.

A KeyboardInterrupt can land on any line: inside `update_from_output` after a request's
`num_computed_tokens` moved but before its token was appended, or between planning a swap-out
and copying the blocks. The engine rolls such a step back (LLMEngine's recovery), but it is
cheaper and exact to not be interrupted mid-step at all: `sigint_deferred()` holds a SIGINT that
arrives during the block and raises it when the block ends, so the step completes and the
interrupt lands between steps, where `LLM.generate` aborts its requests cleanly.

A second Ctrl-C during the same block raises at once (a step that hangs can still be stopped;
the rollback then handles it). Only the main thread receives SIGINT, and only Python's default
handler is replaced: a program with its own SIGINT handler keeps it.
"""
from __future__ import annotations

import signal
import threading
from contextlib import contextmanager
from types import FrameType
from typing import Iterator


@contextmanager
def sigint_deferred() -> Iterator[None]:
    if (threading.current_thread() is not threading.main_thread()
            or signal.getsignal(signal.SIGINT) is not signal.default_int_handler):
        yield
        return
    received: list[int] = []

    def hold(signum: int, frame: FrameType | None) -> None:
        if received:
            raise KeyboardInterrupt
        received.append(signum)

    signal.signal(signal.SIGINT, hold)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if received:
        raise KeyboardInterrupt
