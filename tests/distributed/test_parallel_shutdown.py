"""No worker outlives its engine: shutdown() and garbage collection stop a live parallel engine's workers,
and Ctrl-C in the engine process while it generates leaves no worker behind (psutil's view of the
processes, multiprocessing's shared resource tracker aside)."""
from __future__ import annotations

import gc
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from engine_core import LLM, SamplingParams
from parallel_helpers import child_processes

pytestmark = pytest.mark.timeout(600)
ROOT = Path(__file__).resolve().parents[2]


def test_shutdown_and_garbage_collection_stop_the_workers():
    llm = LLM("tiny-llama", tensor_parallel_size=2, num_gpu_blocks=32)
    pids = [p.pid for p in llm.engine.executor.procs]
    assert {p.pid for p in child_processes()} == set(pids)
    assert llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3), use_tqdm=False)[0].outputs[0].token_ids
    del llm
    gc.collect()
    assert not child_processes()
    assert not any(psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE for pid in pids)


# A terminal's foreground job has Python's own SIGINT handler; a test run started in the background from a script
# (`make test &`) ignores SIGINT, which the script would inherit, so it sets the handler itself
CTRL_C_SCRIPT = """
import signal, sys
from engine_core import LLM, SamplingParams
if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.default_int_handler)
    llm = LLM("tiny-llama", tensor_parallel_size=2, num_gpu_blocks=64)
    print(*[p.pid for p in llm.engine.executor.procs], flush=True)
    step = llm.engine.step

    def first_step():  # says that generate() is under way: the test waits for this line, not for a time
        llm.engine.step = step
        print("generating", flush=True)
        return step()
    llm.engine.step = first_step
    try:
        llm.generate([[5, 6, 7]] * 4, SamplingParams(max_tokens=900, ignore_eos=True), use_tqdm=False)
    except KeyboardInterrupt:
        print("interrupted", flush=True)
        sys.exit(3)
"""


def test_ctrl_c_in_the_engine_process_leaves_no_worker(tmp_path):
    """SIGINT to the whole process group, as a terminal sends it: the workers ignore it, the engine's
    step ends, KeyboardInterrupt reaches the script, and exiting stops the workers."""
    script = tmp_path / "ctrl_c.py"
    script.write_text(CTRL_C_SCRIPT)
    proc = subprocess.Popen([sys.executable, str(script)], cwd=ROOT, stdout=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        pids = [int(p) for p in proc.stdout.readline().split()]
        assert len(pids) == 2
        assert proc.stdout.readline() == "generating\n"
        os.killpg(proc.pid, signal.SIGINT)
        out, _ = proc.communicate(timeout=60)
        assert proc.returncode == 3 and "interrupted" in out
        deadline = time.monotonic() + 10
        while any(psutil.pid_exists(pid) for pid in pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(psutil.pid_exists(pid) for pid in pids)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
