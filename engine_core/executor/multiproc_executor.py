"""`MultiprocExecutor`: tensor_parallel_size x pipeline_parallel_size worker processes (torch.multiprocessing
spawn; gloo on CPU, NCCL on CUDA), vLLM v1's design; `WorkerMonitor` watches them between calls.

What it guarantees: every rank gets the same pickled `SchedulerOutput` each step and the output rank's reply is
the step's; with `non_block=True` up to pipeline_parallel_size calls are in flight, their replies read in the
order they were sent (`PendingCall`). A worker that raises, dies or does not reply within `step_timeout_s`
stops every worker and raises `EngineDeadError` naming the rank, and every later call raises it again; a worker
that dies between calls is reported at once to the `register_failure_callback` callbacks. `shutdown()`, garbage
collection and interpreter exit leave no worker behind. Several machines (`nnodes` > 1): workers started by
`python -m engine_core.executor.launch` connect on MASTER_PORT + 1, authenticated by ENGINE_CORE_AUTHKEY.
The commands and the design in full: docs/parallelism.md.
"""
from __future__ import annotations

import os
import pickle
import signal
import socket
import threading
import time
import weakref
from collections import deque
from multiprocessing.connection import Connection, Listener, wait
from typing import Any, Callable

import torch
import torch.multiprocessing as mp

from engine_core.config import KVCacheConfig, ResolvedConfig
from engine_core.core.scheduler_output import SchedulerOutput
from engine_core.distributed.parallel_state import output_rank
from engine_core.exceptions import EngineDeadError
from engine_core.executor.abstract import Executor
from engine_core.executor.worker_proc import WorkerSpec, worker_main
from engine_core.models.config import LlamaArgs, ModelConfig
from engine_core.outputs import ModelRunnerOutput

STARTUP_TIMEOUT_S = float(os.environ.get("ENGINE_CORE_WORKER_STARTUP_TIMEOUT_S", 600))
STEP_TIMEOUT_S = float(os.environ.get("ENGINE_CORE_WORKER_STEP_TIMEOUT_S", 300))
CONTROL_PORT_OFFSET = 1  # the engine listens for other nodes' workers on MASTER_PORT + 1
# how long a dying worker may take to be reaped: a killed process closes its pipe and sockets first and exits after
# its memory is torn down, which took over a second on 2 loaded cores (CI). A failing step waits this long for a
# peer's exit before blaming the rank that raised, and for a closed pipe's exit code.
EXIT_GRACE_S = 5.0


def rendezvous() -> tuple[str, int, bytes]:
    """(MASTER_ADDR, MASTER_PORT, ENGINE_CORE_AUTHKEY) of a multi-node run, each checked."""
    addr, port, key = (os.environ.get(k, "") for k in ("MASTER_ADDR", "MASTER_PORT", "ENGINE_CORE_AUTHKEY"))
    if not addr or not port.isdigit() or not key:
        raise ValueError(f"nnodes > 1 needs MASTER_ADDR, MASTER_PORT (an int) and ENGINE_CORE_AUTHKEY (a shared "
                         f"secret) in the environment of every node; got MASTER_ADDR={addr!r}, MASTER_PORT={port!r}, "
                         f"ENGINE_CORE_AUTHKEY {'set' if key else 'unset'}")
    return addr, int(port), key.encode()


def check_parallel(config: ResolvedConfig, args: LlamaArgs) -> None:
    """What the model and the machine must allow, checked before any process starts."""
    e = config.engine
    tp, pp, world = e.tensor_parallel_size, e.pipeline_parallel_size, e.world_size // e.nnodes  # on this node
    if e.nnodes > 1:
        rendezvous()
    for name, n in (("num_attention_heads", args.num_heads), ("intermediate_size", args.intermediate_size)):
        if n % tp:
            raise ValueError(f"tensor_parallel_size={tp} must divide the model's {name}={n}")
    kv = args.num_kv_heads
    if (tp <= kv and kv % tp) or (tp > kv and tp % kv):
        raise ValueError(f"tensor_parallel_size={tp} must divide the model's num_key_value_heads={kv} or be a "
                         f"multiple of it (then each KV head is replicated on tensor_parallel_size / {kv} ranks)")
    if pp > args.num_layers:
        raise ValueError(f"pipeline_parallel_size={pp} must be <= the model's num_hidden_layers={args.num_layers} "
                         f"(every stage holds at least one layer)")
    if config.device.type == "cuda":
        first = config.device.index or 0
        if first + world > torch.cuda.device_count():
            raise ValueError(f"tensor_parallel_size x pipeline_parallel_size = {world} ranks need CUDA devices "
                             f"{first}..{first + world - 1}; this machine has {torch.cuda.device_count()}")
        if not e.enforce_eager:
            raise ValueError("enforce_eager must be True with tensor_parallel_size x pipeline_parallel_size > 1 "
                             "(CUDA graphs are not captured around collectives yet)")
        return
    if config.dtype != torch.float32:
        raise ValueError(f"dtype must be 'float32' (or 'auto') for a parallel engine on CPU, got {config.dtype}: "
                         f"gloo has no bfloat16 all_reduce (pytorch #111131), and fp16 is untested here")
    cores = os.cpu_count() or 1
    if world > cores:
        raise ValueError(f"tensor_parallel_size x pipeline_parallel_size = {world} worker processes need at least "
                         f"one CPU core each; this machine has {cores}")


