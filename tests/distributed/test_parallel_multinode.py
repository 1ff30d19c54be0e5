"""Two "nodes" on loopback: the engine (node 0, rank 0) in this process, node 1's rank started as a separate
program by the documented command (`python -m engine_core.executor.launch`, MASTER_ADDR=127.0.0.1,
MASTER_PORT, NODE_RANK=1, ENGINE_CORE_AUTHKEY); the group meets by env://, node 1's worker gets its
configuration from the engine over the authenticated control connection. TP=2 across the two gives
the one-process engine's greedy tokens, and shutdown ends node 1's launcher too."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from engine_core import LLM
from parallel_helpers import STRESS, child_processes, generate_tokens, stress_prompts

pytestmark = pytest.mark.timeout(600)
ROOT = Path(__file__).resolve().parents[2]


def two_free_ports() -> int:
    """A port p of 127.0.0.1 with p + 1 free too (MASTER_PORT and the engine's control port)."""
    for _ in range(50):
        with socket.socket() as a, socket.socket() as b:
            a.bind(("127.0.0.1", 0))
            port = a.getsockname()[1]
            try:
                b.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
            return port
    raise RuntimeError("no two consecutive free ports")


def test_tp2_across_two_loopback_nodes(monkeypatch):
    port = two_free_ports()
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "ENGINE_CORE_AUTHKEY": "loopback-test"}
    node1 = subprocess.Popen([sys.executable, "-m", "engine_core.executor.launch", "--nproc-per-node", "1"],
                             cwd=ROOT, env={**os.environ, **env, "NODE_RANK": "1"})
    try:
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        llm = LLM("tiny-llama", tensor_parallel_size=2, nnodes=2, **STRESS)
        assert llm.engine.executor.procs[1] is None  # rank 1 is not this process's child
        prompts = stress_prompts(llm.engine.vocab_size)
        assert generate_tokens(llm, prompts) == generate_tokens(LLM("tiny-llama", **STRESS), prompts)
        llm.shutdown()
        assert node1.wait(timeout=60) == 0
        assert not child_processes()
    finally:
        if node1.poll() is None:
            node1.kill()
