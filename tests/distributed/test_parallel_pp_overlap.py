"""Pipeline stages overlap (vLLM v1's batch queue): with pipeline_parallel_size=2 the engine keeps two
scheduled steps in flight, so stage 0 runs step n + 1 while stage 1 runs step n. Six requests need more
than one batch (a 16-token budget), so the queue fills: `max_batches_in_flight` reaches 2. The greedy
tokens equal one process's under chunked prefill, prefix caching and recompute preemption, with and
without the queue; a worker killed while batches are in flight ends the engine with a clear error and
leaves no process (it stops this file's engine), and a stage that hangs with batches in flight times out."""
from __future__ import annotations

import time

import pytest

from engine_core import LLM
from engine_core.exceptions import EngineDeadError
from parallel_helpers import STRESS, child_processes, engine_pair, generate_tokens, stress_prompts

pytestmark = pytest.mark.timeout(600)


def hang_execute_on_last_stage(runner) -> None:
    """Make the last stage's next forwards hang past the test's own timeout (the workers run it through
    collective_rpc): only the engine's step timeout can end the steps waiting on them."""
    if runner.parallel.pp.is_last_rank:
        forward = runner.execute_model

        def slow(scheduler_output):
            time.sleep(3600)
            return forward(scheduler_output)
        runner.execute_model = slow


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


def test_a_hung_stage_with_batches_in_flight_times_out():
    llm = LLM("tiny-llama", pipeline_parallel_size=2, **STRESS)
    engine = llm.engine
    engine.executor.collective_rpc(hang_execute_on_last_stage)
    engine.executor.step_timeout_s = 2.0
    for i, p in enumerate(stress_prompts(engine.vocab_size)):
        engine.add_request(f"h{i}", p)
    # stage 0 waits too: its send of the hidden state returns once stage 1 receives it (gloo)
    with pytest.raises(EngineDeadError, match=r"execute_model: no reply from worker\(s\) \[(0, )?1\] within 2 s"):
        for _ in range(10):
            engine.step()
    assert engine.stats()["max_batches_in_flight"] == 2  # the second batch was sent before the first timed out
    assert not child_processes()