def free_port() -> int:
    """A port of 127.0.0.1 free now (another process may take it before the group binds it: rare)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class MultiprocExecutor(Executor):
    def __init__(self, config: ResolvedConfig, model_config: ModelConfig) -> None:
        check_parallel(config, model_config.args)
        e = config.engine
        self.world_size, local = e.world_size, e.world_size // e.nnodes
        self.output_rank = output_rank(e.tensor_parallel_size, e.pipeline_parallel_size)
        self.step_timeout_s = STEP_TIMEOUT_S
        self._dead: str | None = None
        self._comm: list[dict[str, float]] = [{} for _ in range(self.world_size)]
        # one step per stage can be in flight; fewer when the config asks
        self.max_concurrent_batches = e.max_concurrent_batches or e.pipeline_parallel_size
        self._in_flight: deque[PendingCall] = deque()  # sent, replies not read yet, oldest first
        context = mp.get_context("spawn")
        init_method = "env://" if e.nnodes > 1 else f"tcp://127.0.0.1:{free_port()}"
        self.procs: list[Any] = [None] * self.world_size  # None: a rank on another node
        self.conns: list[Connection | None] = [None] * self.world_size
        self._stopping = threading.Event()  # set before the workers are stopped: their exits are no failure
        self._finalizer = weakref.finalize(self, stop_workers, self.procs, self.conns, self._stopping)
        self._monitor: WorkerMonitor | None = None

        def spec(rank: int) -> WorkerSpec:
            return WorkerSpec(rank, e.tensor_parallel_size, e.pipeline_parallel_size, init_method,
                              local_rank=rank % local, local_world_size=local, collective_timeout_s=self.step_timeout_s)
        try:
            for rank in range(local):
                ours, theirs = context.Pipe()
                proc = context.Process(target=worker_main, args=(spec(rank), config, model_config, theirs, os.getpid()),
                                       name=f"engine-worker-{rank}", daemon=True)
                proc.start()
                theirs.close()
                self.procs[rank], self.conns[rank] = proc, ours
            if e.nnodes > 1:
                self._accept_other_nodes(range(local, self.world_size), spec, config, model_config)
            self._replies("startup (joining the group, loading the weights)", STARTUP_TIMEOUT_S)
            self._monitor = WorkerMonitor(self.procs, self._stopping)
        except BaseException:
            self.shutdown()
            raise

    def _accept_other_nodes(self, ranks: range, spec: Callable[[int], WorkerSpec], config: ResolvedConfig,
                            model_config: ModelConfig) -> None:
        """Each remote worker connects, names its rank, and gets what a spawned worker gets as arguments."""
        addr, port, key = rendezvous()
        listener = Listener((addr, port + CONTROL_PORT_OFFSET), authkey=key)

        def accept() -> None:
            for _ in ranks:
                conn = listener.accept()
                rank = conn.recv()
                if rank not in ranks or self.conns[rank] is not None:
                    conn.close()
                    continue
                conn.send((spec(rank), config, model_config))
                self.conns[rank] = conn
        thread = threading.Thread(target=accept, name="accept-workers", daemon=True)
        thread.start()
        thread.join(STARTUP_TIMEOUT_S)
        listener.close()
        missing = [r for r in ranks if self.conns[r] is None]
        if missing:
            raise EngineDeadError(f"ranks {missing} (other nodes) did not connect to {addr}:{port + CONTROL_PORT_OFFSET} "
                                  f"within {STARTUP_TIMEOUT_S:g} s: is `python -m engine_core.executor.launch` "
                                  f"running there with the same MASTER_ADDR, MASTER_PORT, ENGINE_CORE_AUTHKEY?")

    # ---- the executor's calls ------------------------------------------------------------
    def determine_kv_cache_config(self) -> KVCacheConfig:
        """The fewest blocks any rank has room for: the scheduler's block ids must exist on every rank.
        `block_bytes` is the largest rank's (a pipeline stage may hold one layer more than another)."""
        configs: list[KVCacheConfig] = self._call("determine_kv_cache_config", (), every_rank_replies=True)
        return KVCacheConfig(min(c.num_gpu_blocks for c in configs), min(c.num_cpu_blocks for c in configs),
                             max(c.block_bytes for c in configs))

    def initialize_kv_cache(self, kv_cache_config: KVCacheConfig) -> None:
        self._call("initialize_kv_cache", (kv_cache_config,))

    def execute_model(self, scheduler_output: SchedulerOutput,
                      non_block: bool = False) -> "ModelRunnerOutput | PendingCall":
        """The step's output; with `non_block`, a `PendingCall` whose `result()` is it (the engine's batch queue)."""
        pending = self._send("execute_model", (scheduler_output,), every_rank_replies=False)
        pending.output_rank = self.output_rank
        return pending if non_block else pending.result()

    def forget_all_requests(self) -> None:
        if self._dead is None:  # after a worker failure there is nothing left to forget
            self._call("forget_all_requests", ())

    def collective_rpc(self, fn: Callable[..., Any], *args: Any) -> list[Any]:
        """`fn` must be importable by the workers (a module-level function): it is pickled by name."""
        return self._call(fn, args, every_rank_replies=True)

    def comm_stats(self) -> dict[str, float]:
        total: dict[str, float] = {}
        for rank_stats in self._comm:
            for k, v in rank_stats.items():
                total[k] = total.get(k, 0) + v
        return total

    def register_failure_callback(self, callback: Callable[[str], None]) -> None:
        if self._monitor is not None:
            self._monitor.register(callback)

    def shutdown(self) -> None:
        self._finalizer()

    # ---- messages ------------------------------------------------------------------------
    def _call(self, method: str | Callable[..., Any], args: tuple, every_rank_replies: bool = False) -> list[Any]:
        return self._send(method, args, every_rank_replies).result(every_rank=True)

    def _send(self, method: str | Callable[..., Any], args: tuple, every_rank_replies: bool) -> "PendingCall":
        """The call's bytes down every pipe; its replies are read by `PendingCall.result()`."""
        if self._dead is not None:
            raise EngineDeadError(self._dead)
        name = method if isinstance(method, str) else getattr(method, "__name__", repr(method))
        data = pickle.dumps((method, args, every_rank_replies))
        pending = PendingCall(self, name)
        self._guarded(name, lambda: self._send_bytes(name, data))
        self._in_flight.append(pending)
        return pending

    def _send_bytes(self, name: str, data: bytes) -> None:
        for rank, conn in enumerate(self.conns):
            try:
                conn.send_bytes(data)
            except (BrokenPipeError, OSError):
                self._fail(f"{name}: {self._death(rank)}")

    def _read_until(self, pending: "PendingCall") -> None:
        """Read the replies of every call in flight up to and including `pending`, oldest first."""
        while not pending.done:
            oldest = self._in_flight.popleft()
            oldest.results = self._guarded(oldest.name, lambda: self._replies(oldest.name, self.step_timeout_s))
            oldest.done = True

    def _guarded(self, name: str, fn: Callable[[], Any]) -> Any:
        """`fn()`; interrupted while the ranks work, the executor stops them (their replies would answer
        the next call)."""
        try:
            return fn()
        except EngineDeadError:
            raise
        except BaseException:
            self._dead = f"{name} was interrupted before every worker replied; the workers were stopped"
            self.shutdown()
            raise

    def _replies(self, what: str, timeout: float) -> list[Any]:
        """Every rank's result, waiting at most `timeout` seconds; any failure stops every worker."""
        results: list[Any] = [None] * self.world_size
        pending = dict(enumerate(self.conns))
        sentinels = {p.sentinel: rank for rank, p in enumerate(self.procs) if p is not None}
        deadline = time.monotonic() + timeout
        while pending:
            left = deadline - time.monotonic()
            ready = wait([*pending.values(), *sentinels], timeout=left) if left > 0 else []
            if not ready:
                self._fail(f"{what}: no reply from worker(s) {sorted(pending)} within {timeout:g} s (hung or too "
                           f"slow; ENGINE_CORE_WORKER_STEP_TIMEOUT_S sets the limit)")
            for rank, conn in list(pending.items()):  # replies first: an error says more than the exit code
                if conn not in ready:
                    continue
                try:
                    status, result, comm = conn.recv()
                except (EOFError, OSError):
                    self._fail(f"{what}: {self._death(rank)}")
                if status == "error":
                    dead = self._peer_death(rank)
                    if dead is not None:  # a rank whose peer died fails in the collective: the death is the cause
                        self._fail(f"{what}: {self._death(dead)} (worker {rank} then raised:\n{result})")
                    self._fail(f"{what}: worker {rank} raised:\n{result}")
                results[rank], self._comm[rank] = result, comm
                del pending[rank]
            for sentinel in ready:
                if sentinel in sentinels:
                    self._fail(f"{what}: {self._death(sentinels[sentinel])}")
        return results

    def _death(self, rank: int) -> str:
        return death(rank, self.procs[rank])

    def _peer_death(self, rank: int) -> int | None:
        """A local rank other than `rank` whose process has ended, or ends within EXIT_GRACE_S: a killed
        peer's sockets close as its exit begins, so the collective fails in `rank` a moment before the peer's exit
        is visible (seen in CI: the error named the survivor). Only a failing step waits."""
        others = {p.sentinel: r for r, p in enumerate(self.procs) if p is not None and r != rank}
        ready = wait(list(others), timeout=EXIT_GRACE_S) if others else []
        return others[ready[0]] if ready else None

    def _fail(self, message: str) -> None:
        self._dead = f"the parallel engine stopped: {message}"
        if self._finalizer.detach() is not None:  # the surviving ranks may wait in a collective: no long grace
            stop_workers(self.procs, self.conns, self._stopping, grace_s=0.5)
        raise EngineDeadError(self._dead)


