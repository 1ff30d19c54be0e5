"""Pipeline stages overlap (vLLM v1's batch queue): with pipeline_parallel_size=2 the engine keeps two
scheduled steps in flight, so stage 0 runs step n + 1 while stage 1 runs step n. Six requests need more
than one batch (a 16-token budget), so the queue fills: `max_batches_in_flight` reaches 2. The greedy
tokens equal one process's under chunked prefill, prefix caching and recompute preemption, with and
without the queue; a worker killed while batches are in flight ends the engine with a clear error and
leaves no process (last test: it stops this file's engine)."""
from __future__ import annotations

import pytest

from engine_core.distributed.multiproc_executor import EngineDeadError
from parallel_helpers import STRESS, child_processes, engine_pair, generate_tokens, stress_prompts

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def engines():
    yield from engine_pair("tiny-llama", pipeline_parallel_size=2)


def test_two_batches_in_flight_and_greedy_tokens_equal_one_process(engines):
    _, one, pp, _ = engines
    assert pp.engine.batch_queue_size == 2 and one.engine.batch_queue_size == 1
    prompts = stress_prompts(one.engine.vocab_size)
    assert min(map(len, prompts)) > STRESS["max_num_batched_tokens"]  # every prompt is chunked
    assert generate_tokens(pp, prompts) == generate_tokens(one, prompts)
    stats, reference = pp.engine.stats(), one.engine.stats()
    assert stats["max_batches_in_flight"] == 2 and reference["max_batches_in_flight"] == 1
    assert stats["num_preemptions_recompute"] > 0 and stats["prefix_cache_hits"] > 0, stats
    assert not pp.engine.batch_queue and not pp.engine.scheduler.in_flight


def test_without_the_queue_the_same_tokens(engines):
    _, one, pp, _ = engines
    prompts = stress_prompts(one.engine.vocab_size)
    pp.engine.batch_queue_size = 1  # one step at a time: the stages take turns
    try:
        assert generate_tokens(pp, prompts) == generate_tokens(one, prompts)
    finally:
        pp.engine.batch_queue_size = 2


def test_a_killed_worker_with_batches_in_flight_stops_the_engine(engines):
    _, one, pp, _ = engines
    prompts = stress_prompts(one.engine.vocab_size)
    engine = pp.engine
    for i, p in enumerate(prompts):
        engine.add_request(f"k{i}", p)
    engine.step()  # one batch sent, not yet collected
    assert len(engine.batch_queue) == 1
    engine.executor.procs[1].kill()
    with pytest.raises(EngineDeadError, match=r"worker 1 \(pid \d+\) died \(killed by SIGKILL\)"):
        for _ in range(10):
            engine.step()
    assert not child_processes() and not engine.batch_queue
    with pytest.raises(EngineDeadError):  # and says so again on every later call
        engine.step()
