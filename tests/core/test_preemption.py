"""Preemption rules: victim choice, recompute vs swap, and outputs unchanged under memory pressure."""
import random

import pytest
from grader.harness import EOS, TINY_SPEC, FakeRunner, make_request, make_scheduler, reference_output, run_to_completion

from engine_core import memory
from engine_helpers import E2E_PARAMS, E2E_PROMPTS
from engine_core.request import RequestStatus, SamplingParams
from engine_core.core.scheduler_output import SchedulerOutput


def fill(sched, specs):
    """specs: (rid, prompt_len, priority, arrival). Admit and compute every prompt."""
    runner = FakeRunner.for_scheduler(sched)
    for rid, n, prio, arrival in specs:
        sched.add_request(make_request(rid, n, max_tokens=50, priority=prio, arrival=arrival))
    out = sched.schedule()
    sched.update_from_output(out, runner.execute(out))
    return runner


def test_victim_is_lowest_priority_then_latest_arrival():
    sched = make_scheduler(num_gpu_blocks=32, preemption_mode="recompute")
    fill(sched, [("a", 3, 0, 1.0), ("b", 3, 1, 0.0), ("c", 3, 1, 2.0), ("d", 3, 0, 3.0)])
    order = [sched._preempt(SchedulerOutput()).request_id for _ in range(4)]
    assert order == ["c", "b", "d", "a"]


def test_recompute_frees_blocks_keeps_tokens_and_queues_at_the_front():
    sched = make_scheduler(num_gpu_blocks=32, preemption_mode="recompute")
    fill(sched, [("a", 6, 0, 0.0)])
    sched.add_request(make_request("w", 3))
    req = sched.running[0]
    out = SchedulerOutput()
    assert sched._preempt(out) is req
    assert req.status == RequestStatus.PREEMPTED and req.num_computed_tokens == 0
    assert req.output_token_ids != [] and req.num_preemptions == 1
    assert list(sched.waiting)[0] is req and sched.kv_cache_manager.usage == 0.0
    assert out.preempted_request_ids == ["a"] and out.swap_out == []
    assert sched.stats()["num_preemptions_recompute"] == 1


def test_swap_plans_the_copy_and_queues_the_request_as_swapped():
    sched = make_scheduler(num_gpu_blocks=32, num_cpu_blocks=8, preemption_mode="swap")
    fill(sched, [("a", 6, 0, 0.0)])  # 6 tokens computed: 2 blocks of 4
    req = sched.running[0]
    gpu_ids = sched.kv_cache_manager.get_block_ids("a")
    out = SchedulerOutput()
    sched._preempt(out)
    assert req.status == RequestStatus.SWAPPED and req.num_computed_tokens == 6
    assert [g for g, _ in out.swap_out] == gpu_ids
    s = sched.stats()
    assert (s["num_preemptions_swap"], s["num_blocks_swapped_out"], s["num_requests_swapped"]) == (1, 2, 1)


def test_swapped_requests_come_back_before_waiting_ones_are_admitted():
    sched = make_scheduler(num_gpu_blocks=32, num_cpu_blocks=8, preemption_mode="swap")
    runner = fill(sched, [("a", 6, 0, 0.0)])
    plan = SchedulerOutput()
    sched._preempt(plan)
    runner.execute(plan)  # performs the swap-out copy
    sched.add_request(make_request("w", 3))
    out = sched.schedule()
    assert [c.request.request_id for c in out.scheduled] == ["a", "w"]
    assert len(out.swap_in) == 2 and out.scheduled[0].start == 6
    assert out.scheduled[0].resumed, "a swapped-in request gets a fresh table: the runner must replace its row"
    assert [g for _, g in out.swap_in] == out.scheduled[0].new_block_ids[:2]
    assert sched.stats()["num_blocks_swapped_in"] == 2


def test_allocation_failure_preempts_the_latest_request_first():
    sched = make_scheduler(num_gpu_blocks=4, block_size=4, preemption_mode="recompute", max_num_batched_tokens=64)
    kvm = sched.kv_cache_manager
    runner = FakeRunner(4, 4)
    sched.add_request(make_request("a", 8, max_tokens=8, arrival=0.0))
    sched.add_request(make_request("b", 7, max_tokens=8, arrival=1.0))
    out = sched.schedule()  # both prompts: 2 + 2 blocks, the cache is full
    sched.update_from_output(out, runner.execute(out))
    assert kvm.num_free_blocks == 0
    out = sched.schedule()  # a's first decode (position 8) needs a 3rd block
    assert out.preempted_request_ids == ["b"]
    assert [(c.request.request_id, c.start) for c in out.scheduled] == [("a", 8)]
    assert kvm.get_block_ids("b") == [] and len(kvm.get_block_ids("a")) == 3


def test_request_can_preempt_itself_when_it_is_the_lowest_priority():
    sched = make_scheduler(num_gpu_blocks=4, block_size=4, preemption_mode="recompute")
    runner = FakeRunner(4, 4)
    sched.add_request(make_request("hi", 7, max_tokens=8, priority=0, arrival=1.0))
    sched.add_request(make_request("lo", 8, max_tokens=8, priority=5, arrival=0.0))
    out = sched.schedule()
    sched.update_from_output(out, runner.execute(out))
    for _ in range(2):
        out = sched.schedule()
        sched.update_from_output(out, runner.execute(out))
    assert sched.stats()["num_preemptions_recompute"] == 1
    assert "lo" in [r.request_id for r in sched.waiting] and sched.running[0].request_id == "hi"


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_forced_modes(mode):
    sched = make_scheduler(num_gpu_blocks=32, num_cpu_blocks=8, preemption_mode=mode)
    fill(sched, [("a", 6, 0, 0.0)])
    assert sched.choose_preemption_mode(sched.running[0]) == mode


