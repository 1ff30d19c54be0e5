"""The executor interface: what the engine calls to run a step, whether the model lives in its own process or is
sharded over worker processes (vLLM v1's `Executor`, `UniProcExecutor`, `MultiprocExecutor`).

The engine owns the one scheduler and talks to the model only through these calls:
`determine_kv_cache_config()` (the smallest of the ranks' block counts, so every rank holds every block
id the scheduler hands out), `initialize_kv_cache(config)`, `execute_model(scheduler_output)` ->
`ModelRunnerOutput` (with `non_block=True`, where `max_concurrent_batches` > 1: a pending call whose
`result()` is it), `forget_all_requests()` (after a failed step), `check_lora` / `add_lora` (adapters),
`weight_bytes()`, `collective_rpc(fn)` (a function of the runner on every rank),
`register_failure_callback(fn)` and `shutdown()`.
"""
from __future__ import annotations

from concurrent.futures import Future
from typing import Any, Callable

from engine_core.config import KVCacheConfig
from engine_core.core.scheduler_output import SchedulerOutput
from engine_core.lora.adapter import LoRAAdapter
from engine_core.lora.request import LoRARequest
from engine_core.outputs import ModelRunnerOutput
from engine_core.worker import model_runner


class Executor:
    """The interface (`uniproc_executor.get_executor_class(config)` picks the implementation)."""

    runner: "model_runner.ModelRunner | None" = None  # the model runner when it is in the engine's process, else None
    # steps the engine may keep in flight (vLLM's batch queue): pipeline_parallel_size with worker processes
    max_concurrent_batches: int = 1

    def determine_kv_cache_config(self) -> KVCacheConfig:
        raise NotImplementedError

    def initialize_kv_cache(self, kv_cache_config: KVCacheConfig) -> None:
        raise NotImplementedError

    def execute_model(self, scheduler_output: SchedulerOutput,
                      non_block: bool = False) -> "ModelRunnerOutput | Future[ModelRunnerOutput]":
        """The step's output; with `non_block`, an object whose `result()` is it (or raises the step's error)."""
        raise NotImplementedError

    def forget_all_requests(self) -> None:
        raise NotImplementedError

    def collective_rpc(self, fn: Callable[..., Any], *args: Any) -> list[Any]:
        """`fn(runner, *args)` on every rank; the results in rank order."""
        raise NotImplementedError

    def check_lora(self, lora_request: LoRARequest) -> LoRAAdapter:
        """The adapter read and checked against the model (ValueError naming what is wrong); changes nothing."""
        return self.collective_rpc(model_runner.check_lora, lora_request)[0]

    def add_lora(self, lora_request: LoRARequest, adapter: LoRAAdapter | None = None) -> None:
        """vLLM's `add_lora`: every rank keeps the adapter (`adapter`: the one `check_lora` returned)."""
        self.collective_rpc(model_runner.add_lora, lora_request, adapter)

    def weight_bytes(self) -> tuple[int, dict[str, int]]:
        """The model's weight bytes as stored, summed over the ranks, and the same split by scheme or dtype."""
        total, by_scheme = 0, {}
        for nbytes, part in self.collective_rpc(model_runner.weight_bytes):
            total += nbytes
            for name, n in part.items():
                by_scheme[name] = by_scheme.get(name, 0) + n
        return total, by_scheme

    def comm_stats(self) -> dict[str, float]:
        """Collective calls, bytes and seconds, summed over the ranks (empty with one process)."""
        return {}

    def register_failure_callback(self, callback: Callable[[str], None]) -> None:
        """`callback(reason)` once, from any thread, when a worker dies between calls (a failure inside a call
        raises `EngineDeadError` instead). The model in the engine's own process never dies alone: no-op."""

    def shutdown(self) -> None:
        """Stop the workers (idempotent)."""
