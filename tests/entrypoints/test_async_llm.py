"""AsyncLLM: the engine's loop on its own thread, driven from many threads and tasks at once.

Every request's tokens are checked against `LLM.generate` greedy on the same prompt (an engine no
thread shares); the outputs each reader sees only grow (no token lost, none repeated); aborts,
cancelled tasks, shutdown and a failing step leave no request running and no block in use.
"""
from __future__ import annotations

import asyncio
import random
import threading
import time

import pytest
from engine_helpers import hold_forward, one_torch_thread

from engine_core import LLM, LLMEngine, SamplingParams
from engine_core.entrypoints.async_llm import AsyncLLM, EngineStepError, QueueFullError
from engine_core.exceptions import EngineDeadError

pytestmark = [pytest.mark.usefixtures(one_torch_thread.__name__), pytest.mark.timeout(120)]
ENGINE = dict(device="cpu", num_gpu_blocks=128)
GREEDY = dict(temperature=0.0, ignore_eos=True)
PROMPTS = [[(7 * i + j) % 500 + 3 for j in range(3 + i % 5)] for i in range(24)]
MAX_TOKENS = [4 + (i * 5) % 13 for i in range(24)]


@pytest.fixture(scope="module")
def expected() -> list[list[int]]:
    llm = LLM("tiny-llama", **ENGINE)
    outs = llm.generate(PROMPTS, [SamplingParams(max_tokens=m, **GREEDY) for m in MAX_TOKENS], use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture
def llm():
    engine = AsyncLLM.from_kwargs("tiny-llama", **ENGINE)
    yield engine
    engine.shutdown(timeout=5.0, abort=True)


def _idle(llm: AsyncLLM, timeout: float = 60.0) -> dict[str, float]:
    """The stats once nothing is running or waiting and no KV block is held (fails after `timeout`, generous: it
    only turns an engine that never drains into a failure, on however loaded a machine)."""
    deadline = time.monotonic() + timeout
    while True:
        stats = llm.stats()
        if stats["num_requests_running"] == stats["num_requests_waiting"] == 0 and stats["kv_cache_usage"] == 0:
            return stats
        assert time.monotonic() < deadline, f"engine not idle after {timeout}s: {stats}"
        time.sleep(0.01)


async def _collect(llm: AsyncLLM, prompt, params: SamplingParams, rid: str, stop_after: int | None = None):
    """Every output the reader saw (checked to only grow); `stop_after`: leave after that many."""
    seen = []
    async for out in llm.generate(prompt, params, rid):
        tokens = out.outputs[0].token_ids
        if seen:
            previous = seen[-1].outputs[0].token_ids
            # an abort's final output may carry no new token; every other output brings at least one
            assert tokens[:len(previous)] == previous and (len(tokens) > len(previous) or out.finished), \
                (rid, previous, tokens)
        seen.append(out)
        if stop_after is not None and len(seen) >= stop_after:
            break
    return seen


def test_many_threads_and_tasks_get_offline_tokens_and_aborts_free_blocks(llm, expected):
    """6 threads, each an event loop with 4 tasks; a third of the requests are left early (break) or
    aborted from another thread. The rest end with LLM.generate's tokens; the aborted with a prefix."""
    results: dict[int, list] = {}
    errors: list[BaseException] = []
    rng = random.Random(0)
    fate = {i: rng.choice(["finish", "finish", "break", "abort"]) for i in range(len(PROMPTS))}
    started = threading.Barrier(6)

    async def one(i: int) -> None:
        params = SamplingParams(max_tokens=MAX_TOKENS[i], **GREEDY)
        if fate[i] == "abort":
            threading.Timer(0.001 * (i % 4), llm.abort, args=[f"r{i}"]).start()
        results[i] = await _collect(llm, PROMPTS[i], params, f"r{i}", stop_after=2 if fate[i] == "break" else None)

    def thread_main(k: int) -> None:
        try:
            started.wait(60)
            asyncio.run(_gather(*(one(i) for i in range(k, len(PROMPTS), 6))))
        except BaseException as e:  # noqa: BLE001 - handed to the test
            errors.append(e)

    threads = [threading.Thread(target=thread_main, args=(k,)) for k in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(100)  # the event is each thread's end; the bound only turns a hang into a failure
    assert not errors, errors
    assert not [t.name for t in threads if t.is_alive()], "a thread's requests never ended"
    assert len(results) == len(PROMPTS)
    for i, seen in results.items():
        final = seen[-1].outputs[0]
        if fate[i] == "finish":
            assert seen[-1].finished and final.token_ids == expected[i] and final.finish_reason == "length", i
        elif fate[i] == "abort":  # the abort may land after the request finished on its own
            assert seen[-1].finished and final.finish_reason in ("abort", "length"), (i, final)
            assert final.token_ids == expected[i][:len(final.token_ids)], i
        else:
            assert final.token_ids == expected[i][:len(final.token_ids)], i
    stats = _idle(llm)
    assert stats["num_finished_requests"] == len(PROMPTS)


async def _gather(*coros):
    return await asyncio.gather(*coros)


def test_a_slow_reader_gets_the_latest_output_not_a_backlog(llm, expected):
    """A reader that stops reading while the loop runs on gets one output with every later token.

    Under load the loop can finish a request before the reader's first read wakes (CI once saw all
    6 tokens in the first output); that try proves nothing about a backlog, so the test uses the
    longest request and tries again, up to 3 times, until the first read caught it running."""
    i = MAX_TOKENS.index(max(MAX_TOKENS))

    async def one(rid: str, finished_before: int):
        gen = llm.generate(PROMPTS[i], SamplingParams(max_tokens=MAX_TOKENS[i], **GREEDY), rid)
        first = await gen.__anext__()
        deadline = time.monotonic() + 20
        while llm.stats()["num_finished_requests"] <= finished_before:  # the loop runs on; no read
            assert time.monotonic() < deadline
            time.sleep(0.01)
        return first, [out async for out in gen]

    for attempt in range(3):
        first, rest = asyncio.run(one(f"slow{attempt}", attempt))
        final = (rest or [first])[-1]
        assert final.finished and final.outputs[0].token_ids == expected[i]
        assert len(rest) <= 1, f"a backlog of {len(rest)} outputs after the first"
        if not first.finished:
            assert len(rest) == 1, "every token after the first in one output"
            break
    else:
        pytest.fail("the request finished before the first read in all 3 tries: the test checked nothing")


def test_abort_from_another_thread_and_a_cancelled_task_free_their_blocks(llm):
    long = SamplingParams(max_tokens=1000, **GREEDY)

    async def main():
        with hold_forward(llm.engine, 3) as (held, _):  # the loop waits in a step while another thread aborts
            gen = llm.generate(list(range(3, 40)), long, "aborted")
            await gen.__anext__()
            assert await asyncio.to_thread(held.wait, 60), "the request never reached its 3rd forward pass"
            aborter = threading.Thread(target=llm.abort, args=["aborted"])
            aborter.start()
            aborter.join(30)
        rest = [out async for out in gen]
        assert rest[-1].finished and rest[-1].outputs[0].finish_reason == "abort"
        assert len(rest[-1].outputs[0].token_ids) < 1000
        _idle(llm)

        task = asyncio.create_task(_collect(llm, list(range(3, 40)), long, "cancelled"))
        while llm.stats()["num_requests_running"] == 0:
            await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return _idle(llm)

    stats = asyncio.run(main())
    assert stats["num_finished_requests"] == 2


def test_a_full_waiting_queue_refuses_with_queue_full_error_and_queues_nothing():
    llm = AsyncLLM.from_kwargs("tiny-llama", max_waiting_requests=2, max_num_seqs=1, **ENGINE)
    long = SamplingParams(max_tokens=1000, **GREEDY)

    async def main():
        # the loop waits in "a"'s second step until the two adds, the refused one and a stats call are all in its
        # inbox: it takes them in that order before "a" can take another step (let alone finish its 1000 tokens)
        with hold_forward(llm.engine, 2) as (held, _):
            running = llm.generate([5, 6, 7], long, "a")
            await running.__anext__()  # "a" holds the only seat; the next two wait
            assert await asyncio.to_thread(held.wait, 60), "the request never reached its 2nd forward pass"
            waiting = [llm.generate([5, 6, 8 + i], long, f"w{i}") for i in range(2)]
            tasks = [asyncio.create_task(w.__anext__()) for w in waiting]
            refused = asyncio.create_task(llm.generate([5, 6, 9], long, "refused").__anext__())
            await asyncio.sleep(0)  # the three tasks run in order up to their first wait: each add is queued
            counted = asyncio.wrap_future(llm.run_in_engine(LLMEngine.stats))
        with pytest.raises(QueueFullError, match="max_waiting_requests=2"):
            await refused
        assert (await counted)["num_requests_waiting"] == 2
        llm.abort(["a", "w0", "w1", "refused"])
        async for _ in running:
            pass
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for w in waiting:
            await w.aclose()

    try:
        asyncio.run(main())
        _idle(llm)
    finally:
        llm.shutdown(timeout=5.0, abort=True)


def test_a_bad_request_raises_its_value_error_and_the_next_request_runs(llm, expected):
    async def main():
        with pytest.raises(ValueError, match="max_model_len"):
            await llm.generate(list(range(3, 500)) * 5, SamplingParams(**GREEDY), "too-long").__anext__()
        with pytest.raises(ValueError, match="prompt token ids"):
            await llm.generate([10**6], SamplingParams(**GREEDY), "bad-token").__anext__()
        with pytest.raises(ValueError, match=r"priority must be 0 when priority scheduling is not enabled .*got 2"):
            await llm.generate(PROMPTS[1], SamplingParams(**GREEDY), "prioritized", priority=2).__anext__()
        assert llm.stats()["num_requests_waiting"] == 0
        return await _collect(llm, PROMPTS[0], SamplingParams(max_tokens=MAX_TOKENS[0], **GREEDY), "good")

    assert asyncio.run(main())[-1].outputs[0].token_ids == expected[0]


def test_a_failing_step_fails_the_requests_in_flight_and_the_loop_goes_on(llm, expected):
    real_step, calls = llm.engine.step, []

    def flaky_step():
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("injected step failure")
        return real_step()

    llm.engine.step = flaky_step  # the loop calls engine.step(): the instance attribute wins
    long = SamplingParams(max_tokens=1000, **GREEDY)

    async def main():
        results = await asyncio.gather(*(_collect(llm, PROMPTS[i], long, f"f{i}") for i in range(2)),
                                       return_exceptions=True)
        for r in results:
            assert isinstance(r, EngineStepError) and "injected step failure" in str(r), r
        _idle(llm)
        return await _collect(llm, PROMPTS[1], SamplingParams(max_tokens=MAX_TOKENS[1], **GREEDY), "after")

    assert asyncio.run(main())[-1].outputs[0].token_ids == expected[1]
    assert llm.num_step_errors == 1


def test_a_task_cancelled_before_its_add_is_applied_leaves_nothing_and_the_loop_alive(llm, expected):
    async def main():
        gate = threading.Event()  # the loop is busy until the test opens it: the add waits in the inbox
        blocker = llm.run_in_engine(lambda engine: gate.wait(60))
        try:
            task = asyncio.create_task(_collect(llm, PROMPTS[0], SamplingParams(max_tokens=1000, **GREEDY), "gone"))
            await asyncio.sleep(0.05)  # the task submits its add (any wait does: the gate holds the loop)
            task.cancel()  # cancels the add's future too (asyncio.wrap_future)
            with pytest.raises(asyncio.CancelledError):
                await task
        finally:
            gate.set()
        assert blocker.result(30) is True, "the loop was not held while the add was cancelled"
        assert _idle(llm)["num_finished_requests"] == 0, "the cancelled add was never applied"
        return await _collect(llm, PROMPTS[0], SamplingParams(max_tokens=MAX_TOKENS[0], **GREEDY), "next")

    assert asyncio.run(main())[-1].outputs[0].token_ids == expected[0]


@pytest.mark.parametrize("abort", [False, True])
def test_shutdown_with_requests_in_flight_finishes_or_aborts_them_and_joins(expected, abort):
    llm = AsyncLLM.from_kwargs("tiny-llama", **ENGINE)
    params = SamplingParams(max_tokens=1000 if abort else MAX_TOKENS[2], **GREEDY)
    box: dict = {}

    async def main():
        with hold_forward(llm.engine, 2) as (held, _):  # the request is in flight when shutdown begins
            gen = llm.generate(PROMPTS[2], params, "inflight")
            await gen.__anext__()
            assert await asyncio.to_thread(held.wait, 60), "the request never reached its 2nd forward pass"
            stopper = threading.Thread(target=lambda: box.setdefault("joined", llm.shutdown(timeout=10.0,
                                                                                            abort=abort)))
            stopper.start()
            while llm.is_running:  # shutdown has begun in the other thread
                await asyncio.sleep(0.001)
        rest = [out async for out in gen]
        with pytest.raises(EngineDeadError):
            await llm.generate(PROMPTS[0], params, "late").__anext__()
        stopper.join(20)
        return rest

    rest = asyncio.run(main())
    assert box["joined"] is True  # the loop ended within shutdown's own bound (timeout + 5 s), however slow the machine
    final = rest[-1].outputs[0]
    if abort:
        assert final.finish_reason == "abort" and len(final.token_ids) < 1000
    else:
        assert final.finish_reason == "length" and final.token_ids == expected[2]
    stats = llm.stats()  # after shutdown: read in this thread, no loop is left
    assert stats["num_requests_running"] == 0 and stats["kv_cache_usage"] == 0
