"""Which executor runs the model (vLLM's `distributed_executor_backend`), and `UniProcExecutor`: the model
runner in the engine's own process, called directly, so the single-process engine does exactly what it
did before there were executors (one more Python call per step)."""
from __future__ import annotations

from concurrent.futures import Future
from typing import Any, Callable

from engine_core.config import KVCacheConfig, ResolvedConfig
from engine_core.core.scheduler_output import SchedulerOutput
from engine_core.executor.abstract import Executor
from engine_core.executor.multiproc_executor import MultiprocExecutor
from engine_core.models.config import ModelConfig
from engine_core.outputs import ModelRunnerOutput
from engine_core.worker.model_runner import ModelRunner


def get_executor_class(config: ResolvedConfig) -> type[Executor]:
    """"mp", or None with more than one rank: worker processes; otherwise this process."""
    backend = config.engine.distributed_executor_backend
    if backend == "mp" or (backend is None and config.engine.world_size > 1):
        return MultiprocExecutor
    return UniProcExecutor


class UniProcExecutor(Executor):
    """The model runner in the engine's own process."""

    def __init__(self, config: ResolvedConfig, model_config: ModelConfig) -> None:
        self.runner = ModelRunner(config, model_config)

    def determine_kv_cache_config(self) -> KVCacheConfig:
        return self.runner.determine_kv_cache_config()

    def initialize_kv_cache(self, kv_cache_config: KVCacheConfig) -> None:
        self.runner.initialize_kv_cache(kv_cache_config)

    def execute_model(self, scheduler_output: SchedulerOutput,
                      non_block: bool = False) -> "ModelRunnerOutput | Future[ModelRunnerOutput]":
        if not non_block:
            return self.runner.execute_model(scheduler_output)
        done: Future[ModelRunnerOutput] = Future()  # vLLM's: the step has run when the future is made
        try:
            done.set_result(self.runner.execute_model(scheduler_output))
        except Exception as e:
            done.set_exception(e)
        return done

    def forget_all_requests(self) -> None:
        self.runner.forget_all_requests()

    def collective_rpc(self, fn: Callable[..., Any], *args: Any) -> list[Any]:
        return [fn(self.runner, *args)]
