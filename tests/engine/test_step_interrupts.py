"""A step is all-or-nothing: KeyboardInterrupt raised at every line a step executes, in turn and
deterministically (sys.settrace), leaves an engine whose invariants hold, that finishes every
request with the tokens of an uninterrupted run, and whose pool ends whole. The workload forces
what the interrupts used to break: a swap-out planned but not copied, a swap-in, prefix-cache
hits, chunked prefill, requests finishing mid-update.

`make test` interrupts every line of the step's own code (LLMEngine.step and _step,
Scheduler.update_from_output, ModelRunner.execute_model) in the swap-out and swap-in steps;
`make fuzz` (FUZZ_INTERRUPT_ALL_LINES=1) every line of engine_core that any step of the workload
runs, at any depth (the scheduler's seams, the KV manager, the forward, the sampler).
Real Ctrl-C is also held until the step ends (engine_core.interrupts), tested with a real SIGINT.
"""
from __future__ import annotations

import functools
import os
import signal
import threading

import pytest
from engine_helpers import check_engine, interrupt_at, one_torch_thread, pool_is_whole, run_to_end

from engine_core import LLM, LLMEngine, LoRARequest, SamplingParams
from engine_core.lora.presets import adapter_path

pytestmark = pytest.mark.usefixtures(one_torch_thread.__name__)
GREEDY = dict(temperature=0.0, ignore_eos=True)
BOUNDARY = {"LLMEngine.step", "LLMEngine._step", "Scheduler.update_from_output", "ModelRunner.execute_model"}
ALL_LINES = os.environ.get("FUZZ_INTERRUPT_ALL_LINES") == "1"
# add_request and abort_request hold Ctrl-C too, but are not rolled back: interrupts go elsewhere
ADDING = {"LLMEngine.add_request", "LLMEngine.abort_request"}


def _engine() -> tuple[LLMEngine, dict]:
    """7 blocks of 4 tokens, 8 CPU blocks, budget 8, prefix caching, swap: the workload below swaps
    r2 out in step 5 and back in in step 11 (asserted by test_the_workload_swaps)."""
    engine = LLMEngine.from_kwargs("tiny-llama", device="cpu", block_size=4, num_gpu_blocks=7,
                                   swap_space=8 * 2048 / 2**30, max_num_batched_tokens=8, max_model_len=64,
                                   enable_prefix_caching=True, preemption_mode="swap")
    prefix = [11, 12, 13, 14, 15, 16, 17, 18]
    requests = {f"r{i}": engine.add_request(f"r{i}", prefix + suffix, SamplingParams(max_tokens=n, **GREEDY),
                                            arrival_time=float(i))
                for i, (suffix, n) in enumerate([([21, 22], 10), ([31], 8), ([41, 42, 43], 6)])}
    return engine, requests


@functools.cache
def _uninterrupted() -> tuple[dict[str, list[int]], list[list[tuple[str, int]]], list[dict[str, float]]]:
    """Tokens of the uninterrupted run, the lines each step ran, and the stats after each step."""
    engine, requests = _engine()
    lines, stats = [], []
    while engine.has_unfinished_requests():
        with interrupt_at(None, None if ALL_LINES else BOUNDARY) as seen:
            engine.step()
        lines.append(list(seen))
        stats.append(engine.stats())
    return {rid: r.output_token_ids for rid, r in requests.items()}, lines, stats


def _step_with(key: str) -> int:
    stats = _uninterrupted()[2]
    return next(i for i, s in enumerate(stats) if s[key] > (stats[i - 1][key] if i else 0))


def test_the_workload_swaps():
    assert (_step_with("num_blocks_swapped_out"), _step_with("num_blocks_swapped_in")) == (5, 11)


@pytest.mark.slow
def test_interrupt_at_every_line_of_a_step():
    """Each distinct line of a step in turn (its first execution): in the swap-out and swap-in steps,
    or (make fuzz) in every step of the workload."""
    expected, lines, _ = _uninterrupted()
    scope = None if ALL_LINES else BOUNDARY
    for step in range(len(lines)) if ALL_LINES else (5, 11):
        firsts = {line: i for i, line in reversed(list(enumerate(lines[step])))}
        for event in sorted(firsts.values()):
            engine, requests = _engine()
            for _ in range(step):
                engine.step()
            with pytest.raises(KeyboardInterrupt), interrupt_at(event, scope):
                engine.step()
            where = f"interrupted at {lines[step][event]} in step {step}"
            check_engine(engine)
            run_to_end(engine, check=True)
            assert {rid: r.output_token_ids for rid, r in requests.items()} == expected, where
            assert all(r.status.finish_reason == "length" for r in requests.values()), where
            assert pool_is_whole(engine) and not engine.requests, where


LORA_SLOT_LOAD = {"LoRAManager.prepare", "LoRAManager.load_slot", "LoRAStack.write", "LoRASlotPool.assign",
                  "LoRACache.get", "LoRACache.load", "LoRACache.put"}


