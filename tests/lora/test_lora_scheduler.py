"""The scheduler's slot rule: the running requests never use more than max_loras distinct adapters
(so a step's adapters always fit the GPU slots, and a running request's adapter stays in its slot),
a request whose adapter cannot get a slot waits in FCFS order, and nobody starves."""
from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine_core.lora.slots import LoRASlotPool
from grader.harness import EOS, FakeRunner, make_request, make_scheduler, reference_output


def _ids(requests) -> list[str]:
    return [r.request_id for r in requests]


def test_a_third_adapter_waits_for_a_slot_and_blocks_those_behind_it():
    sched = make_scheduler(64, enable_lora=True, max_loras=2)
    for rid, lora in [("a", 1), ("b", 2), ("c", 3), ("d", 1), ("e", None)]:
        sched.add_request(make_request(rid, 6, max_tokens=3, lora_id=lora))
    sched.schedule()
    assert _ids(sched.running) == ["a", "b"], "adapter 3 would be the third distinct adapter: c waits"
    assert _ids(sched.waiting) == ["c", "d", "e"], "FCFS: d and e wait behind c, even though they need no new slot"


def test_requests_of_running_adapters_and_base_requests_join():
    sched = make_scheduler(64, enable_lora=True, max_loras=1)
    for rid, lora in [("a", 1), ("b", None), ("c", 1), ("d", 2)]:
        sched.add_request(make_request(rid, 6, max_tokens=3, lora_id=lora))
    sched.schedule()
    assert _ids(sched.running) == ["a", "b", "c"] and _ids(sched.waiting) == ["d"]


def test_without_enable_lora_adapter_ids_are_only_cache_keys():
    sched = make_scheduler(64, max_loras=1)
    for rid, lora in [("a", 1), ("b", 2), ("c", 3)]:
        sched.add_request(make_request(rid, 6, max_tokens=3, lora_id=lora))
    sched.schedule()
    assert _ids(sched.running) == ["a", "b", "c"]


def test_a_waiting_adapter_is_not_starved_by_a_stream_of_running_adapter_requests():
    """max_loras=1; adapter 1 gets a new request every step for 200 steps, adapter 2 one request at
    step 1. A policy that let requests of the running adapter overtake would keep adapter 1 running
    for ever; here the adapter-2 request runs once the adapter-1 requests ahead of it finish."""
    sched = make_scheduler(256, enable_lora=True, max_loras=1, max_num_seqs=8)
    runner = FakeRunner(256, sched.block_size)
    victim = None
    for step in range(200):
        sched.add_request(make_request(f"s{step}", 5, max_tokens=4, lora_id=1, arrival=float(step)))
        if step == 1:
            victim = make_request("other", 5, max_tokens=4, lora_id=2, arrival=1.5)
            sched.add_request(victim)
        out = sched.schedule()
        assert len({c.request.lora_id for c in out.scheduled}) <= 1
        sched.update_from_output(out, runner.execute(out))
        if victim is not None and victim.is_finished:
            break
    assert victim.is_finished, f"the adapter-2 request starved: still {victim.status.name} after 200 steps"
    assert step < 20, f"it took {step} steps"


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(max_loras=st.integers(1, 3), num_gpu_blocks=st.integers(8, 40), num_cpu_blocks=st.sampled_from([0, 16]),
       budget=st.integers(4, 32), max_num_seqs=st.integers(1, 6), prefix=st.booleans(),
       workload=st.lists(st.tuples(st.integers(0, 20),  # arrival step
                                   st.sampled_from([None, 1, 1, 1, 1, 2, 2, 3, 4, 5]),  # Zipf-like popularity
                                   st.integers(1, 20), st.integers(1, 8)), min_size=1, max_size=24))
def test_random_workloads_respect_the_slot_rule_and_finish(max_loras, num_gpu_blocks, num_cpu_blocks, budget,
                                                           max_num_seqs, prefix, workload):
    """Every step the running requests hold <= max_loras adapters, so a slot pool of max_loras slots
    with their adapters pinned always finds room (it raises otherwise); every request finishes, with
    its cache-free reference output, preemptions (recompute and swap) included."""
    sched = make_scheduler(num_gpu_blocks, num_cpu_blocks, enable_lora=True, max_loras=max_loras,
                           max_num_batched_tokens=budget, max_num_seqs=max_num_seqs, enable_prefix_caching=prefix,
                           block_size=4, max_model_len=48)
    runner = FakeRunner(num_gpu_blocks, sched.block_size, num_cpu_blocks)
    pool = LoRASlotPool(max_loras)
    requests = {}
    for step in range(2000):
        for i, (arrival, lora, prompt_len, max_tokens) in enumerate(workload):
            if arrival == step:
                req = make_request(f"r{i}", [(i * 7 + k) % 40 + 1 for k in range(prompt_len)], max_tokens,
                                   arrival=float(step), eos=EOS, lora_id=lora)
                try:
                    sched.add_request(req)
                    requests[req.request_id] = req
                except ValueError:  # can never fit this tiny KV cache
                    pass
        if step > 20 and not sched.has_unfinished_requests():
            break
        out = sched.schedule()
        running = {r.lora_id for r in sched.running} - {None}
        assert len(running) <= max_loras, f"step {step}: running adapters {running} > max_loras={max_loras}"
        pool.assign([c.request.lora_id for c in out.scheduled if c.request.lora_id is not None], pinned=running)
        sched.update_from_output(out, runner.execute(out))
    assert not sched.has_unfinished_requests(), f"stuck: waiting {list(sched.waiting)} running {sched.running}"
    for rid, req in requests.items():
        assert req.output_token_ids == reference_output(req.prompt_token_ids, req.sampling_params.max_tokens, EOS,
                                                        sched.max_model_len), rid
