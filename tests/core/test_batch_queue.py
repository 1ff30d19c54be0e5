"""The scheduler under vLLM's batch queue (pipeline_parallel_size = p > 1), model-free: up to p batches
are scheduled before the oldest one's output is applied. The fake runner executes each batch when it is
sent (a worker runs the steps in the order they arrive), its output is applied later, in order, as the
engine's `_step_with_batch_queue` does. A request in flight is never scheduled or preempted again before
its output is back; the greedy outputs equal the one-batch-at-a-time run under chunked prefill, prefix
caching, recompute and swap preemption."""
from collections import deque

import pytest
from grader.harness import FakeRunner, make_request, make_scheduler, run_to_completion


def run_with_batch_queue(sched, depth, max_steps=10_000):
    """(outputs by request id, most batches in flight, largest running count seen)."""
    runner = FakeRunner.for_scheduler(sched)
    queue, outputs, most, seats = deque(), {}, 0, 0
    for _ in range(max_steps):
        if not sched.has_unfinished_requests() and not queue:
            return outputs, most, seats
        out = None
        if len(queue) < depth:
            out = sched.schedule()
            ids = [c.request.request_id for c in out.scheduled]
            assert not set(ids) & sched.in_flight, "a request in flight was scheduled again"
            assert not set(out.preempted_request_ids) & sched.in_flight, "a request in flight was preempted"
            seats = max(seats, len(sched.running))
            if out.scheduled or out.finished_req_ids or out.preempted_request_ids or out.swap_out or out.swap_in:
                queue.append((runner.execute(out), out))
                sched.in_flight.update(ids)
                most = max(most, len(queue))
        if queue and (out is None or not out.scheduled or len(queue) == depth):
            result, done = queue.popleft()
            sched.in_flight.difference_update(c.request.request_id for c in done.scheduled)
            for req in sched.update_from_output(done, result):
                outputs[req.request_id] = list(req.output_token_ids)
    raise AssertionError(f"not finished after {max_steps} steps: {sched.stats()}")


def workload(sched):
    # a shared 8-token prefix (2 full blocks: prefix hits), prompts longer than the 16-token budget (chunked)
    for i, n in enumerate((18, 9, 23, 12, 30, 15)):
        sched.add_request(make_request(f"r{i}", [7] * 8 + [i + 1] * (n - 8), max_tokens=10))


@pytest.mark.parametrize("mode", ["recompute", "swap"])
@pytest.mark.parametrize("depth", [2, 3])
def test_batch_queue_outputs_equal_one_batch_at_a_time(mode, depth):
    kwargs = dict(num_gpu_blocks=18, num_cpu_blocks=40, enable_prefix_caching=True, preemption_mode=mode,
                  max_num_seqs=4)
    one, queued = make_scheduler(**kwargs), make_scheduler(**kwargs)
    workload(one)
    workload(queued)
    expected = run_to_completion(one)
    outputs, most, seats = run_with_batch_queue(queued, depth)
    assert outputs == expected
    assert most == depth  # the queue filled: batches overlapped
    assert seats <= 4  # requests in flight keep their seats: max_num_seqs still holds
    stats = queued.stats()
    assert stats[f"num_preemptions_{mode}"] > 0 and stats["prefix_cache_hits"] > 0, stats
    assert not queued.in_flight and not queued.running and queued.kv_cache_manager.usage == 0


def test_requests_in_flight_keep_their_place_in_running():
    sched = make_scheduler(num_gpu_blocks=64, max_num_batched_tokens=8)
    for rid in "abc":
        sched.add_request(make_request(rid, 4, max_tokens=4))
    first = sched.schedule()  # a and b (8 tokens), c waits
    assert [c.request.request_id for c in first.scheduled] == ["a", "b"]
    sched.in_flight.update({"a", "b"})
    second = sched.schedule()
    assert [c.request.request_id for c in second.scheduled] == ["c"]
    assert [r.request_id for r in sched.running] == ["a", "b", "c"]
    sched.in_flight.add("c")
    assert not sched.schedule().scheduled  # everyone is in flight: nothing to plan until an output is back
    assert [r.request_id for r in sched.running] == ["a", "b", "c"]
