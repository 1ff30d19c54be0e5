"""Lab 14's slow engine: the reference step with realistic slowdowns planted at the lab's seams.

`with slow_engine():` puts the slow variants (`variants.py`) at the seams of lab 14
(grader/seams.py) for the duration of the block; `with slow_engine(keep=("write_kv",)):` leaves
the named seams as they are (the engine's, or the learner's while plugged), so one slowdown can be
measured alone. The engine itself stays fast: it is the answer key. The variants compute the same
tokens as the engine (lab 14's tests check it), only slower, each in a way a real codebase does.
"""
from __future__ import annotations

import contextlib
from typing import Callable, Iterable, Iterator
from unittest import mock

from grader.seams import fused_block_switch, resolve, seams_of
from grader.slow_engine import variants

LAB = "14_find_the_bottleneck"
SLOW = {  # student name -> the slow variant planted at that seam
    "write_kv": variants.write_kv,
    "attend": variants.attend,
    "sample": variants.sample,
    "block_tables": variants.block_tables,
    "remove_finished": variants.remove_finished,
}


@contextlib.contextmanager
def slow_engine(keep: Iterable[str] = (), wrap: Callable[[str, Callable], Callable] | None = None) -> Iterator[None]:
    """The engine with every lab-14 seam but those in `keep` replaced by its slow variant; `wrap(name, variant)`,
    if given, returns what to plant instead (a timer around the variant)."""
    keep = set(keep)
    unknown = keep - set(SLOW)
    if unknown:
        raise ValueError(f"keep: {sorted(unknown)} are not lab 14 seams; they are {sorted(SLOW)}")
    planted = [seam for seam in seams_of(LAB) if seam.student_name not in keep]
    with contextlib.ExitStack() as stack:
        if switch := fused_block_switch(planted):  # the engine's fused decode block would bypass the variants
            stack.enter_context(mock.patch.object(*switch, False))
        for seam in planted:
            variant = SLOW[seam.student_name]
            stack.enter_context(mock.patch.object(resolve(seam.owner), seam.attr,
                                                  wrap(seam.student_name, variant) if wrap else variant))
        yield
