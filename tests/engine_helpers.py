"""Engine test kit: the whole engine's invariants between steps, running to the end, an
interrupt injector that raises KeyboardInterrupt at the n-th line the engine executes, and a
forward pass held until the test lets it go."""
from __future__ import annotations

import random
import sys
import threading
from contextlib import contextmanager
from pathlib import Path
from types import FrameType
from typing import Callable, Iterator

import pytest
import torch
from grader.harness import check_invariants

from engine_core import LLMEngine, SamplingParams

ENGINE_DIR = Path(__file__).resolve().parent.parent / "engine_core"
# The machinery that makes a step atomic: an async exception inside it is what it prevents.
MACHINERY = {str(ENGINE_DIR / "guard.py"), str(ENGINE_DIR / "interrupts.py")}


@pytest.fixture
def one_torch_thread() -> Iterator[None]:
    """Tiny models gain nothing from a second thread, and on a busy 2-core machine the OpenMP
    threads of each matmul wait for each other: one thread runs these tests ~20x faster."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def check_engine(engine: LLMEngine) -> None:
    """Scheduler invariants (grader.harness.check_invariants), plus the runner and the engine agree
    with the scheduler: the runner holds block-table rows (and adapter pins) only for running
    requests and for those finished since the last step (the next SchedulerOutput's
    finished_req_ids tells the runner to forget them), every request the scheduler knows is one the engine will report, the step's budget
    was kept, and with LoRA at most max_loras distinct adapters run and the slot pool is whole."""
    sched = engine.scheduler
    check_invariants(sched)
    running = {r.request_id for r in sched.running}
    known = running | sched.finished_req_ids
    assert set(engine.runner.input_batch.row_of) <= known, (engine.runner.input_batch.row_of, known)
    assert set(sched.requests) <= set(engine.requests)
    step = engine.last_step
    assert step.num_prefill_tokens + step.num_decode_tokens <= engine.config.max_num_batched_tokens
    lora = engine.runner.lora
    if lora is not None:  # only running (or just finished) requests pin adapters; the slot rule; each slot is held or free, once
        assert set(lora.request_lora) <= known, (lora.request_lora, known)
        adapters = {r.lora_id for r in sched.running if r.lora_id is not None}
        assert len(adapters) <= engine.config.engine.max_loras, adapters
        held = list(lora.slots.slot_of.values())
        assert sorted(held + lora.slots.free_slots) == list(range(lora.slots.num_slots)), (lora.slots.slot_of,
                                                                                          lora.slots.free_slots)
        assert set(lora.slots.slot_of) <= set(lora.known)


def pool_is_whole(engine: LLMEngine) -> bool:
    kvm = engine.scheduler.kv_cache_manager
    return (kvm.block_pool.num_free_blocks == kvm.num_gpu_blocks
            and kvm.cpu_block_pool.num_free_blocks == kvm.num_cpu_blocks)


def run_to_end(engine: LLMEngine, max_steps: int = 2000, check: bool = False) -> dict[str, list[int]]:
    """Step until nothing is left; finished outputs' tokens by request id (`check`: invariants each step)."""
    done: dict[str, list[int]] = {}
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            return done
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
        if check:
            check_engine(engine)
    raise AssertionError(f"not finished after {max_steps} steps: {engine.stats()}")


def _in_scope(functions: set[str] | None, outside: set[str]) -> Callable[[FrameType], bool]:
    def scope(frame: FrameType) -> bool:
        code = frame.f_code
        if not code.co_filename.startswith(str(ENGINE_DIR)) or code.co_filename in MACHINERY:
            return False
        if functions is not None and code.co_qualname not in functions:
            return False
        caller: FrameType | None = frame
        while caller is not None:
            if caller.f_code.co_qualname in outside:
                return False
            caller = caller.f_back
        return True
    return scope


@contextmanager
def interrupt_at(n: int | None, functions: set[str] | None = None,
                 outside: set[str] = frozenset()) -> Iterator[list[tuple[str, int]]]:
    """Trace the engine's lines (only in `functions`, by qualified name, when given; never inside
    a call of a function in `outside`): raise KeyboardInterrupt at the n-th line event (from 0), or
    with n=None only record them. Yields the (qualname, line) list of the events seen so far."""
    scope = _in_scope(functions, set(outside))
    seen: list[tuple[str, int]] = []

    def local(frame: FrameType, event: str, arg: object) -> Callable | None:
        if event == "line":
            seen.append((frame.f_code.co_qualname, frame.f_lineno))
            if n is not None and len(seen) == n + 1:
                sys.settrace(None)
                raise KeyboardInterrupt(f"injected at {seen[-1]}")
        return local

    def calls(frame: FrameType, event: str, arg: object) -> Callable | None:
        return local if event == "call" and scope(frame) else None

    previous = sys.gettrace()
    sys.settrace(calls)
    try:
        yield seen
    finally:
        sys.settrace(previous)


@contextmanager
def hold_forward(engine: LLMEngine, number: int,
                 timeout: float = 60.0) -> Iterator[tuple[threading.Event, threading.Event]]:
    """The engine's forward pass `number` (1-based, counted from here) sets `held`, then waits for `release`
    (set on leaving the block at the latest). What a test does while it waits happens mid-generate however slowly
    the machine runs either thread: tiny-llama writes 1000 tokens a second, a race no "long" request wins."""
    runner = engine.runner
    own = "execute_model" in vars(runner)
    execute = runner.execute_model
    held, release, calls = threading.Event(), threading.Event(), [0]

    def gated(scheduler_output):
        calls[0] += 1
        if calls[0] == number:
            held.set()
            release.wait(timeout)
        return execute(scheduler_output)

    runner.execute_model = gated
    try:
        yield held, release
    finally:
        release.set()
        if own:
            runner.execute_model = execute
        else:
            del runner.execute_model


# The end-to-end workload of the preemption suites (tests/core/test_preemption.py, tests/engine/test_fp8_engine.py):
# tiny-llama, 10 random prompts of 4 to 39 tokens, greedy, 8 to 23 new tokens each.
E2E_RNG = random.Random(1)
E2E_PROMPTS = [[E2E_RNG.randrange(3, 512) for _ in range(E2E_RNG.randrange(4, 40))] for _ in range(10)]
E2E_PARAMS = [SamplingParams(max_tokens=E2E_RNG.randrange(8, 24), temperature=0.0, ignore_eos=True)
              for _ in E2E_PROMPTS]
