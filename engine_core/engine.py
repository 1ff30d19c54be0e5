"""LLMEngine: requests in, one scheduler step + one forward per `step()`, RequestOutputs out.

Built in this order: parse the model folder once (`ModelConfig`), resolve every `auto` of the
EngineConfig once (`ResolvedConfig`), let the model runner load the weights and size the KV cache
(`KVCacheConfig`), allocate it, then build the Scheduler with its preemption cost model. Every
add_request check runs before any state changes, so a bad request is rejected without disturbing
the others.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Any

from engine_core.config import EngineConfig, KVCacheConfig, ResolvedConfig
from engine_core.core.cost_model import PreemptionCostModel
from engine_core.core.scheduler import Scheduler
from engine_core.lora.request import LoRARequest
from engine_core.metrics import StepInfo
from engine_core.models.config import ModelConfig
from engine_core.request import CompletionOutput, Request, RequestOutput, RequestStatus, SamplingParams
from engine_core.worker.model_runner import ModelRunner


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.model_config = ModelConfig.load(config.model)
        self.config = ResolvedConfig.resolve(config, self.model_config)
        self.runner = ModelRunner(self.config, self.model_config)
        self.kv_cache_config: KVCacheConfig = self.runner.determine_kv_cache_config()
        self.runner.initialize_kv_cache(self.kv_cache_config)
        self.cost_model = PreemptionCostModel.for_device(
            self.model_config.args.model_spec(), self.config.kv_cache_dtype, self.config.device.type,
            config.prefill_flops_per_s, config.swap_bandwidth_bytes_per_s)
        self.scheduler = Scheduler(self.config, self.kv_cache_config, self.cost_model)
        self.tokenizer = self.model_config.load_tokenizer()
        self.requests: dict[str, tuple[Request, str | None]] = {}  # unfinished: request, prompt text
        self.last_step = StepInfo()

    @classmethod
    def from_kwargs(cls, model: str, **kwargs: Any) -> "LLMEngine":
        return cls(EngineConfig.from_kwargs(model, **kwargs))

    @property
    def vocab_size(self) -> int:
        return self.model_config.args.vocab_size

    # ---- requests ------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: str | list[int], sampling_params: SamplingParams | None = None,
                    priority: int = 0, arrival_time: float | None = None,
                    lora_request: LoRARequest | None = None) -> Request:
        """Validate, then queue. Raises ValueError naming the parameter; nothing changes on error
        (an adapter folder checked on the way stays in the host cache, a cache of good folders)."""
        if not isinstance(request_id, str) or not request_id:
            raise ValueError(f"request_id must be a non-empty str, got {request_id!r}")
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use by an unfinished request")
        params = SamplingParams() if sampling_params is None else sampling_params
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params must be a SamplingParams or None, got {type(params).__name__}")
        token_ids = self._tokenize(prompt)
        limit = self.config.max_model_len
        if len(token_ids) + 1 > limit:
            raise ValueError(f"prompt has {len(token_ids)} tokens; with the first generated token it must fit "
                             f"max_model_len={limit}, so at most {limit - 1} prompt tokens are allowed")
        lora_id = self._check_lora(lora_request)
        eos = self.model_config.eos_token_ids
        if not params.ignore_eos and len(eos) > 1:  # extra EOS ids stop like stop tokens
            params = dataclasses.replace(params, stop_token_ids=params.stop_token_ids + list(eos[1:]))
        request = Request(request_id, token_ids, params, eos_token_id=eos[0] if eos else None,
                          arrival_time=arrival_time, priority=priority, lora_id=lora_id)
        self.scheduler.add_request(request)  # may reject (never fits the KV cache) before queuing
        self.requests[request_id] = (request, prompt if isinstance(prompt, str) else None)
        return request

    def add_lora(self, lora_request: LoRARequest) -> None:
        """vLLM's `add_lora`: check an adapter folder and load it into the host cache ahead of its requests."""
        self._check_lora(lora_request)

    def _check_lora(self, lora_request: LoRARequest | None) -> int | None:
        """The adapter's id once its folder passed every check (see engine_core.lora.adapter)."""
        if lora_request is None:
            return None
        if not isinstance(lora_request, LoRARequest):
            raise ValueError(f"lora_request must be a LoRARequest or None, got {type(lora_request).__name__}")
        if self.runner.lora is None:
            raise ValueError(f"lora_request {lora_request.lora_name!r} given, but the engine was built with "
                             f"enable_lora=False; pass enable_lora=True (with max_loras, max_lora_rank) to serve "
                             f"adapters")
        self.runner.lora.add_lora(lora_request)
        return lora_request.lora_int_id

    def _tokenize(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(f"prompt is text but model folder {str(self.model_config.path)!r} has no tokenizer; "
                                 f"pass a list of token ids")
            token_ids = self.tokenizer.encode(prompt)
        elif isinstance(prompt, (list, tuple)) and all(isinstance(t, int) for t in prompt):
            token_ids = list(prompt)
        else:
            raise ValueError(f"prompt must be a str or a list of int token ids, got {type(prompt).__name__}")
        if not token_ids:
            raise ValueError("prompt must have at least 1 token, got an empty prompt")
        bad = next((t for t in token_ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise ValueError(f"prompt token ids must be in [0, vocab_size={self.vocab_size}), got {bad}")
        return token_ids

    def abort_request(self, request_id: str) -> None:
        """Finish the request as aborted and free its blocks; unknown or finished ids are ignored."""
        if self.requests.pop(request_id, None) is not None:
            self.scheduler.finish_requests([request_id], RequestStatus.FINISHED_ABORTED)
            self.runner.remove_requests([request_id])

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    # ---- one step ------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedule, run the forward, sample, update. Returns an output for every request that got
        a token this step (finished ones have `.finished` and, with a tokenizer, `.outputs[0].text`)."""
        t0 = time.perf_counter()
        before = self.scheduler.make_stats()
        scheduled = self.scheduler.schedule()
        sampled = self.runner.execute_model(scheduled)
        got = self.scheduler.update_from_output(scheduled, sampled)
        outputs = [self._output(r) for r in got]
        finished = [r.request_id for r in got if r.is_finished]
        for rid in finished:
            self.requests.pop(rid, None)
        self.runner.remove_requests(finished)
        counters = self.scheduler.counters
        counters.num_steps += 1
        counters.step_time_s += time.perf_counter() - t0
        self.last_step = StepInfo.between(before, self.scheduler.make_stats(), len(scheduled.scheduled))
        return outputs

    def _output(self, request: Request) -> RequestOutput:
        prompt = self.requests[request.request_id][1] if request.request_id in self.requests else None
        text = None
        if request.is_finished and self.tokenizer is not None:  # decode once, at the end
            text = self.tokenizer.decode(request.output_token_ids, skip_special_tokens=True)
        completion = CompletionOutput(0, list(request.output_token_ids), text, request.status.finish_reason)
        return RequestOutput(request.request_id, prompt, request.prompt_token_ids, [completion], request.is_finished,
                             request.metrics, request.num_cached_tokens)

    def stats(self) -> dict[str, float]:
        """The engine's numbers now (engine_core.metrics.stat_docs() says what each means)."""
        return self.scheduler.stats()

    def prometheus_metrics(self) -> str:
        """The same numbers in Prometheus' text format, with vLLM's metric names and histograms."""
        return self.scheduler.make_stats().to_prometheus()
