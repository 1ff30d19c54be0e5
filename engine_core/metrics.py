"""Scheduler counters and latency histograms, named as vLLM's Prometheus metrics.

`Scheduler.stats()` returns a flat dict with the keys of `STAT_DOCS`; `PROMETHEUS_NAMES`
maps each to the vLLM metric it corresponds to, and `format_prometheus` writes the text
exposition format, so a dashboard built for vLLM reads these numbers unchanged.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from engine_core.request import Request

STAT_DOCS: dict[str, str] = {
    "num_requests_running": "requests holding GPU blocks (decoding or mid-prefill)",
    "num_requests_waiting": "requests waiting for admission, recompute-preempted ones included",
    "num_requests_swapped": "requests whose KV sits in the CPU swap pool",
    "kv_cache_usage": "fraction of GPU KV blocks in use, 0..1 (free cached blocks count as free)",
    "cpu_kv_cache_usage": "fraction of CPU swap blocks in use, 0..1",
    "num_preemptions": "preemptions so far, both modes",
    "num_preemptions_recompute": "preemptions that freed the KV (recomputed later)",
    "num_preemptions_swap": "preemptions that copied the KV to the CPU pool",
    "num_blocks_swapped_out": "GPU->CPU block copies planned",
    "num_blocks_swapped_in": "CPU->GPU block copies planned",
    "prefix_cache_queries": "tokens of admitted requests looked up in the prefix cache",
    "prefix_cache_hits": "of those, tokens served from the cache",
    "prefix_cache_hit_rate": "prefix_cache_hits / prefix_cache_queries (0 when no queries)",
    "num_prefill_tokens": "tokens computed that were not a decode step's single new token (prompts, recomputes)",
    "num_decode_tokens": "decode tokens computed (one per request per decode step)",
    "num_finished_requests": "requests that finished or were aborted",
}

PROMETHEUS_NAMES: dict[str, str] = {
    "num_requests_running": "vllm:num_requests_running",
    "num_requests_waiting": "vllm:num_requests_waiting",
    "num_requests_swapped": "vllm:num_requests_swapped",
    "kv_cache_usage": "vllm:gpu_cache_usage_perc",
    "cpu_kv_cache_usage": "vllm:cpu_cache_usage_perc",
    "num_preemptions": "vllm:num_preemptions_total",
    "prefix_cache_queries": "vllm:prefix_cache_queries_total",
    "prefix_cache_hits": "vllm:prefix_cache_hits_total",
    "num_prefill_tokens": "vllm:prompt_tokens_total",
    "num_decode_tokens": "vllm:generation_tokens_total",
}

# vLLM's buckets (seconds) for time to first token and time per output token.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0)
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)


@dataclass
class Histogram:
    """Cumulative-bucket histogram as Prometheus keeps it: counts per upper bound, plus sum and count."""

    buckets: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    total: float = 0.0
    count: int = 0

    def __post_init__(self) -> None:
        self.counts = [0] * (len(self.buckets) + 1)  # last: +Inf

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.total += value
        self.count += 1


@dataclass
class SchedulerCounters:
    """Monotonic counters the scheduler bumps as it works."""

    num_preemptions_recompute: int = 0
    num_preemptions_swap: int = 0
    num_blocks_swapped_out: int = 0
    num_blocks_swapped_in: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0
    num_finished_requests: int = 0
    ttft: Histogram = field(default_factory=lambda: Histogram(TTFT_BUCKETS))
    tpot: Histogram = field(default_factory=lambda: Histogram(TPOT_BUCKETS))

    def observe_finished(self, request: Request) -> None:
        """Record a finished request's TTFT and mean TPOT (when it produced the tokens to have them)."""
        self.num_finished_requests += 1
        ttft = request.metrics.ttft
        if ttft is not None:
            self.ttft.observe(ttft)
        tpot = request.metrics.mean_tpot(request.num_output_tokens)
        if tpot is not None:
            self.tpot.observe(tpot)


def format_prometheus(stats: dict[str, float]) -> str:
    """Prometheus text exposition of the stats that have a vLLM name."""
    lines = []
    for key, name in PROMETHEUS_NAMES.items():
        if key in stats:
            lines.append(f"# HELP {name} {STAT_DOCS[key]}")
            lines.append(f"{name} {float(stats[key])}")
    return "\n".join(lines) + "\n"
