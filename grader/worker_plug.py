"""A lab's plug inside the worker processes of a parallel engine (lab 11).

`plug` replaces engine functions in this process; a parallel engine's workers are spawned fresh
interpreters that import the engine anew, so a plug in the engine process never reaches the code
that shards and runs the model. Inside `plugged_workers(student, lab)` every worker a parallel
engine starts runs the engine's general plugin hook (engine_core/executor/plugins.py) with
`plug_in_worker`: it loads the learner's functions, shipped by value with cloudpickle (the notebook's
module is not importable in the worker; each function's code keeps its "cell N of <notebook>" file
name, so delegation checks and tracebacks still see the learner's cells), and enters
`plug(student, lab)` for the worker's lifetime: counted, and with the engine's own functions
tripwired there too. `worker_calls` (for `executor.collective_rpc`) returns each rank's counts.
"""
from __future__ import annotations

import contextlib
import os
import sys
import tempfile
import types
from pathlib import Path
from typing import Any, Iterator
from unittest import mock

import cloudpickle

from engine_core.executor.plugins import PLUGINS_ENV
from grader.plug import Plugged, plug
from grader.seams import seams_of

PAYLOAD_ENV = "GRADER_WORKER_PLUG"  # the file holding (lab, {student_name: function})
ENTRY = "grader.worker_plug:plug_in_worker"
_ACTIVE: list[tuple[plug, Plugged]] = []  # this worker's plug, entered once, never left


def dump(student: Any, lab: str, path: Path) -> None:
    """Write the learner's functions of `lab`'s seams to `path`, by value."""
    functions = {s.student_name: getattr(student, s.student_name) for s in seams_of(lab)}
    module = sys.modules.get(getattr(student, "__name__", ""))
    by_value = module is student and student.__name__ != "__main__"
    if by_value:  # a loaded notebook: a module no worker can import
        cloudpickle.register_pickle_by_value(student)
    try:
        path.write_bytes(cloudpickle.dumps((lab, functions)))
    finally:
        if by_value:
            cloudpickle.unregister_pickle_by_value(student)


@contextlib.contextmanager
def plugged_workers(student: Any, lab: str) -> Iterator[None]:
    """Every parallel engine started inside the block has the learner's functions plugged in its workers."""
    with tempfile.TemporaryDirectory(prefix="worker-plug-") as tmp:
        path = Path(tmp) / "plug.pkl"
        dump(student, lab, path)
        with mock.patch.dict(os.environ, {PLUGINS_ENV: ENTRY, PAYLOAD_ENV: str(path)}):
            yield


def plug_in_worker() -> None:
    """The general plugin a worker runs before loading its shard (ENGINE_CORE_PLUGINS names it)."""
    if _ACTIVE:
        return
    lab, functions = cloudpickle.loads(Path(os.environ[PAYLOAD_ENV]).read_bytes())
    block = plug(types.SimpleNamespace(**functions), lab)
    _ACTIVE.append((block, block.__enter__()))


def worker_calls(runner: Any) -> dict[str, int]:
    """This rank's calls of each plugged function so far (an `executor.collective_rpc` target)."""
    return dict(_ACTIVE[0][1].calls) if _ACTIVE else {}