def test_swap_falls_back_to_recompute_without_cpu_room_or_written_kv():
    sched = make_scheduler(num_gpu_blocks=32, num_cpu_blocks=1, preemption_mode="swap")
    fill(sched, [("a", 6, 0, 0.0)])  # needs 2 CPU blocks
    assert sched.choose_preemption_mode(sched.running[0]) == "recompute"
    sched.add_request(req := make_request("b", 2))
    assert sched.choose_preemption_mode(req) == "recompute"  # nothing computed: nothing to copy


def test_auto_mode_follows_the_cost_model():
    n = 6
    recompute = memory.recompute_seconds(TINY_SPEC, n, 1e9)
    swap_bw_equal = 2 * n * memory.kv_cache_bytes_per_token(TINY_SPEC, "fp32") / recompute  # break-even bandwidth
    for factor, expected in [(2.0, "swap"), (0.5, "recompute")]:
        sched = make_scheduler(num_gpu_blocks=32, num_cpu_blocks=8, preemption_mode="auto", prefill_flops_per_s=1e9,
                               swap_bandwidth_bytes_per_s=swap_bw_equal * factor)
        fill(sched, [("a", n, 0, 0.0)])
        assert sched.choose_preemption_mode(sched.running[0]) == expected


def workload(seed, n=12):
    rng = random.Random(seed)
    shared = [rng.randrange(1, 50) for _ in range(9)]
    return [(f"r{i}", shared[:rng.randrange(0, 10)] + [rng.randrange(1, 50) for _ in range(rng.randrange(1, 20))],
             rng.randrange(1, 30)) for i in range(n)]


def run(reqs, num_gpu_blocks, num_cpu_blocks, **kw):
    sched = make_scheduler(num_gpu_blocks, num_cpu_blocks, max_num_batched_tokens=16, **kw)
    for rid, prompt, max_tokens in reqs:
        sched.add_request(make_request(rid, prompt, max_tokens, eos=EOS))
    return run_to_completion(sched), sched.stats()


@pytest.mark.parametrize("chunked", [True, False])
@pytest.mark.parametrize("prefix", [True, False])
@pytest.mark.parametrize("mode", ["recompute", "swap", "auto"])
def test_outputs_under_memory_pressure_equal_those_with_plenty_of_blocks(mode, prefix, chunked):
    reqs = workload(seed=f"{mode}-{prefix}-{chunked}")
    expected = {rid: reference_output(p, m, EOS) for rid, p, m in reqs}
    kw = dict(preemption_mode=mode, enable_prefix_caching=prefix, enable_chunked_prefill=chunked)
    plenty, plenty_stats = run(reqs, 400, 0, **kw)
    tight, stats = run(reqs, 14, 40, **kw)
    assert plenty == expected and plenty_stats["num_preemptions"] == 0
    assert tight == expected
    key = {"recompute": "num_preemptions_recompute", "swap": "num_preemptions_swap", "auto": "num_preemptions"}[mode]
    assert stats[key] > 0, stats
    if mode == "swap":
        assert stats["num_blocks_swapped_in"] == stats["num_blocks_swapped_out"] > 0


# ---- end to end: the real engine (tiny-llama preset, random weights) ---------------------------


def generate(**engine_args):
    from engine_core.entrypoints.llm import LLM

    llm = LLM(model="tiny-llama", block_size=4, max_model_len=128, max_num_batched_tokens=32, **engine_args)
    outs = llm.generate(E2E_PROMPTS, E2E_PARAMS, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], llm.engine.stats()


@pytest.fixture(scope="module")
def plenty_outputs():
    outs, stats = generate(num_gpu_blocks=400)
    assert stats["num_preemptions"] == 0
    return outs


@pytest.mark.parametrize("chunked", [True, False])
@pytest.mark.parametrize("prefix", [True, False])
@pytest.mark.parametrize("mode", ["recompute", "swap", "auto"])
def test_engine_greedy_outputs_survive_preemption(plenty_outputs, mode, prefix, chunked):
    """Issue #4: 20 blocks of 4 tokens for 10 requests of up to 63 tokens: preemption happens often."""
    outs, stats = generate(num_gpu_blocks=20, preemption_mode=mode, enable_prefix_caching=prefix,
                           enable_chunked_prefill=chunked)
    key = {"recompute": "num_preemptions_recompute", "swap": "num_preemptions_swap", "auto": "num_preemptions"}[mode]
    assert stats[key] > 0, stats
    assert outs == plenty_outputs
    assert stats["kv_cache_usage"] == 0.0 and stats["cpu_kv_cache_usage"] == 0.0


def test_engine_auto_mode_recomputes_when_there_is_no_swap_pool(plenty_outputs):
    outs, stats = generate(num_gpu_blocks=20, preemption_mode="auto", swap_space=0)
    assert stats["num_preemptions_recompute"] > 0 and stats["num_preemptions_swap"] == 0
    assert outs == plenty_outputs


def test_engine_rejects_a_request_that_can_never_fit():
    from engine_core.entrypoints.llm import LLM

    llm = LLM(model="tiny-llama", block_size=4, num_gpu_blocks=4, max_model_len=128)
    with pytest.raises(ValueError, match="can never fit"):
        llm.generate([list(range(3, 20))], SamplingParams(max_tokens=4), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
