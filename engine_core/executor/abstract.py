"""The executor interface: what the engine calls to run a step, whether the model lives in its own process or is
sharded over worker processes (vLLM v1's `Executor`, `UniProcExecutor`, `MultiprocExecutor`).

The engine owns the one scheduler and talks to the model only through these calls:
`determine_kv_cache_config()` (the smallest of the ranks' block counts, so every rank holds every block
id the scheduler hands out), `initialize_kv_cache(config)`, `execute_model(scheduler_output)` ->
`ModelRunnerOutput` (with `non_block=True`, where `max_concurrent_batches` > 1: a pending call whose
`result()` is it), `forget_all_requests()` (after a failed step), `collective_rpc(fn)` (a function of
the runner on every rank) and `shutdown()`.
"""
from __future__ import annotations

from typing import Any, Callable

from engine_core.config import KVCacheConfig
from engine_core.core.scheduler_output import SchedulerOutput
from engine_core.lora.manager import LoRAManager
from engine_core.outputs import ModelRunnerOutput


class Executor:
    """The interface (`executor.get_executor_class(config)` picks the implementation)."""

    lora: LoRAManager | None = None  # the runner's adapters (in the engine's process only)
    # steps the engine may keep in flight (vLLM's batch queue): pipeline_parallel_size with worker processes
    max_concurrent_batches: int = 1

    def determine_kv_cache_config(self) -> KVCacheConfig:
        raise NotImplementedError

    def initialize_kv_cache(self, kv_cache_config: KVCacheConfig) -> None:
        raise NotImplementedError

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        raise NotImplementedError

    def forget_all_requests(self) -> None:
        raise NotImplementedError

    def collective_rpc(self, fn: Callable[..., Any], *args: Any) -> list[Any]:
        """`fn(runner, *args)` on every rank; the results in rank order."""
        raise NotImplementedError

    def comm_stats(self) -> dict[str, float]:
        """Collective calls, bytes and seconds, summed over the ranks (empty with one process)."""
        return {}

    def shutdown(self) -> None:
        """Stop the workers (idempotent)."""
