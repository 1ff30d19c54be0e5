"""Requests and their outputs: the state machine the scheduler drives.

A request only knows how many of its tokens have KV in the cache
(`num_computed_tokens`); the scheduler makes that number catch up with
`num_tokens`. There are no separate prefill and decode phases.
"""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from engine_core.validation import SEED_RANGE, check_bool, check_int, check_int_list, check_real


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2  # blocks freed; waits at the front of the queue to be recomputed
    SWAPPED = 3  # blocks copied to the CPU swap pool; waits to be swapped back in
    FINISHED_STOPPED = 4  # EOS or a stop token
    FINISHED_LENGTH_CAPPED = 5  # max_tokens or max_model_len
    FINISHED_ABORTED = 6
    FINISHED_ERROR = 7  # its step raised (a fault in its forward, NaN logits): see Request.error

    @property
    def is_finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> str | None:
        return {
            RequestStatus.FINISHED_STOPPED: "stop",
            RequestStatus.FINISHED_LENGTH_CAPPED: "length",
            RequestStatus.FINISHED_ABORTED: "abort",
            RequestStatus.FINISHED_ERROR: "error",
        }.get(self)


# Temperatures below this sample greedily (vLLM's _SAMPLING_EPS): logits / T would overflow to inf
# and the softmax to NaN long before T reaches 0.
GREEDY_TEMPERATURE = 1e-5


@dataclass
class SamplingParams:
    """How to pick tokens. temperature 0 (below 1e-5) is greedy; seed makes sampling reproducible
    per request. Checked when built and again (on a copy) when a request is added, so a field
    changed in between is caught before it reaches a step."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0  # 0 or -1: off
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        self.max_tokens = check_int("max_tokens", self.max_tokens, 1)
        self.temperature = check_real("temperature", self.temperature, 0.0, hint="0 = greedy")
        self.top_k = check_int("top_k", self.top_k, -1, hint="0 or -1 = off")
        self.top_p = check_real("top_p", self.top_p, 0.0, 1.0, lo_open=True)
        self.seed = check_int("seed", self.seed, *SEED_RANGE, optional=True)
        self.stop_token_ids = check_int_list("stop_token_ids", self.stop_token_ids, 0)
        self.ignore_eos = check_bool("ignore_eos", self.ignore_eos)

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE


@dataclass
class RequestMetrics:
    """Wall-clock timestamps (time.monotonic seconds) of one request's life."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None

    @property
    def ttft(self) -> float | None:
        """Time to first token: arrival to the first generated token."""
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    def mean_tpot(self, num_output_tokens: int) -> float | None:
        """The request's TPOT: (last token - first token) / (n - 1), the mean of its inter-token gaps."""
        if num_output_tokens < 2 or self.first_token_time is None or self.last_token_time is None:
            return None
        return (self.last_token_time - self.first_token_time) / (num_output_tokens - 1)


class Request:
    """One generation request and everything the engine tracks for it (block ids live in the KVCacheManager)."""

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_id: int | None = None,
        arrival_time: float | None = None,
        priority: int = 0,
        lora_id: int | None = None,
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_id = eos_token_id
        self.priority = priority  # lower value = more important (vLLM's convention)
        self.lora_id = lora_id
        self.output_token_ids: list[int] = []
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0  # prompt tokens served by the prefix cache at admission
        self.num_preemptions = 0
        self.metrics = RequestMetrics(arrival_time=time.monotonic() if arrival_time is None else arrival_time)
        self.error: str | None = None  # why it finished with FINISHED_ERROR

    @property
    def arrival_time(self) -> float:
        return self.metrics.arrival_time

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def append_token(self, token_id: int, now: float) -> None:
        if self.metrics.first_token_time is None:
            self.metrics.first_token_time = now
        self.metrics.last_token_time = now
        self.output_token_ids.append(token_id)

    def check_stop(self, max_model_len: int) -> RequestStatus | None:
        """The finished status this request has reached after its last token, or None."""
        sp = self.sampling_params
        last = self.output_token_ids[-1] if self.output_token_ids else None
        if last is not None and ((not sp.ignore_eos and last == self.eos_token_id) or last in sp.stop_token_ids):
            return RequestStatus.FINISHED_STOPPED
        if self.num_output_tokens >= sp.max_tokens or self.num_tokens >= max_model_len:
            return RequestStatus.FINISHED_LENGTH_CAPPED
        return None

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, status={self.status.name}, prompt={self.num_prompt_tokens}, "
                f"output={self.num_output_tokens}, computed={self.num_computed_tokens})")


@dataclass
class CompletionOutput:
    index: int
    token_ids: list[int]
    text: str | None
    finish_reason: str | None


@dataclass
class RequestOutput:
    """vLLM's shape: `.outputs[0].token_ids`, `.outputs[0].text`, `.finished`, `.metrics`."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    num_cached_tokens: int = 0
    error: str | None = None  # with finish_reason "error": what failed, naming the request
