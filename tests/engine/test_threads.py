"""No hang: the three ways `generate()` used to spin forever now return or raise, and say why.

- a request it waits on is aborted from another thread: it returns, that output finish_reason "abort";
- it is called from two threads: the second gets EngineBusyError at once, the first finishes;
- it is re-entered from inside a step: the inner call raises EngineBusyError, which ends the outer.
The engine is single-threaded and says so (engine_core.guard): a step from a second thread, or from
inside a step, is refused before it changes anything; abort_request may come from any thread.
What proves the early end is the engine's own record (the finish reason, the error, the steps and tokens
counted), never the wall clock: a loaded machine may stall any thread for seconds, so a forward pass is held
while the test acts "mid-generate", and threads are joined with a generous timeout that only a hang exceeds.
"""
from __future__ import annotations

import threading

import pytest
from engine_helpers import hold_forward, one_torch_thread, pool_is_whole

from engine_core import LLM, EngineBusyError, SamplingParams
from engine_core.request import RequestStatus

pytestmark = [pytest.mark.usefixtures(one_torch_thread.__name__), pytest.mark.timeout(60)]
GREEDY = dict(temperature=0.0, ignore_eos=True)
LONG = SamplingParams(max_tokens=1500, **GREEDY)  # many seconds of steps: only an early return ends it soon
JOIN_S = 30.0  # a hang's bound, not a speed claim


def _llm() -> LLM:
    return LLM("tiny-llama", device="cpu", num_gpu_blocks=256)


def _in_thread(fn) -> tuple[threading.Thread, dict]:
    result: dict = {}

    def run():
        try:
            result["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - handed to the test
            result["error"] = e

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, result


def _expected(prompts) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in _llm().generate(prompts, SamplingParams(max_tokens=4, **GREEDY),
                                                               use_tqdm=False)]


def test_generate_returns_when_another_thread_aborts_its_request():
    llm = _llm()
    with hold_forward(llm.engine, 8) as (held, _):
        thread, result = _in_thread(lambda: llm.generate([[5, 6], [7, 8]], [LONG, SamplingParams(max_tokens=3, **GREEDY)],
                                                         use_tqdm=False))
        assert held.wait(JOIN_S), "generate() never reached its 8th forward pass"
        llm.engine.abort_request("gen-0")  # the engine is mid-generate in the other thread: queued, then applied
    thread.join(timeout=JOIN_S)
    assert not thread.is_alive(), f"generate() did not return within {JOIN_S} s of the abort"
    long, short = result["value"]  # "abort" and < 1500 tokens: it ended because of the abort, not at length
    assert long.finished and long.outputs[0].finish_reason == "abort" and 5 <= len(long.outputs[0].token_ids) < 1500
    assert short.outputs[0].finish_reason == "length" and len(short.outputs[0].token_ids) == 3
    assert not llm.engine.has_unfinished_requests() and pool_is_whole(llm.engine)


def test_a_second_thread_calling_generate_gets_a_clear_error():
    llm = _llm()
    with hold_forward(llm.engine, 2) as (held, _):
        first, result = _in_thread(lambda: llm.generate([[5, 6]], SamplingParams(max_tokens=200, **GREEDY),
                                                        use_tqdm=False))
        assert held.wait(JOIN_S), "generate() never reached its 2nd forward pass"
        second, second_result = _in_thread(lambda: llm.generate([[7]], use_tqdm=False))
        second.join(timeout=JOIN_S)
        assert not second.is_alive()
        error = second_result["error"]  # refused while the first is in generate(), not queued behind it
        assert isinstance(error, EngineBusyError)
        assert "LLM.generate() called from thread" in str(error) \
            and "is in LLM.generate(): the engine is single-threaded" in str(error)
        with pytest.raises(EngineBusyError, match=r"step\(\) called from thread .* while thread .* is in LLM\.generate"):
            llm.engine.step()  # nor can this thread step the engine under the other's feet
    first.join(timeout=JOIN_S)
    assert len(result["value"][0].outputs[0].token_ids) == 200
    assert not llm.engine.has_unfinished_requests() and pool_is_whole(llm.engine)


def test_generate_re_entered_from_inside_a_step_raises():
    llm = _llm()
    execute = llm.engine.runner.execute_model
    inner: list = []

    def hook(scheduler_output):  # e.g. a callback that calls back into the LLM
        if not inner:
            inner.append(True)
            llm.generate([[9]], use_tqdm=False)
        return execute(scheduler_output)

    llm.engine.runner.execute_model = hook
    with pytest.raises(EngineBusyError, match=r"LLM\.generate\(\) called from inside step\(\)"):
        llm.generate([[5, 6, 7]], LONG, use_tqdm=False)
    stats = llm.engine.stats()  # the first step raised and ended the outer call: nothing of LONG ran
    assert (stats["num_steps"], stats["num_failed_steps"], stats["num_generated_tokens"]) == (0, 1, 0)
    llm.engine.runner.execute_model = execute
    assert not llm.engine.has_unfinished_requests() and pool_is_whole(llm.engine)
    outs = llm.generate([[5, 6, 7], [8]], SamplingParams(max_tokens=4, **GREEDY), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == _expected([[5, 6, 7], [8]])


def test_step_re_entered_or_concurrent_is_refused_before_any_change():
    llm = _llm()
    engine = llm.engine
    engine.add_request("a", [5, 6], SamplingParams(max_tokens=4, **GREEDY))
    execute = engine.runner.execute_model
    seen: list = []

    def hook(scheduler_output):
        for call in (engine.step, lambda: engine.add_request("b", [7])):
            with pytest.raises(EngineBusyError, match=r"called from inside step\(\)"):
                call()
        engine.abort_request("never-added")  # allowed anywhere: queued until the step ends
        thread, result = _in_thread(engine.step)
        thread.join(timeout=JOIN_S)
        seen.append(result.get("error"))
        return execute(scheduler_output)

    engine.runner.execute_model = hook
    engine.step()
    engine.runner.execute_model = execute
    assert isinstance(seen[0], EngineBusyError) and "while thread" in str(seen[0]) and "is in step()" in str(seen[0])
    assert list(engine.requests) == ["a"] and engine.stats()["num_steps"] == 1
    while engine.has_unfinished_requests():
        engine.step()
    assert pool_is_whole(engine)


def test_generate_notices_a_request_that_left_the_engine_without_output():
    """If something steps the engine behind generate's back (here: a hook that aborts through the
    scheduler, bypassing the engine), generate raises instead of waiting forever."""
    llm = _llm()
    execute = llm.engine.runner.execute_model

    def drop_all(scheduler_output):
        out = execute(scheduler_output)
        for rid in list(llm.engine.requests):
            llm.engine.requests.pop(rid)
            llm.engine.scheduler.finish_requests(rid, RequestStatus.FINISHED_ABORTED)
        out.sampled_token_ids.clear()
        return out

    llm.engine.runner.execute_model = drop_all
    with pytest.raises(RuntimeError, match=r"requests \['gen-0'\] left the engine without a final output"):
        llm.generate([[5, 6]], LONG, use_tqdm=False)