def _lora_engine() -> tuple[LLMEngine, dict]:
    """max_loras=1 and two adapters: r0 (adapter a) runs first, r1 (adapter b) waits for the slot and
    is copied into it once r0 finishes (step 3, asserted below)."""
    engine = LLMEngine.from_kwargs("tiny-llama", device="cpu", block_size=4, num_gpu_blocks=16, enable_lora=True,
                                   max_loras=1)
    loras = [LoRARequest(name, i + 1, str(adapter_path("tiny-llama", name)))
             for i, name in enumerate(["r8-attn", "r4-mlp"])]
    params = SamplingParams(max_tokens=3, **GREEDY)
    requests = {f"r{i}": engine.add_request(f"r{i}", [5, 6, 7], params, lora_request=lora)
                for i, lora in enumerate(loras)}
    return engine, requests


@functools.cache
def _uninterrupted_lora() -> tuple[dict[str, list[int]], list[list[tuple[str, int]]]]:
    engine, requests = _lora_engine()
    lines = []
    while engine.has_unfinished_requests():
        with interrupt_at(None, None if ALL_LINES else LORA_SLOT_LOAD) as seen:
            engine.step()
        lines.append(list(seen))
    return {rid: r.output_token_ids for rid, r in requests.items()}, lines


@pytest.mark.slow
def test_interrupt_at_every_line_of_an_adapter_slot_load():
    """An interrupt while an adapter is being put into its slot (the slot taken, its weights half
    copied) must not leave the slot taken as loaded: the request ends with its uninterrupted
    tokens. Each distinct line of the slot load in turn (make fuzz: every line of every step)."""
    expected, lines = _uninterrupted_lora()
    load_steps = [i for i, seen in enumerate(lines) if any(q == "LoRAManager.load_slot" for q, _ in seen)]
    assert load_steps[:2] == [0, 3], "the workload copies adapter a in step 0 and adapter b in step 3"
    for step in range(len(lines)) if ALL_LINES else load_steps[:2]:
        firsts = {line: i for i, line in reversed(list(enumerate(lines[step])))}
        for event in sorted(firsts.values()):
            engine, requests = _lora_engine()
            for _ in range(step):
                engine.step()
            with pytest.raises(KeyboardInterrupt), interrupt_at(event, None if ALL_LINES else LORA_SLOT_LOAD):
                engine.step()
            where = f"interrupted at {lines[step][event]} in step {step}"
            check_engine(engine)
            run_to_end(engine, check=True)
            assert {rid: r.output_token_ids for rid, r in requests.items()} == expected, where
            assert pool_is_whole(engine) and not engine.requests, where


def test_interrupt_between_the_last_token_and_the_stop_check():
    """Found by `make fuzz`: the token that meets max_tokens is appended, the stop check has not run.
    The rollback finishes the request (reported by the next step) instead of computing one more."""
    engine = LLMEngine.from_kwargs("tiny-llama", device="cpu", num_gpu_blocks=8)
    request = engine.add_request("r", [5, 6, 7], SamplingParams(max_tokens=2, **GREEDY))
    engine.step()
    with pytest.raises(KeyboardInterrupt), interrupt_at(0, {"Request.check_stop"}):
        engine.step()
    assert run_to_end(engine) == {"r": request.output_token_ids}
    assert len(request.output_token_ids) == 2 and request.status.finish_reason == "length"
    assert pool_is_whole(engine)


def test_generate_interrupted_mid_step_aborts_its_requests_and_the_engine_serves_on():
    llm = LLM("tiny-llama", device="cpu", num_gpu_blocks=32, block_size=4)
    prompts = [[5, 6, 7], [9] * 11, [13, 14]]
    params = SamplingParams(max_tokens=6, **GREEDY)
    fresh = LLM("tiny-llama", device="cpu", num_gpu_blocks=32, block_size=4).generate(prompts, params, use_tqdm=False)
    handler = signal.getsignal(signal.SIGINT)
    for event in (3, 40, 400, 1200):  # in generate's loop, in a step, deep in the forward
        with pytest.raises(KeyboardInterrupt), interrupt_at(event, outside=ADDING):
            llm.generate(prompts, params, use_tqdm=False)
        assert not llm.engine.has_unfinished_requests() and pool_is_whole(llm.engine), event
        assert signal.getsignal(signal.SIGINT) is handler, event  # Ctrl-C works as before
        again = llm.generate(prompts, params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in fresh]


@pytest.fixture
def default_sigint():
    """Python's own SIGINT handler, whatever this process inherited (a job started with `&` from a
    script ignores SIGINT, and Python then leaves it ignored)."""
    inherited = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, inherited)


@pytest.mark.skipif(threading.current_thread() is not threading.main_thread(), reason="SIGINT needs the main thread")
def test_real_ctrl_c_is_held_until_the_step_ends(default_sigint):
    engine, requests = _engine()
    forward = engine.runner._forward

    def forward_then_ctrl_c(batch):
        hidden = forward(batch)
        signal.raise_signal(signal.SIGINT)  # arrives mid-step, before update_from_output
        return hidden

    engine.runner._forward = forward_then_ctrl_c
    with pytest.raises(KeyboardInterrupt):
        engine.step()
    engine.runner._forward = forward
    assert engine.stats()["num_steps"] == 1 and engine.stats()["num_failed_steps"] == 0  # the step completed
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    check_engine(engine)
    run_to_end(engine)
    assert {rid: r.output_token_ids for rid, r in requests.items()} == _uninterrupted()[0]
