"""The Prometheus names the engine exports are vLLM v1's, and each counts what vLLM's counts (as
`vllm/v1/metrics/loggers.py` and `stats.py` of vLLM 0.32 record them): prompt tokens once per request,
cached ones included; generation tokens with each request's first; every inter-token gap under the ITL
name; one mean per finished request under the request-TPOT name."""
import itertools
import re
from types import SimpleNamespace

import pytest
from grader.harness import FakeRunner, make_request, make_scheduler

import engine_core.core.scheduler as scheduler_module
from engine_core.metrics import ITL_BUCKETS, Histogram, Stats

VLLM_V1_NAMES = {
    "vllm:num_requests_running": "gauge", "vllm:num_requests_waiting": "gauge",
    "vllm:kv_cache_usage_perc": "gauge", "vllm:prefix_cache_queries_total": "counter",
    "vllm:prefix_cache_hits_total": "counter", "vllm:num_preemptions_total": "counter",
    "vllm:prompt_tokens_total": "counter", "vllm:generation_tokens_total": "counter",
    "vllm:time_to_first_token_seconds": "histogram", "vllm:inter_token_latency_seconds": "histogram",
    "vllm:request_time_per_output_token_seconds": "histogram",
    "vllm:spec_decode_num_drafts_total": "counter", "vllm:spec_decode_num_draft_tokens_total": "counter",
    "vllm:spec_decode_num_accepted_tokens_total": "counter",
    "vllm:spec_decode_num_accepted_tokens_per_pos_total": "counter",  # prometheus_client adds vLLM's `_total`
}
V0_ONLY = {"vllm:num_requests_swapped": "gauge", "vllm:cpu_cache_usage_perc": "gauge"}  # this engine swaps, as v0
RENAMED = ("vllm:gpu_cache_usage_perc", "vllm:time_per_output_token_seconds")


def exported(text: str) -> dict[str, str]:
    return dict(re.findall(r"^# TYPE (\S+) (\S+)$", text, flags=re.M))


def test_exported_names_are_vllm_v1s_and_not_the_renamed_ones():
    text = Stats().to_prometheus()
    assert exported(text) == VLLM_V1_NAMES | V0_ONLY
    for old in RENAMED:
        assert old not in text, f"{old} was renamed in vLLM; export the new name only"


def run(sched, requests, clock):
    """Run to the end under a fake clock; each request's token times, read as the tokens arrive."""
    runner = FakeRunner.for_scheduler(sched)
    for r in requests:
        sched.add_request(r)
    times = {r.request_id: [] for r in requests}
    while sched.has_unfinished_requests():
        out = sched.schedule()
        for r in sched.update_from_output(out, runner.execute(out)):
            times[r.request_id].append(r.metrics.last_token_time)
        clock.tick()
    return times


class Clock:
    """time.monotonic for the scheduler: 1/32 s per step, plus `stall` seconds once, at step `stall_at`."""

    def __init__(self, stall_at: int = -1, stall: float = 0.0) -> None:
        self.now, self.steps, self.stall_at, self.stall = 0.0, itertools.count(), stall_at, stall

    def tick(self) -> None:
        self.now += 1 / 32 + (self.stall if next(self.steps) == self.stall_at else 0.0)

    def monotonic(self) -> float:
        return self.now


def test_prompt_tokens_count_each_prompt_once_and_generation_tokens_include_the_first(monkeypatch):
    """Prefix-cache hits and recompute after preemption change the tokens computed, not the prompt tokens."""
    clock = Clock()
    monkeypatch.setattr(scheduler_module, "time", SimpleNamespace(monotonic=clock.monotonic))
    sched = make_scheduler(num_gpu_blocks=10, enable_prefix_caching=True)
    shared = list(range(1, 9))  # two full blocks of 4, cached after the first request computes them
    requests = [make_request(f"r{i}", shared + [20 + i] * 4, max_tokens=12, arrival=0.0) for i in range(3)]
    times = run(sched, requests, clock)
    s = sched.stats()
    assert s["num_preemptions"] > 0 and s["prefix_cache_hits"] > 0, s  # the workload exercises both
    prompts = sum(len(r.prompt_token_ids) for r in requests)
    outputs = sum(len(r.output_token_ids) for r in requests)
    assert s["num_prompt_tokens"] == prompts == 36
    assert s["num_prefill_tokens"] != prompts  # what the engine computed: less the hits, plus the recompute
    assert s["num_generated_tokens"] == outputs == sum(map(len, times.values())) == 36
    text = sched.make_stats().to_prometheus()
    assert "vllm:prompt_tokens_total 36.0" in text and "vllm:generation_tokens_total 36.0" in text


def test_itl_records_every_gap_and_request_tpot_one_mean_per_request(monkeypatch):
    """A long step stalls every stream once: the ITL histogram holds that gap; each request's TPOT
    averages it with the rest. Expected values come from the token times read as the tokens arrived."""
    clock = Clock(stall_at=6, stall=0.5)
    monkeypatch.setattr(scheduler_module, "time", SimpleNamespace(monotonic=clock.monotonic))
    sched = make_scheduler(num_gpu_blocks=64)
    requests = [make_request(f"r{i}", 5, max_tokens=n, arrival=0.0) for i, n in enumerate((1, 12, 20))]
    times = run(sched, requests, clock)
    gaps = [b - a for t in times.values() for a, b in zip(t, t[1:])]
    want = Histogram(ITL_BUCKETS)
    for g in gaps:
        want.observe(g)
    itl, tpot = sched.counters.itl, sched.counters.tpot
    assert (itl.counts, itl.count) == (want.counts, 11 + 19)
    assert itl.total == pytest.approx(sum(gaps), rel=1e-12)
    assert sum(g > 0.5 for g in gaps) == 2  # the stall, in both streams still decoding
    means = [(t[-1] - t[0]) / (len(t) - 1) for t in times.values() if len(t) > 1]  # r0 has one token: no TPOT
    assert tpot.count == 2 and tpot.total == pytest.approx(sum(means), rel=1e-12)
    assert max(means) < 0.1 < max(gaps)  # the mean hides the stall the gaps show
    text = sched.make_stats().to_prometheus()
    assert "vllm:inter_token_latency_seconds_count 30" in text
    assert "vllm:request_time_per_output_token_seconds_count 2" in text
