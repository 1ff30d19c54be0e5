"""The engine's numbers in one type, `Stats`, named as vLLM's Prometheus metrics.

Each field is documented where it is declared (its metadata carries the doc and, when vLLM v1 has
the metric, the Prometheus name: a field carries a name only if it counts what vLLM's metric counts,
as `vllm/v1/metrics/loggers.py` and `stats.py` of vLLM 0.32 record it). Everything else is derived
from it: `Stats.as_dict()` is what `LLMEngine.stats()` / `Scheduler.stats()` return,
`Stats.to_prometheus()` the text exposition (histograms included), and `StepInfo.between(before,
after)` what one step did. So "decode token" and every other count has exactly one definition:
where the scheduler bumps it.

Renamed in vLLM and exported here under the new name only: `vllm:gpu_cache_usage_perc` (deprecated in
0.9, gone by 0.32) is `vllm:kv_cache_usage_perc`; `vllm:time_per_output_token_seconds`, which despite
its name recorded every gap between two tokens, is `vllm:inter_token_latency_seconds` since 0.11, and
the per-request mean is `vllm:request_time_per_output_token_seconds`.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass, field, fields, replace
from typing import Any

from engine_core.request import Request

# vLLM's buckets (seconds), cut at 10 s and 2.5 s: time to first token, and inter-token latency (which
# vLLM also uses for the per-request time per output token).
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)


def _stat(doc: str, prometheus: str | None = None, kind: str = "counter", default: Any = 0) -> Any:
    return field(default=default, metadata={"doc": doc, "prometheus": prometheus, "kind": kind})


@dataclass
class Histogram:
    """Cumulative-bucket histogram as Prometheus keeps it: counts per upper bound, plus sum and count."""

    buckets: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    total: float = 0.0
    count: int = 0

    def __post_init__(self) -> None:
        if not self.counts:
            self.counts = [0] * (len(self.buckets) + 1)  # last: +Inf

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.total += value
        self.count += 1

    def copy(self) -> "Histogram":
        return Histogram(self.buckets, list(self.counts), self.total, self.count)


@dataclass
class Stats:
    """Gauges are the state when the snapshot was taken; counters only grow."""

    num_requests_running: int = _stat("requests holding GPU blocks (decoding or mid-prefill)",
                                      "vllm:num_requests_running", "gauge")
    num_requests_waiting: int = _stat("requests waiting for admission, recompute-preempted ones included",
                                      "vllm:num_requests_waiting", "gauge")
    num_requests_swapped: int = _stat("requests whose KV sits in the CPU swap pool (vLLM v0's metric)",
                                      "vllm:num_requests_swapped", "gauge")
    kv_cache_usage: float = _stat("fraction of GPU KV blocks in use, 0..1 (free cached blocks count as free)",
                                  "vllm:kv_cache_usage_perc", "gauge", 0.0)
    cpu_kv_cache_usage: float = _stat("fraction of CPU swap blocks in use, 0..1 (vLLM v0's metric)",
                                      "vllm:cpu_cache_usage_perc", "gauge", 0.0)
    num_preemptions_recompute: int = _stat("preemptions that freed the KV (recomputed later)")
    num_preemptions_swap: int = _stat("preemptions that copied the KV to the CPU pool")
    num_blocks_swapped_out: int = _stat("GPU->CPU block copies planned")
    num_blocks_swapped_in: int = _stat("CPU->GPU block copies planned")
    num_blocks_out_of_window: int = _stat("GPU blocks freed as they fell out of the model's sliding window")
    num_blocks_evicted: int = _stat("GPU blocks freed by kv_eviction (StreamingLLM / H2O) to keep a request within "
                                    "kv_budget_tokens")
    prefix_cache_queries: int = _stat("tokens of admitted requests looked up in the prefix cache",
                                      "vllm:prefix_cache_queries_total")
    prefix_cache_hits: int = _stat("of those, tokens served from the cache", "vllm:prefix_cache_hits_total")
    num_prompt_tokens: int = _stat("prompt tokens of the requests that got their first token, each prompt counted "
                                   "once, prefix-cached tokens included", "vllm:prompt_tokens_total")
    num_prefill_tokens: int = _stat("tokens computed that were not a decode token (prompts less their cached "
                                    "tokens, recomputed tokens)")
    num_decode_tokens: int = _stat("decode tokens computed: the single token of a one-token chunk of a request "
                                   "that already has output")
    num_finished_requests: int = _stat("requests that finished or were aborted")
    num_failed_requests: int = _stat("of those, requests finished with an error (finish_reason 'error')")
    num_failed_steps: int = _stat("steps that raised and were rolled back (their requests recomputed)")
    num_steps: int = _stat("engine steps run")
    max_batches_in_flight: int = _stat("most scheduled steps in flight at once: up to pipeline_parallel_size with "
                                       "the batch queue, 1 otherwise (0 before the first step)")
    num_generated_tokens: int = _stat("tokens sampled and appended to a request's output, each request's first "
                                      "included", "vllm:generation_tokens_total")
    step_time_s: float = _stat("wall seconds spent in engine steps", default=0.0)
    spec_decode_num_drafts: int = _stat("speculative decoding: decodes that carried draft tokens",
                                        "vllm:spec_decode_num_drafts_total")
    spec_decode_num_draft_tokens: int = _stat("draft tokens verified", "vllm:spec_decode_num_draft_tokens_total")
    spec_decode_num_accepted_tokens: int = _stat("of those, accepted", "vllm:spec_decode_num_accepted_tokens_total")
    # accepted drafts by position in their draft (0: the first): position j's rate is [j] / num_drafts
    spec_decode_num_accepted_tokens_per_pos: list[int] = field(
        default_factory=list, metadata={"doc": "accepted draft tokens per draft position", "kind": "per_pos",
                                        "prometheus": "vllm:spec_decode_num_accepted_tokens_per_pos_total"})
    ttft: Histogram = field(default_factory=lambda: Histogram(TTFT_BUCKETS),
                            metadata={"doc": "time to first token, seconds", "kind": "histogram",
                                      "prometheus": "vllm:time_to_first_token_seconds"})
    itl: Histogram = field(default_factory=lambda: Histogram(ITL_BUCKETS),
                           metadata={"doc": "inter-token latency: every gap between two consecutive tokens of a "
                                            "request, seconds", "kind": "histogram",
                                     "prometheus": "vllm:inter_token_latency_seconds"})
    tpot: Histogram = field(default_factory=lambda: Histogram(ITL_BUCKETS),
                            metadata={"doc": "time per output token, one per finished request with 2 or more tokens: "
                                             "(last token - first token) / (n - 1), seconds", "kind": "histogram",
                                      "prometheus": "vllm:request_time_per_output_token_seconds"})

    @property
    def num_preemptions(self) -> int:
        return self.num_preemptions_recompute + self.num_preemptions_swap

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0

    @property
    def spec_decode_mean_acceptance_length(self) -> float:
        """Tokens emitted per verified draft: 1 + accepted / drafts (vLLM's mean acceptance length)."""
        if not self.spec_decode_num_drafts:
            return 0.0
        return 1 + self.spec_decode_num_accepted_tokens / self.spec_decode_num_drafts

    def observe_drafts(self, num_draft_tokens: int, num_accepted: int) -> None:
        """Count one verified draft of `num_draft_tokens` tokens whose first `num_accepted` were accepted."""
        self.spec_decode_num_drafts += 1
        self.spec_decode_num_draft_tokens += num_draft_tokens
        self.spec_decode_num_accepted_tokens += num_accepted
        per_pos = self.spec_decode_num_accepted_tokens_per_pos
        per_pos.extend([0] * (num_draft_tokens - len(per_pos)))
        for j in range(num_accepted):
            per_pos[j] += 1

    @property
    def generation_tokens_per_s(self) -> float:
        return self.num_generated_tokens / self.step_time_s if self.step_time_s else 0.0

    def observe_token(self, request: Request, now: float) -> None:
        """Count a token sampled for `request` at `now`, before it is appended: its first token counts the
        prompt (once, as vLLM does when a request leaves prefill), every later one records its gap."""
        self.num_generated_tokens += 1
        last = request.metrics.last_token_time
        if last is None:
            self.num_prompt_tokens += len(request.prompt_token_ids)
        else:
            self.itl.observe(now - last)

    def observe_finished(self, request: Request) -> None:
        """Count a finished request and record its TTFT and TPOT (when it has them: vLLM records a TPOT of 0
        for a request of one token, which would drag the mean down; here it records none)."""
        self.num_finished_requests += 1
        ttft = request.metrics.ttft
        if ttft is not None:
            self.ttft.observe(ttft)
        tpot = request.metrics.mean_tpot(request.num_output_tokens)
        if tpot is not None:
            self.tpot.observe(tpot)

    def snapshot(self, **gauges: float) -> "Stats":
        """A copy with the gauges set: later bumps of this object do not change it."""
        return replace(self, ttft=self.ttft.copy(), itl=self.itl.copy(), tpot=self.tpot.copy(),
                       spec_decode_num_accepted_tokens_per_pos=list(self.spec_decode_num_accepted_tokens_per_pos),
                       **gauges)

    def as_dict(self) -> dict[str, float]:
        """Every scalar field, plus the derived num_preemptions, prefix_cache_hit_rate, generation_tokens_per_s,
        spec_decode_mean_acceptance_length."""
        out: dict[str, float] = {f.name: getattr(self, f.name) for f in fields(self)
                                 if f.metadata["kind"] not in ("histogram", "per_pos")}
        out.update(num_preemptions=self.num_preemptions, prefix_cache_hit_rate=self.prefix_cache_hit_rate,
                   generation_tokens_per_s=self.generation_tokens_per_s,
                   spec_decode_mean_acceptance_length=self.spec_decode_mean_acceptance_length)
        return out

    def to_prometheus(self) -> str:
        """The text exposition format of every field vLLM has a metric for (histograms as _bucket/_sum/_count)."""
        lines = ["# HELP vllm:num_preemptions_total preemptions so far, both modes",
                 "# TYPE vllm:num_preemptions_total counter", f"vllm:num_preemptions_total {float(self.num_preemptions)}"]
        for f in fields(self):
            name, kind = f.metadata.get("prometheus"), f.metadata["kind"]
            if name is None:
                continue
            lines += [f"# HELP {name} {f.metadata['doc']}", f"# TYPE {name} {kind}"]
            value = getattr(self, f.name)
            if kind == "per_pos":
                lines[-1] = f"# TYPE {name} counter"
                lines += [f'{name}{{position="{j}"}} {float(n)}' for j, n in enumerate(value)]
                continue
            if kind != "histogram":
                lines.append(f"{name} {float(value)}")
                continue
            cumulative = 0
            for bound, count in zip([*map(str, value.buckets), "+Inf"], value.counts):
                cumulative += count
                lines.append(f'{name}_bucket{{le="{bound}"}} {cumulative}')
            lines += [f"{name}_sum {value.total}", f"{name}_count {value.count}"]
        return "\n".join(lines) + "\n"


def stat_docs() -> dict[str, str]:
    """Key of `Stats.as_dict()` -> what it means."""
    docs = {f.name: f.metadata["doc"] for f in fields(Stats) if f.metadata["kind"] not in ("histogram", "per_pos")}
    docs.update(num_preemptions="preemptions so far, both modes",
                spec_decode_mean_acceptance_length="tokens emitted per verified draft, 1 + accepted / drafts "
                                                   "(0 without drafts)",
                prefix_cache_hit_rate="prefix_cache_hits / prefix_cache_queries (0 when no queries)",
                generation_tokens_per_s="num_generated_tokens / step_time_s")
    return docs


@dataclass(frozen=True)
class StepInfo:
    """What one step did, as the difference of the stats after and before it (the demo plots these)."""

    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0
    num_seqs: int = 0  # sequences in the step's batch
    kv_cache_usage: float = 0.0  # after the step
    duration_s: float = 0.0

    @classmethod
    def between(cls, before: Stats, after: Stats, num_seqs: int) -> "StepInfo":
        return cls(after.num_prefill_tokens - before.num_prefill_tokens,
                   after.num_decode_tokens - before.num_decode_tokens, num_seqs, after.kv_cache_usage,
                   after.step_time_s - before.step_time_s)
