"""A parallel engine never hangs on a worker: a killed worker and a hung one each end the engine with an
EngineDeadError naming the rank within the step timeout, and the other workers are stopped (psutil's
view of this process's children, multiprocessing's shared resource tracker aside); an engine process
killed outright (no finalizer runs) leaves no worker either.

No assert reads the wall clock (a loaded machine stretches every step): a death must be seen through the
worker's process sentinel, so its test sets a step timeout far beyond the test's own (a death found only
by the timeout would fail by pytest-timeout, and with another message); a hung worker never returns within
the test, so only the step timeout can end its call."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

from engine_core import LLM
from engine_core.exceptions import EngineDeadError
from parallel_helpers import child_processes

pytestmark = pytest.mark.timeout(600)
ROOT = Path(__file__).resolve().parents[2]
TP2 = dict(tensor_parallel_size=2, num_gpu_blocks=32)
NEVER_S = 3600.0  # longer than this file's pytest timeout: a wait this long fails the test


def sleep_on_rank_1(runner, seconds: float) -> None:
    if runner.parallel.rank == 1:
        time.sleep(seconds)


def test_a_killed_worker_ends_the_engine_with_a_clear_error():
    llm = LLM("tiny-llama", **TP2)
    llm.engine.executor.step_timeout_s = NEVER_S  # the sentinel, not the step timeout, must report the death
    victim = llm.engine.executor.procs[1]
    os.kill(victim.pid, signal.SIGKILL)
    with pytest.raises(EngineDeadError, match=rf"worker 1 \(pid {victim.pid}\) died \(killed by SIGKILL\)"):
        llm.generate([[5, 6, 7]], use_tqdm=False)
    assert not child_processes()
    with pytest.raises(EngineDeadError, match="SIGKILL"):
        llm.generate([[5, 6, 7]], use_tqdm=False)


def test_a_worker_dying_between_steps_is_reported_at_once():
    """The executor's monitor sees an idle engine's worker die and calls the failure callbacks (registered
    before and after the death) with the reason; the next call raises it."""
    llm = LLM("tiny-llama", **TP2)
    reasons: list[str] = []
    told = threading.Event()
    llm.engine.executor.register_failure_callback(lambda reason: (reasons.append(reason), told.set()))
    victim = llm.engine.executor.procs[1]
    os.kill(victim.pid, signal.SIGKILL)
    assert told.wait(60), "no failure callback within 60 s of the worker's death"
    assert re.search(rf"worker 1 \(pid {victim.pid}\) died \(killed by SIGKILL\)", reasons[0])
    late: list[str] = []
    llm.engine.executor.register_failure_callback(late.append)  # registered after the death: told at once
    assert late == reasons
    with pytest.raises(EngineDeadError, match="SIGKILL"):
        llm.generate([[5, 6, 7]], use_tqdm=False)
    assert not child_processes()


def test_a_hung_worker_times_out():
    llm = LLM("tiny-llama", **TP2)
    llm.engine.executor.collective_rpc(sleep_on_rank_1, 0.0)  # the workers import this module once
    llm.engine.executor.step_timeout_s = 2.0
    with pytest.raises(EngineDeadError, match=r"no reply from worker\(s\) \[1\] within 2 s"):
        llm.engine.executor.collective_rpc(sleep_on_rank_1, NEVER_S)  # only the step timeout can end this call
    assert not child_processes()


ENGINE_SCRIPT = """
import time
from engine_core import LLM
if __name__ == "__main__":
    llm = LLM("tiny-llama", tensor_parallel_size=2, num_gpu_blocks=32)
    print(*[p.pid for p in llm.engine.executor.procs], flush=True)
    time.sleep(600)
"""


def test_workers_exit_when_the_engine_process_is_killed(tmp_path):
    """SIGKILL runs no finalizer: each worker's watchdog sees its parent gone and exits."""
    script = tmp_path / "engine.py"
    script.write_text(ENGINE_SCRIPT)
    proc = subprocess.Popen([sys.executable, str(script)], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        pids = [int(p) for p in proc.stdout.readline().split()]
        assert len(pids) == 2 and all(psutil.pid_exists(pid) for pid in pids)
        proc.kill()
        proc.wait(timeout=30)
        deadline = time.monotonic() + 15
        while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(_alive(pid) for pid in pids)
    finally:
        if proc.poll() is None:
            proc.kill()


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _exit_after(seconds: float) -> None:
    time.sleep(seconds)


def test_a_failing_rank_waits_briefly_for_a_peer_exit_before_it_is_blamed(monkeypatch):
    """A killed peer's sockets close before its exit is visible, so the rank in the collective raises first: the
    executor looks for a peer's exit (the process sentinel) for EXIT_GRACE_S before it blames the rank that
    raised. A peer that exits within the grace is named; one still running after it is not."""
    import multiprocessing

    from engine_core.executor import multiproc_executor
    from engine_core.executor.multiproc_executor import MultiprocExecutor

    ctx = multiprocessing.get_context("spawn")
    monkeypatch.setattr(multiproc_executor, "EXIT_GRACE_S", 60.0)  # a loaded machine's exit comes within it
    exiting = ctx.Process(target=_exit_after, args=(0.5,))
    exiting.start()
    try:
        fake = type("Executor", (), {"procs": [None, exiting]})()
        assert MultiprocExecutor._peer_death(fake, 0) == 1
    finally:
        exiting.join(30)
    monkeypatch.setattr(multiproc_executor, "EXIT_GRACE_S", 0.2)
    running = ctx.Process(target=_exit_after, args=(NEVER_S,))
    running.start()
    try:
        fake = type("Executor", (), {"procs": [running, None]})()
        assert MultiprocExecutor._peer_death(fake, 1) is None  # rank 1 raised; rank 0 still runs: rank 1 is named
    finally:
        running.kill()
        running.join(30)
