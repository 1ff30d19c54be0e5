"""Scheduler rules (no preemption here): token budget, chunked prefill, admission, finishing."""
import pytest
from grader.harness import EOS, FakeRunner, make_request, make_scheduler, reference_output, run_to_completion

from engine_core.metrics import stat_docs
from engine_core.core.scheduler_output import SchedulerOutput
from engine_core.request import RequestStatus


def planned(out):
    return [(c.request.request_id, c.start, c.num_tokens) for c in out.scheduled]


def step(sched, runner):
    out = sched.schedule()
    return out, sched.update_from_output(out, runner.execute(out))


def runner_for(sched):
    return FakeRunner.for_scheduler(sched)


def test_request_that_can_never_fit_is_rejected_when_added():
    sched = make_scheduler(num_gpu_blocks=4, block_size=4)  # 16 token slots
    with pytest.raises(ValueError, match=r"prompt 14 \+ max_tokens 4 .* 18 tokens need 5 blocks.*num_gpu_blocks=4"):
        sched.add_request(make_request("big", 14, max_tokens=4))
    assert not sched.has_unfinished_requests() and not sched.waiting
    sched.add_request(make_request("fits", 12, max_tokens=4))  # exactly 16 tokens: 4 blocks
    assert sched.get_num_unfinished_requests() == 1


def test_max_tokens_beyond_max_model_len_is_capped_when_checking_fit():
    sched = make_scheduler(num_gpu_blocks=4, block_size=4, max_model_len=16)
    sched.add_request(make_request("a", 10, max_tokens=100))
    assert run_to_completion(sched)["a"] == reference_output(list(range(1, 11)), 100, eos=None, max_model_len=16)


def test_prompt_longer_than_max_model_len_and_duplicate_ids_are_rejected():
    sched = make_scheduler(num_gpu_blocks=64, max_model_len=32)
    with pytest.raises(ValueError, match=r"prompt length must be in \[1, max_model_len=32\], got 33"):
        sched.add_request(make_request("a", 33))
    sched.add_request(make_request("a", 3))
    with pytest.raises(ValueError, match="already in the scheduler"):
        sched.add_request(make_request("a", 3))


def test_chunked_prefill_splits_a_prompt_across_steps_under_the_budget():
    sched = make_scheduler(num_gpu_blocks=32, max_num_batched_tokens=8)
    runner = runner_for(sched)
    sched.add_request(make_request("a", 10, max_tokens=3))
    sched.add_request(make_request("b", 3, max_tokens=3))
    out, got = step(sched, runner)
    assert planned(out) == [("a", 0, 8)] and got == []
    assert sched.running[0].num_computed_tokens == 8
    out, got = step(sched, runner)
    assert planned(out) == [("a", 8, 2), ("b", 0, 3)]  # the running chunk first, then admission
    assert [r.request_id for r in got] == ["a", "b"]
    out, _ = step(sched, runner)
    assert planned(out) == [("a", 10, 1), ("b", 3, 1)]  # two decodes


def test_schedule_does_not_advance_num_computed_tokens():
    sched = make_scheduler(num_gpu_blocks=8)
    req = make_request("a", 5)
    sched.add_request(req)
    out = sched.schedule()
    assert req.num_computed_tokens == 0 and out.scheduled[0].start == 0
    assert out.scheduled[0].new_block_ids == sched.kv_cache_manager.get_block_ids("a") == [0, 1]
    assert out.scheduled[0].resumed  # the runner has never seen "a": the chunk carries the whole table
    assert req.metrics.first_scheduled_time is not None and req.status == RequestStatus.RUNNING


def test_chunks_hand_over_only_new_block_ids():
    """A running request's chunks carry the blocks appended since its last chunk; after a recompute
    preemption the table is new, so its next chunk carries the whole table again (resumed)."""
    sched = make_scheduler(num_gpu_blocks=8, max_num_batched_tokens=8)
    runner = runner_for(sched)
    sched.add_request(make_request("a", 7, max_tokens=6))
    handed = []
    for _ in range(4):
        out, _ = step(sched, runner)
        c = out.scheduled[0]
        handed.append((c.start, c.num_tokens, c.new_block_ids, c.resumed))
    # 7 prompt tokens (blocks 0, 1), decode at 7 (no new block), at 8 (block 2), at 9 (none)
    assert handed == [(0, 7, [0, 1], True), (7, 1, [], False), (8, 1, [2], False), (9, 1, [], False)]
    plan = SchedulerOutput()
    sched._preempt(plan)  # recompute: blocks freed, a is waiting again
    out, _ = step(sched, runner)
    c = out.scheduled[0]
    assert (c.start, c.resumed) == (0, True) and c.new_block_ids == sched.kv_cache_manager.get_block_ids("a")


def test_long_prefill_token_threshold_caps_one_request_per_step():
    sched = make_scheduler(num_gpu_blocks=32, max_num_batched_tokens=32, long_prefill_token_threshold=5)
    sched.add_request(make_request("a", 12))
    sched.add_request(make_request("b", 4))
    assert planned(sched.schedule()) == [("a", 0, 5), ("b", 0, 4)]


def test_without_chunked_prefill_a_prompt_waits_for_a_step_with_room():
    sched = make_scheduler(num_gpu_blocks=32, max_num_batched_tokens=8, max_model_len=8,
                           enable_chunked_prefill=False)
    runner = runner_for(sched)
    sched.add_request(make_request("a", 6, max_tokens=2))
    sched.add_request(make_request("b", 3, max_tokens=2))
    out, _ = step(sched, runner)
    assert planned(out) == [("a", 0, 6)]  # b's 3 tokens exceed the 2 left: it waits (FCFS, not chunked)
    out, _ = step(sched, runner)
    assert planned(out) == [("a", 6, 1), ("b", 0, 3)]


