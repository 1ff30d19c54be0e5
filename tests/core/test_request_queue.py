"""scheduling_policy: the waiting queue's order (fcfs, priority), preemption by priority, the fcfs
error, and what strict priority does to a low-priority request under a steady high-priority stream."""
from __future__ import annotations

import pytest
from engine_helpers import one_torch_thread, run_to_end
from grader.harness import FakeRunner, make_request, make_scheduler, run_to_completion
from hypothesis import given, settings
from hypothesis import strategies as st

from engine_core import LLMEngine, SamplingParams
from engine_core.config import EngineConfig
from engine_core.core.request_queue import FCFSRequestQueue, PriorityRequestQueue, create_request_queue
from engine_core.core.scheduler_output import SchedulerOutput
from engine_core.request import RequestStatus


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(-2, 2), st.integers(0, 5)), max_size=20),
       st.lists(st.booleans(), max_size=20))
def test_priority_queue_is_sorted_by_priority_then_arrival_and_stable(keys, lefts):
    """Whatever mix of append/appendleft, iteration and popleft give (priority, arrival) order,
    equal keys in insertion order: the same as a stable sort of the insertions."""
    queue = PriorityRequestQueue()
    reqs = [make_request(f"r{i}", 3, priority=p, arrival=float(a)) for i, (p, a) in enumerate(keys)]
    for i, r in enumerate(reqs):
        (queue.appendleft if i < len(lefts) and lefts[i] else queue.append)(r)
    want = sorted(reqs, key=lambda r: (r.priority, r.arrival_time))
    assert list(queue) == want and len(queue) == len(reqs)
    if reqs:
        victim = reqs[len(reqs) // 2]
        queue.remove(victim)
        assert victim not in queue
        want.remove(victim)
    assert [queue.popleft() for _ in range(len(queue))] == want and not queue


def test_fcfs_queue_is_a_deque_and_the_policy_is_validated():
    assert isinstance(create_request_queue("fcfs"), FCFSRequestQueue)
    assert isinstance(create_request_queue("priority"), PriorityRequestQueue)
    with pytest.raises(ValueError, match=r"scheduling_policy must be one of \('fcfs', 'priority'\), got 'lifo'"):
        EngineConfig(scheduling_policy="lifo")
    with pytest.raises(IndexError):
        PriorityRequestQueue().popleft()


def admission_order(policy: str, specs: list[tuple[str, int, float]]) -> list[str]:
    """specs: (rid, priority, arrival) added in this order to a one-seat scheduler; the order they run in."""
    sched = make_scheduler(num_gpu_blocks=64, max_num_seqs=1, scheduling_policy=policy)
    for rid, prio, arrival in specs:
        sched.add_request(make_request(rid, 4, max_tokens=2, priority=prio, arrival=arrival))
    runner, order = FakeRunner.for_scheduler(sched), []
    while sched.has_unfinished_requests():
        out = sched.schedule()
        order += [c.request.request_id for c in out.scheduled if c.request.request_id not in order]
        sched.update_from_output(out, runner.execute(out))
    return order


CRAFTED = [("late-urgent", -1, 5.0), ("a", 0, 1.0), ("bg", 3, 0.0), ("b", 0, 2.0), ("early-urgent", -1, 3.0),
           ("tie-first", 1, 4.0), ("tie-second", 1, 4.0)]


def test_priority_admits_by_priority_then_arrival_under_crafted_arrivals():
    assert admission_order("priority", CRAFTED) == ["early-urgent", "late-urgent", "a", "b", "tie-first",
                                                    "tie-second", "bg"]


def test_fcfs_admits_in_the_order_requests_were_added():
    same = [(rid, 0, arrival) for rid, _, arrival in CRAFTED]
    assert admission_order("fcfs", same) == [rid for rid, _, _ in CRAFTED]


def test_lowest_priority_is_preempted_first_and_keeps_its_place_by_key():
    """Blocks run out: the victim is the largest (priority, arrival); preempted for recompute, it goes
    back behind the more important waiting request and ahead of a later one of its own priority."""
    sched = make_scheduler(num_gpu_blocks=4, block_size=4, max_num_seqs=2, preemption_mode="recompute",
                           scheduling_policy="priority")
    runner = FakeRunner.for_scheduler(sched)
    sched.add_request(make_request("hi", 8, max_tokens=4, priority=0, arrival=0.0))  # 2 full blocks
    sched.add_request(make_request("lo", 8, max_tokens=4, priority=2, arrival=1.0))
    out = sched.schedule()
    sched.update_from_output(out, runner.execute(out))
    assert [r.request_id for r in sched.running] == ["hi", "lo"] and sched.kv_cache_manager.usage == 1.0
    sched.add_request(make_request("urgent", 3, max_tokens=2, priority=1, arrival=2.0))
    sched.add_request(make_request("lo-later", 3, max_tokens=2, priority=2, arrival=3.0))
    out = sched.schedule()  # hi's 9th token needs a third block: lo goes
    assert out.preempted_request_ids == ["lo"] and [c.request.request_id for c in out.scheduled] == ["hi"]
    assert sched.requests["lo"].status == RequestStatus.PREEMPTED
    assert [r.request_id for r in sched.waiting] == ["urgent", "lo", "lo-later"]
    sched.update_from_output(out, runner.execute(out))
    outputs = run_to_completion(sched, runner)
    assert sorted(outputs) == ["hi", "lo", "lo-later", "urgent"]


def test_under_fcfs_a_recompute_victim_goes_back_to_the_front():
    sched = make_scheduler(num_gpu_blocks=32, preemption_mode="recompute")
    runner = FakeRunner.for_scheduler(sched)
    sched.add_request(make_request("a", 6, arrival=0.0))
    out = sched.schedule()
    sched.update_from_output(out, runner.execute(out))
    sched.add_request(make_request("w", 3, arrival=1.0))
    assert sched._preempt(SchedulerOutput()).request_id == "a"
    assert [r.request_id for r in sched.waiting] == ["a", "w"]


def starved_steps(policy: str, stream_steps: int) -> tuple[int, int]:
    """Two seats; a low-priority request (priority 5) arrives at step 0, then one high-priority request
    (priority 0, 2 output tokens: two steps) arrives every step for `stream_steps` steps, which keeps
    both seats busy. Returns (the step the low request is first scheduled, the step it finishes)."""
    prio = policy == "priority"
    sched = make_scheduler(num_gpu_blocks=256, max_num_seqs=2, scheduling_policy=policy)
    runner = FakeRunner.for_scheduler(sched)
    sched.add_request(make_request("low", 4, max_tokens=2, priority=5 if prio else 0, arrival=0.0))
    sched.add_request(make_request("h0", 4, max_tokens=2, arrival=0.0))
    sched.add_request(make_request("h1", 4, max_tokens=2, arrival=0.0))
    first = None
    for step in range(10 * stream_steps + 10):
        if 0 < step < stream_steps:
            sched.add_request(make_request(f"h{step + 1}", 4, max_tokens=2, arrival=float(step)))
        out = sched.schedule()
        if first is None and any(c.request.request_id == "low" for c in out.scheduled):
            first = step
        sched.update_from_output(out, runner.execute(out))
        if "low" not in sched.requests:
            return first, step
    raise AssertionError("the low-priority request never finished")


@pytest.mark.parametrize("stream_steps", [10, 40])
def test_strict_priority_starves_a_low_request_for_as_long_as_the_stream_keeps_the_batch_full(stream_steps):
    """No aging (as vLLM): the low request waits out the whole stream, however long, then runs at
    once. Under fcfs the same request is served at its arrival."""
    first, done = starved_steps("priority", stream_steps)
    assert first >= stream_steps, f"admitted at step {first}, while the stream (to step {stream_steps}) still ran"
    assert done <= stream_steps + 4, f"finished at step {done}, long after the stream ended at {stream_steps}"
    assert starved_steps("fcfs", stream_steps) == (0, 1)


def _engine(policy: str) -> LLMEngine:
    return LLMEngine.from_kwargs("tiny-llama", device="cpu", num_gpu_blocks=64, max_num_seqs=1,
                                 scheduling_policy=policy)


@pytest.mark.usefixtures(one_torch_thread.__name__)
def test_through_the_engine_priority_orders_and_fcfs_refuses_a_priority():
    """One seat: requests queued together finish in (priority, arrival) order, with the same greedy
    tokens as under fcfs (the policy moves requests, never changes them); fcfs refuses priority != 0
    and queues nothing."""
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    prompts = {"bg": ([5, 6, 7], 3), "a": ([8, 9], 0), "urgent": ([10, 11, 12, 13], -1), "b": ([14], 0)}
    engine = _engine("priority")
    for rid, (prompt, prio) in prompts.items():
        engine.add_request(rid, prompt, params, priority=prio)
    finished = run_to_end(engine)
    assert list(finished) == ["urgent", "a", "b", "bg"]
    fcfs = _engine("fcfs")
    with pytest.raises(ValueError, match=r"priority must be 0 when priority scheduling is not enabled .*got 3"):
        fcfs.add_request("bg", prompts["bg"][0], params, priority=3)
    assert not fcfs.has_unfinished_requests()
    for rid, (prompt, _) in prompts.items():
        fcfs.add_request(rid, prompt, params)
    same = run_to_end(fcfs)
    assert list(same) == list(prompts) and same == finished
