"""A parallel engine never hangs on a worker: a killed worker and a hung one each end the engine with an
EngineDeadError naming the rank within the step timeout, and the other workers are stopped (psutil's
view of this process's children, multiprocessing's shared resource tracker aside)."""
from __future__ import annotations

import os
import signal
import time

import pytest

from engine_core import LLM
from engine_core.distributed.multiproc_executor import EngineDeadError
from parallel_helpers import child_processes

pytestmark = pytest.mark.timeout(600)
TP2 = dict(tensor_parallel_size=2, num_gpu_blocks=32)


def sleep_on_rank_1(runner, seconds: float) -> None:
    if runner.parallel.rank == 1:
        time.sleep(seconds)


def test_a_killed_worker_ends_the_engine_with_a_clear_error():
    llm = LLM("tiny-llama", **TP2)
    victim = llm.engine.executor.procs[1]
    os.kill(victim.pid, signal.SIGKILL)
    t0 = time.perf_counter()
    with pytest.raises(EngineDeadError, match=rf"worker 1 \(pid {victim.pid}\) died \(killed by SIGKILL\)"):
        llm.generate([[5, 6, 7]], use_tqdm=False)
    assert time.perf_counter() - t0 < 10
    assert not child_processes()
    with pytest.raises(EngineDeadError, match="SIGKILL"):
        llm.generate([[5, 6, 7]], use_tqdm=False)


def test_a_hung_worker_times_out():
    llm = LLM("tiny-llama", **TP2)
    llm.engine.executor.collective_rpc(sleep_on_rank_1, 0.0)  # the workers import this module once
    llm.engine.executor.step_timeout_s = 2.0
    t0 = time.perf_counter()
    with pytest.raises(EngineDeadError, match=r"no reply from worker\(s\) \[1\] within 2 s"):
        llm.engine.executor.collective_rpc(sleep_on_rank_1, 60.0)
    assert time.perf_counter() - t0 < 10
    assert not child_processes()