def test_without_chunked_prefill_a_prompt_longer_than_the_budget_still_runs():
    # documented choice: the budget is raised to max_model_len
    sched = make_scheduler(num_gpu_blocks=32, max_num_batched_tokens=4, max_model_len=40, enable_chunked_prefill=False)
    sched.add_request(make_request("a", 20, max_tokens=2))
    assert planned(sched.schedule()) == [("a", 0, 20)]


def test_max_num_seqs_limits_admission():
    sched = make_scheduler(num_gpu_blocks=32, max_num_seqs=2)
    for rid in "abc":
        sched.add_request(make_request(rid, 2))
    assert [rid for rid, _, _ in planned(sched.schedule())] == ["a", "b"]
    assert sched.stats()["num_requests_waiting"] == 1


def test_admission_is_fcfs_a_request_that_does_not_fit_blocks_later_ones():
    sched = make_scheduler(num_gpu_blocks=6, block_size=4, max_num_batched_tokens=64)
    runner = runner_for(sched)
    sched.add_request(make_request("a", 12, max_tokens=8))  # 3 blocks now
    sched.add_request(make_request("b", 16, max_tokens=4))  # 4 blocks: does not fit beside a
    sched.add_request(make_request("c", 2, max_tokens=2))  # would fit, but must not overtake b
    out, _ = step(sched, runner)
    assert [rid for rid, _, _ in planned(out)] == ["a"]
    assert [r.request_id for r in sched.waiting] == ["b", "c"]


def test_update_returns_requests_that_got_a_token_and_finishes_them():
    sched = make_scheduler(num_gpu_blocks=16)
    runner = runner_for(sched)
    sched.add_request(make_request("a", 3, max_tokens=1))
    sched.add_request(make_request("b", 3, max_tokens=2))
    _, got = step(sched, runner)
    assert [(r.request_id, r.status) for r in got] == [("a", RequestStatus.FINISHED_LENGTH_CAPPED),
                                                       ("b", RequestStatus.RUNNING)]
    assert sched.get_num_unfinished_requests() == 1 and got[0].metrics.finished_time is not None
    _, got = step(sched, runner)
    assert got[0].is_finished and not sched.has_unfinished_requests()
    assert sched.kv_cache_manager.usage == 0.0


def test_eos_stops_a_request():
    prompts = {f"r{i}": [i + 1, 2 * i + 3] for i in range(20)}
    sched = make_scheduler(num_gpu_blocks=64)
    for rid, p in prompts.items():
        sched.add_request(make_request(rid, p, max_tokens=40, eos=EOS))
    outs = run_to_completion(sched)
    assert outs == {rid: reference_output(p, 40, EOS) for rid, p in prompts.items()}
    assert any(o[-1] == EOS and len(o) < 40 for o in outs.values())  # the workload does exercise EOS


def test_abort_frees_blocks_everywhere_and_ignores_unknown_ids():
    sched = make_scheduler(num_gpu_blocks=16, max_num_seqs=1)
    runner = runner_for(sched)
    sched.add_request(make_request("a", 5))
    sched.add_request(make_request("b", 5))
    step(sched, runner)
    sched.finish_requests(["a", "b", "nope"], RequestStatus.FINISHED_ABORTED)
    assert not sched.has_unfinished_requests() and not sched.running and not sched.waiting
    assert sched.kv_cache_manager.usage == 0.0
    with pytest.raises(ValueError, match="FINISHED_"):
        sched.finish_requests("a", RequestStatus.RUNNING)


def test_abort_between_schedule_and_update_drops_the_chunk():
    sched = make_scheduler(num_gpu_blocks=16)
    runner = runner_for(sched)
    sched.add_request(make_request("a", 5))
    out = sched.schedule()
    sampled = runner.execute(out)
    sched.finish_requests("a", RequestStatus.FINISHED_ABORTED)
    assert sched.update_from_output(out, sampled) == []


def test_stats_keys_are_documented_and_exported():
    sched = make_scheduler(num_gpu_blocks=16)
    sched.add_request(make_request("a", 5))
    stats = sched.stats()
    assert stats.keys() == stat_docs().keys()
    assert stats["num_requests_waiting"] == 1 and stats["kv_cache_usage"] == 0.0
    text = sched.make_stats().to_prometheus()
    assert "vllm:num_requests_swapped 0.0" in text and "vllm:num_requests_waiting 1.0" in text
    assert 'vllm:time_to_first_token_seconds_bucket{le="+Inf"} 0' in text


def test_prefill_and_decode_tokens_are_counted():
    sched = make_scheduler(num_gpu_blocks=16)
    sched.add_request(make_request("a", 5, max_tokens=4))
    run_to_completion(sched)
    s = sched.stats()
    assert (s["num_prefill_tokens"], s["num_decode_tokens"], s["num_finished_requests"]) == (5, 3, 1)


def test_finished_requests_feed_the_latency_histograms():
    sched = make_scheduler(num_gpu_blocks=16)
    sched.add_request(make_request("a", 5, max_tokens=4))
    sched.add_request(make_request("b", 5, max_tokens=1))  # one token: a TTFT but no TPOT
    run_to_completion(sched)
    ttft, tpot = sched.counters.ttft, sched.counters.tpot
    assert (ttft.count, sum(ttft.counts), tpot.count) == (2, 2, 1)
    assert ttft.total >= 0 and tpot.total >= 0
