"""LLMEngine: requests in, one scheduler step + one forward per `step()`, RequestOutputs out.

A step is three calls (vLLM v1's `EngineCore.step`): `Scheduler.schedule()`, `Executor.execute_model`,
`Scheduler.update_from_output`; with pipeline_parallel_size = p > 1 up to p steps are in flight
(`batch_queue`, vLLM's `step_with_batch_queue`). The engine reaches the model only through its executor.
What it guarantees: every add_request check runs before any state changes; one thread, checked
(engine_core.guard; only `abort_request` may come from any thread); a request whose forward fails finishes
with "error" and the others go on; a step is all-or-nothing (Ctrl-C held to its end, `_recover` rolls a
failed step back). The step end to end, the build order: docs/architecture.md; the rules: docs/engine_rules.md.
"""
from __future__ import annotations

import dataclasses
import time
from collections import deque
from typing import Any

from engine_core.config import EngineConfig, KVCacheConfig, ResolvedConfig
from engine_core.core.cost_model import PreemptionCostModel
from engine_core.core.scheduler import Scheduler
from engine_core.core.scheduler_output import SchedulerOutput
from engine_core.executor.abstract import Executor
from engine_core.executor.uniproc_executor import get_executor_class
from engine_core.guard import ThreadGuard, guarded
from engine_core.lora.adapter import LoRAAdapter
from engine_core.lora.request import LoRARequest
from engine_core.metrics import StepInfo
from engine_core.models.config import ModelConfig, check_draft_model
from engine_core.presets import resolve_model
from engine_core.prompts import PromptType, parse_prompt
from engine_core.request import CompletionOutput, Request, RequestOutput, RequestStatus, SamplingParams
from engine_core.validation import check_int, check_real, fail
from engine_core.worker.kv_offload import KVOffloadConnector


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.model_config = ModelConfig.load(resolve_model(config.model))
        args = self.model_config.args
        self.config = ResolvedConfig.resolve(config, args.max_position_embeddings, self.model_config.checkpoint_dtype)
        spec = config.speculative_config
        args.check_sliding_window(self.config.max_model_len, config.attention_backend, spec and spec.method,
                                  config.kv_eviction)
        if spec is not None and spec.method == "draft_model":  # before any process or weight is loaded
            check_draft_model(spec.model, args.vocab_size, self.config.max_model_len)
        self.executor: Executor = get_executor_class(self.config)(self.config, self.model_config)
        self.runner = self.executor.runner  # the model runner when it is in this process, else None
        self.kv_cache_config: KVCacheConfig = self.executor.determine_kv_cache_config()
        self.executor.initialize_kv_cache(self.kv_cache_config)
        self.weight_bytes, self.weight_bytes_by_scheme = self.executor.weight_bytes()  # every rank's shard
        self.cost_model = PreemptionCostModel.for_device(
            self.model_config.args.model_spec(), self.config.kv_cache_dtype, self.config.device.type,
            config.prefill_flops_per_s, config.swap_bandwidth_bytes_per_s)
        self.scheduler = Scheduler(self.config, self.kv_cache_config, self.cost_model,
                                   sliding_window=args.window(self.config.max_model_len))
        self.tokenizer = self.model_config.load_tokenizer()
        # request id -> (request, prompt text) until its final output is returned (aborted: at once)
        self.requests: dict[str, tuple[Request, str | None]] = {}
        self.last_step = StepInfo()
        self.guard = ThreadGuard()
        self.num_aborted = 0  # requests aborted so far: LLM.generate notices aborts made elsewhere
        self._pending_aborts: deque[str] = deque()  # abort_request while busy: applied at a step boundary
        self._report_stragglers = False  # a step failed: finished requests it did not report are in self.requests
        # vLLM's batch queue: (pending call, its SchedulerOutput) of the steps in flight, oldest first
        self.batch_queue_size = self.executor.max_concurrent_batches
        self.batch_queue: deque[tuple[Any, SchedulerOutput]] = deque()
        self.kv_offload: KVOffloadConnector | None = None  # the CPU offload tier (kv_offload_bytes > 0)
        if config.kv_offload_bytes:
            if self.runner is None or self.batch_queue_size != 1:
                raise ValueError("kv_offload_bytes > 0 needs the engine in one process (tensor_parallel_size = "
                                 "pipeline_parallel_size = 1, max_concurrent_batches 1): the tier copies the runner's KV")
            self.kv_offload = KVOffloadConnector(self.runner.kv_cache, self.scheduler.kv_cache_manager,
                                                 config.kv_offload_bytes, running=lambda: self.scheduler.running)

    @classmethod
    def from_kwargs(cls, model: str, **kwargs: Any) -> "LLMEngine":
        return cls(EngineConfig.from_kwargs(model, **kwargs))

    @property
    def vocab_size(self) -> int:
        return self.model_config.args.vocab_size

    # ---- requests ------------------------------------------------------------------------
    @guarded("add_request()")
    def add_request(self, request_id: str, prompt: PromptType, sampling_params: SamplingParams | None = None,
                    priority: int = 0, arrival_time: float | None = None,
                    lora_request: LoRARequest | None = None) -> Request:
        """Validate, then queue. Raises ValueError naming the parameter; nothing changes on error (an
        adapter is read and checked first, and joins the host cache only with its queued request).
        `sampling_params` is checked again and copied: changing it later does not reach this request."""
        self._apply_pending_aborts()
        if not isinstance(request_id, str) or not request_id:
            fail("request_id", "a non-empty str", request_id)
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use by an unfinished request")
        if sampling_params is not None and not isinstance(sampling_params, SamplingParams):
            fail("sampling_params", "a SamplingParams or None", sampling_params)
        params = dataclasses.replace(sampling_params or SamplingParams())  # re-runs every check
        # lower = admitted first under scheduling_policy "priority"; always: the largest value is preempted first
        priority = check_int("priority", priority, hint="lower = served first")
        if priority != 0 and self.config.engine.scheduling_policy != "priority":  # vLLM's processor refuses it too
            raise ValueError(f"priority must be 0 when priority scheduling is not enabled (scheduling_policy="
                             f"{self.config.engine.scheduling_policy!r}), got {priority}; build the engine with "
                             f"scheduling_policy='priority' to order requests by it")
        arrival_time = check_real("arrival_time", arrival_time, optional=True)
        text, token_ids = self._tokenize(prompt)
        limit = self.config.max_model_len
        if len(token_ids) + 1 > limit:
            raise ValueError(f"prompt has {len(token_ids)} tokens; with the first generated token it must fit "
                             f"max_model_len={limit}, so at most {limit - 1} prompt tokens are allowed")
        adapter = self._check_lora(lora_request)
        eos = self.model_config.eos_token_ids
        if not params.ignore_eos and len(eos) > 1:  # extra EOS ids stop like stop tokens
            params.stop_token_ids += list(eos[1:])
        request = Request(request_id, token_ids, params, eos_token_id=eos[0] if eos else None,
                          arrival_time=arrival_time, priority=priority,
                          lora_id=None if adapter is None else adapter.lora_int_id)
        self.scheduler.add_request(request)  # may reject (never fits the KV cache) before queuing
        if adapter is not None:
            self.executor.add_lora(lora_request, adapter)
        self.requests[request_id] = (request, text)
        if self.kv_offload is not None:  # the copy back starts now; the step that admits it waits for it
            self.kv_offload.prefetch(token_ids, request.lora_id, request_id)
        return request

    @guarded("add_lora()")
    def add_lora(self, lora_request: LoRARequest) -> None:
        """vLLM's `add_lora`: check an adapter folder and load it into the host cache ahead of its requests."""
        if not isinstance(lora_request, LoRARequest):
            fail("lora_request", "a LoRARequest", lora_request)
        self.executor.add_lora(lora_request, self._check_lora(lora_request))

    def _check_lora(self, lora_request: LoRARequest | None) -> LoRAAdapter | None:
        """The adapter, read and checked (engine_core.lora.adapter) but not yet remembered: a request
        rejected after this leaves the LoRA state as it was."""
        if lora_request is None:
            return None
        if not isinstance(lora_request, LoRARequest):
            fail("lora_request", "a LoRARequest or None", lora_request)
        return self.executor.check_lora(lora_request)

    def _tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        """(prompt text or None, token ids in [0, vocab_size))."""
        text, token_ids = parse_prompt(prompt)
        if text is not None:
            if self.tokenizer is None:
                raise ValueError(f"prompt is text but model folder {str(self.model_config.path)!r} has no tokenizer; "
                                 f"pass a list of token ids")
            try:
                token_ids = list(self.tokenizer.encode(text))
            except Exception as e:  # a lone surrogate: TypeError or a Rust exception from `tokenizers`
                raise ValueError(f"prompt text cannot be tokenized: {type(e).__name__}: {e}") from None
        if not token_ids:
            raise ValueError("prompt must have at least 1 token, got an empty prompt")
        bad = next((t for t in token_ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise ValueError(f"prompt token ids must be in [0, vocab_size={self.vocab_size}), got {bad}")
        return text, token_ids

    def _queue_abort(self, request_id: str | list[str]) -> None:
        self._pending_aborts.extend(_checked_ids(request_id))

    @guarded("abort_request()", when_busy=_queue_abort)
    def abort_request(self, request_id: str | list[str]) -> None:
        """Finish the request(s) as aborted and free their blocks; unknown or finished ids are ignored,
        and no output is returned for them. Safe from any thread: while the engine is busy (a step in
        another thread, or a call from inside a step) the aborts are queued and applied when the step
        ends."""
        for rid in _checked_ids(request_id):
            self._abort(rid)

    def _abort(self, request_id: str) -> None:
        if request_id in self.requests:  # forgotten last, so a half-done abort is finished by a later step
            # the next SchedulerOutput tells the runner (finished_req_ids)
            self.scheduler.finish_requests([request_id], RequestStatus.FINISHED_ABORTED)
            self.num_aborted += 1
            del self.requests[request_id]

    def _apply_pending_aborts(self) -> None:
        while self._pending_aborts:
            self._abort(self._pending_aborts.popleft())

    def has_unfinished_requests(self) -> bool:
        """True while a request is queued or running, or has a final output not yet returned."""
        return self.scheduler.has_unfinished_requests() or bool(self.requests) or bool(self._pending_aborts)

    # ---- one step ------------------------------------------------------------------------
    @guarded("step()")
    def step(self) -> list[RequestOutput]:
        """Schedule, run the forward, sample, update. Returns an output for every request that got
        a token this step (finished ones have `.finished` and, with a tokenizer, `.outputs[0].text`),
        and for every request whose step failed (finish_reason "error", `.error` says why).

        All-or-nothing: Ctrl-C waits for the step to end; an exception or interrupt part-way rolls the
        scheduler back to a consistent state (every running request is recomputed from its tokens) and
        propagates, its outputs unreturned; the next step reports requests it had finished."""
        self._apply_pending_aborts()
        try:
            outputs = self._step() if self.batch_queue_size == 1 else self._step_with_batch_queue()
        except BaseException:
            self._recover()
            raise
        self._apply_pending_aborts()  # those that came from inside the step
        return outputs

    def _step(self) -> list[RequestOutput]:
        t0 = time.perf_counter()
        before = self.scheduler.make_stats()
        if self.kv_offload is not None:
            self.kv_offload.before_schedule(r.request_id for r in self.scheduler.waiting)
        scheduler_output = self.scheduler.schedule()
        if self.kv_offload is not None:
            self.kv_offload.before_forward()
        model_runner_output = self.executor.execute_model(scheduler_output)
        counters = self.scheduler.counters
        counters.max_batches_in_flight = max(counters.max_batches_in_flight, 1)
        return self._apply_output(t0, before, scheduler_output, model_runner_output, len(scheduler_output.scheduled))

    def _step_with_batch_queue(self) -> list[RequestOutput]:
        """Schedule and send a batch if the queue has room; else, or if nothing could be scheduled, wait
        for the oldest batch in flight and apply its output (vLLM v1's `EngineCore.step_with_batch_queue`)."""
        t0 = time.perf_counter()
        before = self.scheduler.make_stats()
        num_scheduled = 0
        if len(self.batch_queue) < self.batch_queue_size:
            so = self.scheduler.schedule()
            num_scheduled = len(so.scheduled)
            if so.scheduled or so.finished_req_ids or so.preempted_request_ids or so.swap_out or so.swap_in:
                self.batch_queue.append((self.executor.execute_model(so, non_block=True), so))
                self.scheduler.in_flight.update(c.request.request_id for c in so.scheduled)
                counters = self.scheduler.counters
                counters.max_batches_in_flight = max(counters.max_batches_in_flight, len(self.batch_queue))
        if num_scheduled and len(self.batch_queue) < self.batch_queue_size or not self.batch_queue:
            self.scheduler.counters.step_time_s += time.perf_counter() - t0
            return []
        pending, so = self.batch_queue.popleft()
        model_runner_output = pending.result()
        self.scheduler.in_flight.difference_update(c.request.request_id for c in so.scheduled)
        return self._apply_output(t0, before, so, model_runner_output, len(so.scheduled))

    def _apply_output(self, t0: float, before: Any, scheduler_output: SchedulerOutput,
                      model_runner_output: Any, num_scheduled: int) -> list[RequestOutput]:
        """`update_from_output`, then the step's outputs and counters."""
        reported = self.scheduler.update_from_output(scheduler_output, model_runner_output)
        if self.kv_offload is not None:  # their blocks are free but still cached: copied before the next forward
            self.kv_offload.save_finished(r for r in reported if r.is_finished)
        if self._report_stragglers:  # finished by a failed step, not yet reported
            self._report_stragglers = False
            reported = [r for r, _ in self.requests.values() if r.is_finished and r not in reported] + reported
        outputs = [self.make_output(r, self.requests.get(r.request_id, (r, None))[1]) for r in reported]
        finished = [r.request_id for r in reported if r.is_finished]
        counters = self.scheduler.counters
        counters.num_steps += 1
        counters.step_time_s += time.perf_counter() - t0
        self.last_step = StepInfo.between(before, self.scheduler.make_stats(), num_scheduled)
        for rid in finished:  # last: a request leaves self.requests when its final output is returned
            self.requests.pop(rid, None)
        return outputs

    def _recover(self) -> None:
        """After a step raised part-way: every unfinished request requeued to be recomputed, holding no
        blocks (Scheduler.requeue_for_recompute), the runner's block tables and adapter slots forgotten to
        match, and the requests the step finished but did not report left for the next step to report."""
        self.batch_queue.clear()  # forget_all_requests reads the replies still in flight first
        if self.kv_offload is not None:
            self.kv_offload.reset()
        self.scheduler.in_flight.clear()
        self.scheduler.requeue_for_recompute()
        self.executor.forget_all_requests()
        self.scheduler.counters.num_failed_steps += 1
        self._report_stragglers = True

    def make_output(self, request: Request, prompt: str | None = None) -> RequestOutput:
        """The request's output now: tokens so far; on finishing, the text (decoded once) and why."""
        text = None
        if request.is_finished and self.tokenizer is not None:  # decode once, at the end
            text = self.tokenizer.decode(request.output_token_ids, skip_special_tokens=True)
        completion = CompletionOutput(0, list(request.output_token_ids), text, request.status.finish_reason)
        return RequestOutput(request.request_id, prompt, request.prompt_token_ids, [completion], request.is_finished,
                             request.metrics, request.num_cached_tokens, request.error)

    def stats(self) -> dict[str, float]:
        """The engine's numbers now (engine_core.metrics.stat_docs() says what each means); a parallel
        engine adds its workers' communication, summed over the ranks (`comm_*`: COMM_STAT_DOCS). `weight_bytes`:
        the model's weights as stored (quantized projections at their scheme's size), summed over the ranks;
        `weight_bytes_by_scheme` the same split by scheme (the projections) and dtype (the other tensors); the KV
        cache sized beside them: `num_gpu_blocks` blocks of `kv_block_bytes` (one rank's)."""
        kv = self.kv_cache_config
        offload = {} if self.kv_offload is None else self.kv_offload.stats()
        return {**self.scheduler.stats(), **offload, "weight_bytes": self.weight_bytes,
                "weight_bytes_by_scheme": dict(self.weight_bytes_by_scheme), "num_gpu_blocks": kv.num_gpu_blocks,
                "kv_block_bytes": kv.block_bytes,
                **{f"comm_{k}": v for k, v in self.executor.comm_stats().items()}}

    def shutdown(self) -> None:
        """Stop the worker processes of a parallel engine (nothing to stop with one process) and the offload
        tier's copy thread; idempotent."""
        self.executor.shutdown()
        if self.kv_offload is not None:
            self.kv_offload.shutdown()

    def prefetch(self, prompt: PromptType, lora_request: LoRARequest | None = None) -> int:
        """A client's hint that a session returns with `prompt`: start copying its offloaded blocks back now, so
        the request finds them in the device prefix cache. Returns the blocks whose copy started (0 without
        kv_offload_bytes)."""
        if self.kv_offload is None:
            return 0
        _, token_ids = self._tokenize(prompt)
        adapter = self._check_lora(lora_request)
        return self.kv_offload.prefetch(token_ids, None if adapter is None else adapter.lora_int_id)

    def prometheus_metrics(self) -> str:
        """The same numbers in Prometheus' text format, with vLLM's metric names and histograms (and the offload
        tier's counters with kv_offload_bytes)."""
        text = self.scheduler.make_stats().to_prometheus()
        return text if self.kv_offload is None else text + self.kv_offload.to_prometheus()


def _checked_ids(request_id: Any) -> list[str]:
    """vLLM's abort_request argument: one id or a list (tuple, set) of ids."""
    ids = [request_id] if isinstance(request_id, str) else request_id
    if not isinstance(ids, (list, tuple, set)) or not all(isinstance(r, str) for r in ids):
        fail("request_id", "a str or a list of str", request_id)
    return list(ids)
