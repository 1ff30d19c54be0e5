"""One worker process of a parallel engine: runs the general plugins (ENGINE_CORE_PLUGINS,
engine_core/executor/plugins.py), joins the process group, loads its shard of the model into a `ModelRunner`,
then serves the engine's calls until told to stop or the engine goes away.

A call arrives on the worker's pipe as one pickled `(method, args, reply)`: a `ModelRunner` method name
or a function of the runner (`collective_rpc`), and whether every rank replies with its result
(otherwise only the output rank does; the rest reply None, so a step's `ModelRunnerOutput` crosses
the pipe once). Each reply also carries the rank's communication counters. An exception is sent back
as its traceback and ends the worker: the other ranks may be waiting in a collective it will never
join, so the engine stops them all.

The worker ignores Ctrl-C (the engine process owns it: a step it holds until the end must not lose a
rank half-way), and exits when its parent does (a watchdog thread), so no worker outlives the engine.
"""
from __future__ import annotations

import dataclasses
import os
import pickle
import signal
import threading
import time
import traceback
from datetime import timedelta
from multiprocessing.connection import Connection

import torch
import torch.distributed as dist

from engine_core.config import ResolvedConfig
from engine_core.distributed.parallel_state import ParallelContext, init_groups
from engine_core.models.config import ModelConfig
from engine_core.executor.plugins import load_general_plugins
from engine_core.worker.model_runner import ModelRunner


@dataclasses.dataclass(frozen=True)
class WorkerSpec:
    """Where a worker stands: its global rank, the grid, the rendezvous, how many share its machine."""

    rank: int
    tensor_parallel_size: int
    pipeline_parallel_size: int
    init_method: str  # tcp://host:port, or env:// (MASTER_ADDR, MASTER_PORT)
    local_rank: int  # this machine's worker index: its CUDA device, its share of the cores
    local_world_size: int
    collective_timeout_s: float

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size


def worker_main(spec: WorkerSpec, config: ResolvedConfig, model_config: ModelConfig, conn: Connection,
                parent_pid: int) -> None:
    """The process's entry point (torch.multiprocessing spawn)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _exit_with_parent(parent_pid)
    try:
        load_general_plugins()
        runner, ctx = init_worker(spec, config, model_config)
    except BaseException:
        conn.send(("error", traceback.format_exc(), None))
        return
    conn.send(("ok", None, ctx.comm_stats().as_dict()))
    serve(runner, ctx, conn)


def init_worker(spec: WorkerSpec, config: ResolvedConfig,
                model_config: ModelConfig) -> tuple[ModelRunner, ParallelContext]:
    """The process group, this rank's groups, its device and its shard of the model."""
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // spec.local_world_size))
    if config.device.type == "cuda":
        device = torch.device("cuda", (config.device.index or 0) + spec.local_rank)
        torch.cuda.set_device(device)
        config = dataclasses.replace(config, device=device)
    dist.init_process_group("nccl" if config.device.type == "cuda" else "gloo", init_method=spec.init_method,
                            rank=spec.rank, world_size=spec.world_size,
                            timeout=timedelta(seconds=spec.collective_timeout_s))
    ctx = init_groups(spec.rank, spec.tensor_parallel_size, spec.pipeline_parallel_size, model_config.args.num_layers)
    return ModelRunner(config, model_config, ctx), ctx


def serve(runner: ModelRunner, ctx: ParallelContext, conn: Connection) -> None:
    """Answer calls until "shutdown", the engine's end of the pipe closing, or a call that raises. (The
    process group is left to the process's exit: a peer may already be gone, and destroying a group
    waits for it.)"""
    while True:
        try:
            method, args, every_rank_replies = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):  # the engine is gone
            return
        if method == "shutdown":
            return
        try:
            result = getattr(runner, method)(*args) if isinstance(method, str) else method(runner, *args)
        except BaseException:
            conn.send(("error", traceback.format_exc(), None))
            return
        reply = result if every_rank_replies or ctx.is_output_rank else None
        conn.send(("ok", reply, ctx.comm_stats().as_dict()))


def _exit_with_parent(parent_pid: int) -> None:
    """A daemon thread that ends the process once its parent is gone (re-parented: getppid changes),
    even while the main thread waits in a collective."""
    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watch, name="parent-watchdog", daemon=True).start()