class PendingCall:
    """A call sent to every rank whose replies are read later (vLLM's `execute_model(..., non_block=True)`
    future): `result()` blocks until they are, reading the older calls' replies first."""

    def __init__(self, executor: MultiprocExecutor, name: str) -> None:
        self.executor, self.name = executor, name
        self.output_rank: int | None = None  # execute_model: only this rank's reply is the result
        self.done = False
        self.results: list[Any] = []

    def result(self, every_rank: bool = False) -> Any:
        if not self.done:
            if self.executor._dead is not None:
                raise EngineDeadError(self.executor._dead)
            self.executor._read_until(self)
        return self.results if every_rank or self.output_rank is None else self.results[self.output_rank]


def death(rank: int, proc: Any) -> str:
    """How worker `rank` ended, for an EngineDeadError."""
    if proc is None:
        return f"worker {rank} (on another node) closed its connection"
    proc.join(EXIT_GRACE_S)  # a closed pipe comes a moment before the exit code
    code = proc.exitcode
    how = (f"killed by {signal.Signals(-code).name}" if code is not None and code < 0 else
           f"exit code {code}" if code is not None else "its pipe closed")
    return f"worker {rank} (pid {proc.pid}) died ({how})"


class WorkerMonitor:
    """Waits on the local workers' process sentinels on a daemon thread; the first that fires, unless the
    executor is stopping them, calls every registered callback with the reason (once). It holds no reference
    to the executor, so garbage collection still stops the workers."""

    def __init__(self, procs: list[Any], stopping: threading.Event) -> None:
        self._lock = threading.Lock()
        self._callbacks: list[Callable[[str], None]] = []
        self.reason: str | None = None
        threading.Thread(target=self._watch, args=(list(procs), stopping), name="engine-worker-monitor",
                         daemon=True).start()

    def register(self, callback: Callable[[str], None]) -> None:
        with self._lock:
            self._callbacks.append(callback)
            reason = self.reason
        if reason is not None:  # it died before anyone listened
            callback(reason)

    def _watch(self, procs: list[Any], stopping: threading.Event) -> None:
        sentinels = {p.sentinel: rank for rank, p in enumerate(procs) if p is not None}
        ready = wait(list(sentinels)) if sentinels else []
        if stopping.is_set() or not ready:
            return
        rank = sentinels[ready[0]]
        with self._lock:
            self.reason = f"the parallel engine stopped: {death(rank, procs[rank])}"
            callbacks = list(self._callbacks)
        for callback in callbacks:
            callback(self.reason)


def stop_workers(procs: list[Any], conns: list[Connection | None], stopping: threading.Event | None = None,
                 grace_s: float = 5.0) -> None:
    """Ask, then terminate, then kill; wait for each, so no process is left (the finalizer's body). A
    remote worker gets the message and the closed connection; its node's launcher outlives it only briefly."""
    if stopping is not None:
        stopping.set()
    data = pickle.dumps(("shutdown", (), False))
    procs = [p for p in procs if p is not None]
    conns = [c for c in conns if c is not None]
    for conn in conns:
        try:
            conn.send_bytes(data)
        except (BrokenPipeError, OSError):
            pass
    deadline = time.monotonic() + grace_s
    for proc in procs:
        proc.join(max(0.0, deadline - time.monotonic()))
    for proc in procs:
        if proc.is_alive():
            proc.terminate()
            proc.join(2.0)
        if proc.is_alive():
            proc.kill()
            proc.join()
    for conn in conns:
        conn.close()
