"""Official tests of lab 17_coding_round: three classes written from a blank page, as in a live-coding round.

`ContinuousBatcher` (with its `TokenStream`) runs a fake model on its own step thread while request threads
submit, stream and abort; `PriorityBatcher` admits requests by SLO deadline with length-aware packing and a
starvation bound; `StridedTensor` is shape, strides and offset over a flat list, graded against torch. Plus
design questions (`expect_prediction`: a failure says which way it is off, never the answer).

No engine seam: nothing of the engine is replaced, so no test plugs. Every wait on the learner's threads is
bounded (grader/concurrency.py): a deadlock or a lost wake-up fails within `WAIT_S` with every thread's
stack. The concurrency tests are deterministic where they can be: a `StepGate` step function holds each model
step until the test releases it, so the test knows which requests each batch holds. The stress tests are
not (random aborts at random moments): they observe only timing-independent facts (the requests whose
stream broke the contract, expected none). Reference values come from specifications written here
(`continuous_timeline`, `edf_admission`, `simulate_ttft`) and from torch.
"""
import contextlib
import functools
import math
import random
import threading
import time

import pytest
import torch
from hypothesis import given, seed
from hypothesis import strategies as st

from grader.concurrency import (Deadlock, StepGate, run_bounded, started_threads, thread_cpu_seconds, thread_stacks,
                                wait_for, watch_threads)
from grader.harness import lab_settings
from grader.observe import expect_close, expect_equal, expect_prediction, expect_raises

LAB = "17_coding_round"
WAIT_S = 5.0  # a bounded wait: a healthy batcher answers in milliseconds; well under the 20 s limit of bug runs
CLEANUP_S = 2.0  # closing a test's batcher at its end, whatever happened (a stuck one is left to die with the run)


def next_token(tokens: list[int]) -> int:
    """The fake model, written independently of the notebook's copy (the same function)."""
    return (31 * sum(tokens) + 7 * len(tokens) + tokens[-1]) % 1000


def greedy(prompt: list[int], max_tokens: int) -> list[int]:
    """The tokens a request must stream: the fake model run alone on it."""
    tokens = list(prompt)
    for _ in range(max_tokens):
        tokens.append(next_token(tokens))
    return tokens[len(prompt):]


def prompt_of(request_id: str, length: int) -> list[int]:
    return [(37 * k + 11 * len(request_id) + ord(request_id[-1])) % 997 + 1 for k in range(length)]


def watched(test):
    """Runs the test inside `watch_threads`: a thread that dies is recorded and named in a Deadlock's message."""
    @functools.wraps(test)
    def run(student):
        with watch_threads():
            return test(student)
    return run


@contextlib.contextmanager
def batcher(student, step_fn, max_batch_size=4, token_budget=64, max_waiting=16):
    """A learner's batcher, closed (bounded) at the end whatever happened."""
    b = run_bounded(student.ContinuousBatcher, step_fn, max_batch_size, token_budget, max_waiting,
                    timeout=WAIT_S, what="ContinuousBatcher(...)")
    try:
        yield b
    finally:
        with contextlib.suppress(Exception):
            run_bounded(b.close, False, timeout=CLEANUP_S, what="close(drain=False) at the end of the test")


def quietly(fn, *args):
    """A target for a test's own thread: an exception from the learner's code shows in the observations (a stream
    that never ends), never as a dying thread."""
    def run():
        with contextlib.suppress(Exception):
            fn(*args)
    return run


def read(stream, what: str) -> list[int]:
    """Every token of a stream, bounded."""
    return run_bounded(lambda: [int(t) for t in stream], timeout=WAIT_S, what=f"reading {what}'s stream")


# ---- task 1: ContinuousBatcher ------------------------------------------------------------------

def continuous_timeline(first, rest, max_batch_size: int, token_budget: int) -> list[list[str]]:
    """The specification: request ids of each step when `first` (id, prompt length, max_tokens) runs alone
    in step 1 and `rest` were submitted during it. A running request stays until it has max_tokens tokens
    (1 token of budget each); between steps waiting requests join first come first served while a slot is
    free and their prompt fits the budget left, stopping at the first that does not fit."""
    lengths = {rid: (n, m) for rid, n, m in [first, *rest]}
    waiting, running, produced, steps = [rid for rid, _, _ in rest], [first[0]], {first[0]: 0}, []
    while running or waiting:
        if steps:
            budget = token_budget - len(running)
            while waiting and len(running) < max_batch_size and lengths[waiting[0]][0] <= budget:
                budget -= lengths[waiting[0]][0]
                produced[waiting[0]] = 0
                running.append(waiting.pop(0))
        steps.append(sorted(running))
        for rid in running:
            produced[rid] += 1
        running = [rid for rid in running if produced[rid] < lengths[rid][1]]
    return steps


def run_timeline(student, first, rest, max_batch_size, token_budget):
    """Submits `first`, holds step 1 until `rest` are submitted, then lets every step run; returns the
    batches (sorted ids per step) and each request's tokens."""
    gate = StepGate(next_token, timeout=WAIT_S)
    with batcher(student, gate.step_fn, max_batch_size, token_budget, max_waiting=len(rest) + 1) as b:
        streams = {first[0]: b.submit(first[0], prompt_of(first[0], first[1]), first[2])}
        gate.wait_for_step(1)
        for rid, n, m in rest:
            streams[rid] = run_bounded(b.submit, rid, prompt_of(rid, n), m, timeout=WAIT_S, what=f"submit({rid!r})")
        gate.open()
        outputs = {rid: read(s, rid) for rid, s in streams.items()}
    return [sorted(batch) for batch in gate.batches], outputs


@pytest.mark.points(2)
@pytest.mark.task("continuous_batcher")
@watched
def test_batcher_streams_each_requests_tokens(student):
    """Three requests on a free-running batcher: each stream yields the fake model's greedy tokens, then ends
    with finish_reason "length"; the step thread is a daemon thread (a forgotten close never hangs exit)."""
    gate = StepGate(next_token, held=False, timeout=WAIT_S)
    before = set(threading.enumerate())
    with batcher(student, gate.step_fn) as b:
        started = started_threads(before)
        streams = {rid: b.submit(rid, prompt_of(rid, n), m) for rid, n, m in [("a", 5, 4), ("b", 3, 6), ("c", 9, 1)]}
        outputs = {rid: read(s, rid) for rid, s in streams.items()}
        reasons = {rid: s.finish_reason for rid, s in streams.items()}
        daemons = [t.daemon for t in started]
    expect_equal(outputs, {rid: greedy(prompt_of(rid, n), m) for rid, n, m in [("a", 5, 4), ("b", 3, 6), ("c", 9, 1)]},
                 "tokens of a (5-token prompt, max_tokens 4), b (3, 6), c (9, 1)")
    expect_equal(reasons, {"a": "length", "b": "length", "c": "length"}, "finish_reason of a, b, c")
    expect_equal(daemons, [True], "the threads your constructor started, daemon or not (one step thread)")


@pytest.mark.points(1)
@pytest.mark.task("continuous_batcher")
@watched
def test_batcher_rejects_bad_input(student):
    """Bad arguments raise ValueError before any state changes; submit after close raises RuntimeError."""
    gate = StepGate(next_token, held=False, timeout=WAIT_S)
    for args, name in [((0, 8, 4), "max_batch_size 0"), ((4, 2, 4), "token_budget 2 < max_batch_size 4"),
                       ((4, 8, 0), "max_waiting 0")]:
        expect_raises(ValueError, student.ContinuousBatcher, gate.step_fn, *args, message=f"ContinuousBatcher: {name}")
    with batcher(student, gate.step_fn, max_batch_size=2, token_budget=8) as b:
        expect_raises(ValueError, b.submit, "e", [], 3, message="submit: an empty prompt")
        expect_raises(ValueError, b.submit, "long", [1] * 9, 3, message="submit: a 9-token prompt, token_budget 8")
        expect_raises(ValueError, b.submit, "z", [1, 2], 0, message="submit: max_tokens 0")
        stream = b.submit("x", [1, 2], 3)
        tokens = read(stream, "x")
        expect_equal(tokens, greedy([1, 2], 3), "x's tokens after the rejected submits")
        expect_equal(b.abort("x"), False, "abort('x') after x finished")
        expect_equal(b.abort("nobody"), False, "abort of an id never submitted")
        run_bounded(b.close, True, timeout=WAIT_S, what="close()")
        expect_raises(RuntimeError, b.submit, "late", [1], 1, message="submit after close()")


TIMELINE_FIRST = ("a", 6, 3)
TIMELINE_REST = [("b", 4, 8), ("c", 7, 2), ("d", 3, 5), ("e", 5, 4), ("f", 2, 6)]  # (id, prompt length, max_tokens)


@pytest.mark.points(3)
@pytest.mark.task("continuous_batcher")
@watched
def test_batches_follow_continuous_batching(student):
    """a runs alone in step 1; b-f are submitted during it. With 3 slots and a budget of 16 tokens a finished
    request's slot is refilled at the next step (not when the whole batch is done), first come first served,
    a prompt joining only if it fits the budget left: 13 steps, where one request at a time takes 28."""
    batches, outputs = run_timeline(student, TIMELINE_FIRST, TIMELINE_REST, 3, 16)
    expect_equal(batches, continuous_timeline(TIMELINE_FIRST, TIMELINE_REST, 3, 16),
                 "request ids of each step (sorted): a alone, then b-f, 3 slots, budget 16")
    expect_equal(outputs, {rid: greedy(prompt_of(rid, n), m) for rid, n, m in [TIMELINE_FIRST, *TIMELINE_REST]},
                 "every request's tokens")
    assert len(continuous_timeline(TIMELINE_FIRST, TIMELINE_REST, 3, 16)) == 13 and \
        sum(m for _, _, m in [TIMELINE_FIRST, *TIMELINE_REST]) == 28, "the docstring's counts (a test bug)"


@pytest.mark.points(2)
@pytest.mark.task("continuous_batcher")
@watched
def test_batches_under_a_tight_token_budget(student):
    """Long prompts against a budget of 12: a waiting prompt joins only when the running decodes leave it room,
    and the queue does not skip ahead of it (first come first served)."""
    first, rest = ("p", 10, 2), [("q", 9, 3), ("r", 2, 6), ("s", 11, 1), ("t", 1, 7), ("u", 6, 2)]
    batches, outputs = run_timeline(student, first, rest, 4, 12)
    expect_equal(batches, continuous_timeline(first, rest, 4, 12),
                 "request ids of each step (sorted): p alone, then q-u, 4 slots, budget 12")
    expect_equal(outputs, {rid: greedy(prompt_of(rid, n), m) for rid, n, m in [first, *rest]}, "every request's tokens")


@pytest.mark.points(2)
@pytest.mark.task("continuous_batcher")
@watched
def test_no_lock_is_held_across_the_model_step(student):
    """While step 1 runs (held by the test), submit and abort from other threads return at once: the batcher's
    lock is not held across the model step. Held, they would wait for a step that waits for them."""
    gate = StepGate(next_token, timeout=WAIT_S)
    with batcher(student, gate.step_fn, max_batch_size=2) as b:
        a = b.submit("a", [3, 1, 4], 3)
        gate.wait_for_step(1)
        b_stream = run_bounded(b.submit, "b", [1, 5], 2, timeout=WAIT_S, what="submit('b') during a model step")
        aborted = run_bounded(b.abort, "b", timeout=WAIT_S, what="abort('b') during a model step")
        c = run_bounded(b.submit, "c", [9, 2, 6], 2, timeout=WAIT_S, what="submit('c') during a model step")
        gate.open()
        outputs = {"a": read(a, "a"), "b": read(b_stream, "b"), "c": read(c, "c")}
    expect_equal(aborted, True, "abort('b') of a waiting request")
    expect_equal(outputs, {"a": greedy([3, 1, 4], 3), "b": [], "c": greedy([9, 2, 6], 2)},
                 "tokens of a, b (aborted while waiting), c")
    expect_equal([sorted(x) for x in gate.batches[:2]], [["a"], ["a", "c"]], "the first two batches")


@pytest.mark.points(2)
@pytest.mark.task("continuous_batcher")
@watched
def test_abort_frees_the_slot_within_one_step(student):
    """2 slots. Step 2 holds a and b, c waits. a is aborted during step 2: the token step 2 made for a is never
    delivered, a's stream ends with finish_reason "abort", and step 3 already holds c in a's slot."""
    gate = StepGate(next_token, timeout=WAIT_S)
    with batcher(student, gate.step_fn, max_batch_size=2) as b:
        streams = {"a": b.submit("a", [2, 7], 6)}
        gate.wait_for_step(1)
        streams |= {rid: b.submit(rid, p, 4) for rid, p in [("b", [1, 8]), ("c", [2, 8, 1])]}
        gate.release()
        second = gate.wait_for_step(2)
        aborted = run_bounded(b.abort, "a", timeout=WAIT_S, what="abort('a') during step 2")
        again = run_bounded(b.abort, "a", timeout=WAIT_S, what="abort('a') a second time")
        gate.release()
        third = gate.wait_for_step(3)
        gate.open()
        outputs = {rid: read(s, rid) for rid, s in streams.items()}
        reasons = {rid: s.finish_reason for rid, s in streams.items()}
        batch_sizes = max(len(batch) for batch in gate.batches)
    expect_equal((sorted(second), aborted, again, sorted(third)), (["a", "b"], True, False, ["b", "c"]),
                 "(step 2's batch, abort('a'), a second abort('a'), step 3's batch)")
    expect_equal(outputs, {"a": greedy([2, 7], 6)[:1], "b": greedy([1, 8], 4), "c": greedy([2, 8, 1], 4)},
                 "tokens of a (aborted during step 2: only step 1's token), b and c")
    expect_equal(reasons, {"a": "abort", "b": "length", "c": "length"}, "finish_reason of a, b, c")
    expect_equal(batch_sizes, 2, "the largest batch of the run (2 slots; an abort that frees twice overfills)")


@pytest.mark.points(2)
@pytest.mark.task("continuous_batcher")
@watched
def test_a_full_queue_pushes_back(student):
    """1 slot, room for 2 waiting requests. While a runs (step 1 held) b and c fill the queue: submit with
    timeout=0 raises QueueFull at once, with timeout=0.05 after waiting; with timeout=None it blocks until
    admission makes room, then d runs like any other request."""
    gate = StepGate(next_token, timeout=WAIT_S)
    with batcher(student, gate.step_fn, max_batch_size=1, token_budget=8, max_waiting=2) as b:
        streams = {"a": b.submit("a", [4, 4], 2)}
        gate.wait_for_step(1)
        streams |= {rid: b.submit(rid, [n, 1], 2) for rid, n in [("b", 5), ("c", 6)]}
        for timeout in (0, 0.05):
            expect_raises(student.QueueFull, lambda: run_bounded(b.submit, "d", [7, 1], 2, timeout, timeout=WAIT_S,
                                                                 what=f"submit('d', timeout={timeout})"),
                          message=f"submit('d', [7, 1], 2, timeout={timeout}) with the queue full")
        submitted, holder = threading.Event(), {}

        def blocking_submit():
            with contextlib.suppress(Exception):  # a failure shows as d never submitted
                holder["d"] = b.submit("d", [7, 1], 2)
                submitted.set()

        threading.Thread(target=blocking_submit, name="grader: submit('d') blocking", daemon=True).start()
        gate.open()
        wait_for(submitted, WAIT_S, "submit('d', timeout=None) once the queue had room again")
        streams["d"] = holder["d"]
        outputs = {rid: read(s, rid) for rid, s in streams.items()}
    expect_equal(outputs, {rid: greedy(p, 2) for rid, p in [("a", [4, 4]), ("b", [5, 1]), ("c", [6, 1]),
                                                             ("d", [7, 1])]}, "tokens of a, b, c and d")


@pytest.mark.points(2)
@pytest.mark.task("continuous_batcher")
@watched
def test_close_drains_or_cancels(student):
    """close() (drain) called while step 1 is held with five requests queued lets every one of them finish, then
    the step thread ends; close(drain=False) during a step ends every stream at once with finish_reason
    "cancelled" and drops the step's tokens."""
    gate = StepGate(next_token, timeout=WAIT_S)
    before = set(threading.enumerate())
    b = run_bounded(student.ContinuousBatcher, gate.step_fn, 2, 16, 64, timeout=WAIT_S, what="ContinuousBatcher")
    threads = started_threads(before)
    streams = {rid: b.submit(rid, prompt_of(rid, 3), 4) for rid in "abcde"}
    gate.wait_for_step(1)
    closer = threading.Thread(target=quietly(b.close), name="grader: close()", daemon=True)
    closer.start()
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:  # until close() has taken effect: submit refuses (probes are drained too)
        try:
            b.submit(f"probe{time.monotonic_ns()}", [1], 1, 0)
        except Exception:  # noqa: BLE001 - RuntimeError once closed (anything else: the observations below tell)
            break
    gate.open()
    drained = {rid: (read(s, rid), s.finish_reason) for rid, s in streams.items()}
    run_bounded(closer.join, timeout=WAIT_S, what="close(drain=True) returning")
    alive = [t.is_alive() for t in threads]
    expect_equal(drained, {rid: (greedy(prompt_of(rid, 3), 4), "length") for rid in "abcde"},
                 "(tokens, finish_reason) of a-e after close(drain=True) while they were queued")
    expect_equal(alive, [False], "your step thread is alive after close() returned")

    gate = StepGate(next_token, timeout=WAIT_S)
    b = run_bounded(student.ContinuousBatcher, gate.step_fn, 2, 16, 8, timeout=WAIT_S, what="ContinuousBatcher")
    streams = {"a": b.submit("a", [1, 1], 5)}
    gate.wait_for_step(1)
    streams["b"] = b.submit("b", [2, 2], 5)
    closer = threading.Thread(target=quietly(b.close, False), name="grader: close(drain=False)", daemon=True)
    closer.start()
    cancelled = {rid: (read(s, rid), s.finish_reason) for rid, s in streams.items()}
    gate.open()
    run_bounded(closer.join, timeout=WAIT_S, what="close(drain=False) returning")
    expect_equal(closer.is_alive(), False, "close(drain=False) returned")
    expect_equal(cancelled, {"a": ([], "cancelled"), "b": ([], "cancelled")},
                 "(tokens, finish_reason) of a (running in the held step 1) and b (waiting) after close(drain=False)")
    expect_raises(RuntimeError, b.submit, "c", [1], 1, message="submit after close(drain=False)")


@pytest.mark.points(2)
@pytest.mark.task("continuous_batcher")
@watched
def test_an_idle_batcher_uses_no_cpu(student):
    """After its work is done the step thread sleeps on a condition: over half a second of idleness the threads
    your batcher started use (nearly) no CPU time. Busy-waiting or polling every millisecond would.

    Thread CPU time, not wall time: a loaded machine delays a spinning thread but still charges it every
    microsecond it spins, and charges a sleeping thread nothing. The half second is the window measured, not a
    wait for an event; 5 ms of tolerance covers a few wake-ups (a 1 ms poll spends ~10-50 ms here)."""
    gate = StepGate(next_token, held=False, timeout=WAIT_S)
    before = set(threading.enumerate())
    with batcher(student, gate.step_fn) as b:
        threads = started_threads(before)
        read(b.submit("warm", [1, 2, 3], 3), "warm")
        start = thread_cpu_seconds(threads)
        time.sleep(0.5)
        idle_ms = 1000 * (thread_cpu_seconds(threads) - start)
        late = read(b.submit("late", [5, 5], 2), "late")  # still awake for new work
    assert threads, "your constructor started no thread (a test bug)"
    expect_close(idle_ms, 0.0, "CPU milliseconds your batcher's threads used in 0.5 s idle", atol=5.0)
    expect_equal(late, greedy([5, 5], 2), "tokens of a request submitted after the idle half second")


def stress(student, seed_value: int, clients: int, per_client: int, abort_share: float, max_waiting: int) -> list[str]:
    """Request threads submit (blocking on a full queue), read, and abort at random moments, some from other
    threads; the problems found, timing-independent: a stream that is not a prefix of its greedy tokens, a
    finished one that is short, a wrong finish_reason, a batch over the limits, a thread that never ended."""
    problems: list[str] = []
    lock = threading.Lock()
    seen_prefill: set[str] = set()
    prompts: dict[str, list[int]] = {}
    max_batch_size, token_budget = 4, 40

    def step_fn(batch):
        ids = [rid for rid, _ in batch]
        cost = sum(len(prompts[rid]) if rid not in seen_prefill else 1 for rid in ids)
        with lock:
            if len(set(ids)) != len(ids) or len(ids) > max_batch_size or cost > token_budget:
                problems.append(f"a batch of {len(ids)} requests (unique {len(set(ids))}) costing {cost} tokens")
        seen_prefill.update(ids)
        return [next_token(list(tokens)) for _, tokens in batch]

    outcome: dict[str, tuple] = {}
    aborters: list[threading.Thread] = []
    with batcher(student, step_fn, max_batch_size, token_budget, max_waiting) as b:
        def client(k: int) -> None:
            try:
                run_client(k)
            except Exception as exc:  # noqa: BLE001 - a problem to report, not a thread to kill
                with lock:
                    problems.append(f"client {k}: {type(exc).__name__} from your batcher: {exc}")

        def abort_later(rid: str) -> None:
            try:
                outcome[rid + "#"] = b.abort(rid)
            except Exception as exc:  # noqa: BLE001
                with lock:
                    problems.append(f"abort({rid!r}): {type(exc).__name__}: {exc}")

        def run_client(k: int) -> None:
            rng = random.Random(seed_value * 1000 + k)
            for j in range(per_client):
                rid = f"r{k}-{j}"
                prompt = [rng.randrange(1, 1000) for _ in range(rng.randint(1, 12))]
                with lock:
                    prompts[rid] = prompt
                max_tokens = rng.randint(1, 8)
                stream = b.submit(rid, prompt, max_tokens)
                tokens, aborted = [], None
                plan = rng.random()
                if plan < abort_share / 2:
                    aborted = b.abort(rid)
                elif plan < abort_share:
                    aborter = threading.Thread(target=abort_later, args=(rid,), name=f"grader: abort {rid}",
                                               daemon=True)
                    with lock:
                        aborters.append(aborter)
                    aborter.start()
                for token in stream:
                    tokens.append(token)
                    if aborted is None and plan < abort_share and rng.random() < 0.3:
                        aborted = b.abort(rid)
                outcome[rid] = (prompt, max_tokens, tokens, stream.finish_reason, aborted)
                if rng.random() < 0.1:
                    b.abort(f"unknown-{k}-{j}")

        workers = [threading.Thread(target=client, args=(k,), name=f"grader: client {k}", daemon=True)
                   for k in range(clients)]
        for w in workers:
            w.start()
        deadline = time.monotonic() + 2 * WAIT_S
        for w in workers + aborters:
            w.join(max(0.0, deadline - time.monotonic()))
        for w in aborters:  # started by now: every client ended
            w.join(max(0.0, deadline - time.monotonic()))
        stuck = [w.name for w in workers + aborters if w.is_alive()]
        if stuck:
            raise Deadlock(f"{stuck} still running after {2 * WAIT_S:g} s (a deadlock or a lost wake-up?). Each "
                           f"thread's stack:\n{thread_stacks()}")
    for rid, (prompt, max_tokens, tokens, reason, aborted) in sorted((k, v) for k, v in outcome.items()
                                                                     if not k.endswith("#")):
        want = greedy(prompt, max_tokens)
        if tokens != want[:len(tokens)]:
            problems.append(f"{rid}: its tokens are not the fake model's (lost, duplicated or reordered)")
        elif reason == "length" and tokens != want:
            problems.append(f"{rid}: finish_reason 'length' after {len(tokens)} of {max_tokens} tokens")
        elif reason not in ("length", "abort"):
            problems.append(f"{rid}: finish_reason {reason!r}")
        elif reason == "abort" and not (aborted or outcome.get(rid + "#")):
            problems.append(f"{rid}: finish_reason 'abort' but no abort() returned True for it")
    if len(outcome) < clients * per_client:
        problems.append(f"{clients * per_client - len(outcome)} requests never finished")
    return problems[:10]


@pytest.mark.points(4)
@pytest.mark.task("continuous_batcher")
@watched
def test_stress_many_threads_random_aborts(student):
    """12 request threads, 10 requests each, a third aborted at random moments (before reading, from another
    thread, or mid-stream), a waiting queue of 3 (submit blocks): every stream is a prefix of the fake
    model's tokens, complete unless aborted, every batch within 4 requests and 40 tokens, nothing hangs."""
    for seed_value in range(2):
        expect_equal(stress(student, seed_value, clients=12, per_client=10, abort_share=0.33, max_waiting=3), [],
                     f"problems found in stress run {seed_value} (12 threads x 10 requests, a third aborted)")


@pytest.mark.points(2)
@pytest.mark.task("continuous_batcher")
@watched
def test_stress_close_while_busy(student):
    """Threads keep submitting while another closes the batcher without draining: every submit either returns
    a stream that ends or raises RuntimeError, every stream ends, close returns, nothing hangs."""
    gate = StepGate(next_token, held=False, timeout=WAIT_S)
    b = run_bounded(student.ContinuousBatcher, gate.step_fn, 3, 32, 4, timeout=WAIT_S, what="ContinuousBatcher")
    errors, started = [], threading.Event()

    def client(k: int) -> None:
        for j in range(40):
            try:
                stream = b.submit(f"c{k}-{j}", [k + 1, j + 1], 6)
                started.set()
                list(stream)  # ends: finished, or cancelled by the close
            except RuntimeError:
                return
            except Exception as exc:  # noqa: BLE001 - reported below
                errors.append(type(exc).__name__)
                return

    clients = [threading.Thread(target=client, args=(k,), name=f"grader: client {k}", daemon=True) for k in range(6)]
    for c in clients:
        c.start()
    wait_for(started, WAIT_S, "the first request submitted")
    run_bounded(b.close, False, timeout=WAIT_S, what="close(drain=False) while threads submit")
    for c in clients:
        run_bounded(c.join, timeout=WAIT_S, what=f"{c.name} ending after close")
    expect_equal((errors, [c.is_alive() for c in clients]), ([], [False] * 6),
                 "(errors other than RuntimeError from submit, request threads still running) after close")


# ---- task 2: PriorityBatcher --------------------------------------------------------------------

def edf_admission(waiting: dict, skips: dict, slo_s: dict, budget: int, max_batch: int, max_skips: int) -> list[str]:
    """The specification of one `schedule()`: `waiting` {id: (class, prompt_len, arrival)}, `skips` {id: times
    passed over}, both updated in place. Order: starving requests (passed over max_skips times) first, then by
    deadline = arrival + slo, arrival, id. Walk in order until max_batch are admitted: admit what fits the
    budget left; a starving request that does not fit stops the walk; any other is passed over, and counts a
    skip if a request after it in the order is admitted."""
    def key(rid):
        cls, _, arrival = waiting[rid]
        return (skips[rid] < max_skips, arrival + slo_s[cls], arrival, rid)

    order = sorted(waiting, key=key)
    admitted, left, over = [], budget, []
    for rid in order:
        if len(admitted) == max_batch:
            break
        if waiting[rid][1] <= left:
            admitted.append(rid)
            left -= waiting[rid][1]
        elif skips[rid] >= max_skips:
            break
        else:
            over.append(rid)
    for rid in over:
        if admitted and order.index(rid) < order.index(admitted[-1]):
            skips[rid] += 1
    for rid in admitted:
        del waiting[rid], skips[rid]
    return admitted


SLO_S = {"interactive": 0.2, "standard": 1.0, "batch": 10.0}


@pytest.mark.points(2)
@pytest.mark.task("priority_batcher")
def test_priority_by_hand(student):
    """Budget 10, 3 per batch, max_skips 2. Deadlines: i1 0.25, s1 1.0, b1 10.0, i2 0.3. Step 1: i1 (4), i2 (5)
    fit, s1 (6) does not (1 token left) and is passed over, b1 (1) fits: [i1, i2, b1]. Step 2: s1 alone."""
    pb = student.PriorityBatcher(SLO_S, token_budget=10, max_batch_size=3, max_skips=2)
    for rid, cls, n, t in [("b1", "batch", 1, 0.0), ("s1", "standard", 6, 0.0), ("i1", "interactive", 4, 0.05),
                           ("i2", "interactive", 5, 0.1)]:
        pb.add(rid, cls, n, t)
    first, left, second, third = pb.schedule(), len(pb), pb.schedule(), pb.schedule()
    expect_equal((first, left, second, third), (["i1", "i2", "b1"], 1, ["s1"], []),
                 "(step 1, requests left waiting, step 2, step 3)")


@pytest.mark.points(1)
@pytest.mark.task("priority_batcher")
def test_priority_rejects_bad_input(student):
    """Bad arguments raise ValueError naming the parameter."""
    pb = student.PriorityBatcher(SLO_S, token_budget=8, max_batch_size=2, max_skips=1)
    expect_raises(ValueError, pb.add, "x", "gold", 3, 0.0, match="slo_class", message="add: an unknown class")
    expect_raises(ValueError, pb.add, "x", "batch", 9, 0.0, match="prompt_len", message="add: 9 tokens, budget 8")
    expect_raises(ValueError, pb.add, "x", "batch", 0, 0.0, match="prompt_len", message="add: 0 tokens")
    pb.add("x", "batch", 3, 0.0)
    expect_raises(ValueError, pb.add, "x", "batch", 3, 1.0, match="request_id", message="add: x while x waits")
    expect_raises(ValueError, student.PriorityBatcher, SLO_S, 0, 2, 1, match="token_budget",
                  message="PriorityBatcher: token_budget 0")
    expect_raises(ValueError, student.PriorityBatcher, SLO_S, 8, 2, -1, match="max_skips",
                  message="PriorityBatcher: max_skips -1")


requests_and_steps = st.lists(st.tuples(st.sampled_from(sorted(SLO_S)), st.integers(1, 12),
                                        st.integers(0, 50), st.integers(0, 3)), min_size=1, max_size=25)


@given(requests_and_steps, st.integers(1, 4), st.integers(0, 3))
@seed(1717)
@lab_settings(60)
@pytest.mark.points(4)
@pytest.mark.task("priority_batcher")
def test_priority_admission_follows_the_rule(student, trace, max_batch, max_skips):
    """Random arrivals (class, prompt length, arrival in 10 ms, schedule calls after it) against the stated
    rule: every schedule() returns exactly the specification's ids in its order; so each batch is within the
    budget and size, no request is admitted twice, and a request passed over max_skips times is never
    passed again."""
    pb = student.PriorityBatcher(SLO_S, token_budget=12, max_batch_size=max_batch, max_skips=max_skips)
    got, waiting, skips, want = [], {}, {}, []
    for k, (cls, n, t, steps) in enumerate(sorted(trace, key=lambda r: r[2])):
        pb.add(f"r{k}", cls, n, t / 100)
        waiting[f"r{k}"], skips[f"r{k}"] = (cls, n, t / 100), 0
        for _ in range(steps):
            got.append(pb.schedule())
            want.append(edf_admission(waiting, skips, SLO_S, 12, max_batch, max_skips))
    while waiting:
        got.append(pb.schedule())
        want.append(edf_admission(waiting, skips, SLO_S, 12, max_batch, max_skips))
    expect_equal(got, want, "each schedule()'s ids for a random trace (budget 12)")


@pytest.mark.points(2)
@pytest.mark.task("priority_batcher")
def test_starvation_bound(student):
    """Budget 10, max_skips 3. A 10-token standard request (deadline 1.0 s) waits; every 10 ms one 2-token
    interactive request arrives (an earlier deadline: it goes first) and four 2-token batch requests (later
    deadlines) are packed into the 8 tokens left, passing the long one over. After 3 skips it is starving and
    goes first: admitted at step 4. Without the bound it waits until the interactive deadlines pass its own
    (80 steps)."""
    pb = student.PriorityBatcher(SLO_S, token_budget=10, max_batch_size=8, max_skips=3)
    pb.add("long", "standard", 10, 0.0)
    admitted_at, k = None, 0
    for step_index in range(1, 51):
        pb.add(f"i{step_index}", "interactive", 2, step_index * 0.01)
        for _ in range(4):
            pb.add(f"b{k}", "batch", 2, step_index * 0.01)
            k += 1
        if "long" in pb.schedule():
            admitted_at = step_index
            break
    expect_equal(admitted_at, 4, "the step that admits the 10-token request (max_skips 3)")


class FcfsBatcher:
    """The baseline: first come first served, stopping at the first prompt that does not fit."""

    def __init__(self, slo_s, token_budget, max_batch_size, max_skips):
        self.budget, self.max_batch, self.queue = token_budget, max_batch_size, []

    def add(self, rid, cls, n, t):
        self.queue.append((rid, n))

    def schedule(self):
        out, left = [], self.budget
        while self.queue and len(out) < self.max_batch and self.queue[0][1] <= left:
            rid, n = self.queue.pop(0)
            out.append(rid)
            left -= n
        return out


def hidden_trace(seed_value: int) -> list[tuple]:
    """Three bursts of 40-60 long batch-tier prompts, 0.8 s apart, with interactive and standard requests
    arriving among them (60/s): (id, class, prompt length, arrival), by arrival."""
    rng, trace = random.Random(seed_value), []
    for burst in range(3):
        start = burst * 0.8
        for _ in range(rng.randint(40, 60)):
            trace.append(("batch", rng.randint(40, 64), round(start + rng.uniform(0, 0.02), 6)))
        t = start
        while t < start + 0.8:
            t += rng.expovariate(60.0)
            cls = rng.choices(["interactive", "standard"], [0.6, 0.4])[0]
            trace.append((cls, rng.randint(4, 16) if cls == "interactive" else rng.randint(8, 40), round(t, 6)))
    return [(f"q{k}", *r) for k, r in enumerate(sorted(trace, key=lambda r: r[2]))]


def simulate_ttft(make, trace) -> dict[str, int]:
    """Replays `trace` on a fake clock: each step prefills what the batcher admits (budget 64 tokens, 8 requests,
    max_skips 4) and lasts 2 ms + 150 us per token. Returns, per class, the requests whose first token came
    within their SLO (goodput)."""
    pb = make(SLO_S, 64, 8, 4)
    now, pending, info, met = 0.0, list(trace), {}, {cls: 0 for cls in SLO_S}
    waiting = 0
    while pending or waiting:
        while pending and pending[0][3] <= now:
            rid, cls, n, t = pending.pop(0)
            pb.add(rid, cls, n, t)
            info[rid], waiting = (cls, n, t), waiting + 1
        if not waiting:
            now = pending[0][3]
            continue
        admitted = pb.schedule()
        now += 0.002 + 0.00015 * sum(info[rid][1] for rid in admitted)
        waiting -= len(admitted)
        for rid in admitted:
            cls, _, t = info[rid]
            met[cls] += now - t <= SLO_S[cls]
    return met


class SpecBatcher:
    """`edf_admission` wrapped in the class's interface, for the reference goodput."""

    def __init__(self, slo_s, token_budget, max_batch_size, max_skips):
        self.args, self.waiting, self.skips = (slo_s, token_budget, max_batch_size, max_skips), {}, {}

    def add(self, rid, cls, n, t):
        self.waiting[rid], self.skips[rid] = (cls, n, t), 0

    def schedule(self):
        return edf_admission(self.waiting, self.skips, *self.args)


@pytest.mark.points(3)
@pytest.mark.task("priority_batcher")
def test_goodput_beats_fcfs_on_hidden_traces(student):
    """Three traces you do not see, replayed on a fake clock: the requests of each class meeting their TTFT SLO
    equal the rule's. There every request meets its SLO, where first come first served loses 30-60 interactive
    requests behind each trace's bursts."""
    for seed_value in (11, 12, 13):
        met = simulate_ttft(student.PriorityBatcher, hidden_trace(seed_value))
        expect_equal(met, simulate_ttft(SpecBatcher, hidden_trace(seed_value)),
                     f"requests meeting their TTFT SLO per class on hidden trace {seed_value}")
        assert sum(simulate_ttft(SpecBatcher, hidden_trace(seed_value)).values()) > \
            sum(simulate_ttft(FcfsBatcher, hidden_trace(seed_value)).values()), "EDF beats FCFS here (a test bug)"


# ---- task 3: StridedTensor ----------------------------------------------------------------------

def pair(shape: list[int]):
    """A learner's contiguous tensor over 0..n-1 and torch's."""
    n = math.prod(shape)
    return n, torch.arange(n, dtype=torch.float64).view(shape)


def layout(x) -> tuple:
    """What is compared with torch: shape, strides, storage offset, values."""
    return tuple(x.shape), tuple(x.strides), x.offset, x.tolist()


def torch_layout(t: torch.Tensor) -> tuple:
    return tuple(t.shape), t.stride(), t.storage_offset(), t.tolist()


@pytest.mark.points(2)
@pytest.mark.task("strided_tensor")
def test_strided_by_hand(student):
    """A (2, 3, 4) tensor over 0..23: permute, transpose, slicing and view, layouts checked by hand (strides
    (12, 4, 1); permute(2, 0, 1) -> (1, 12, 4); x[1, ::2, 1:3] -> offset 13, strides (8, 1))."""
    x = student.StridedTensor(list(range(24)), (2, 3, 4))
    expect_equal(layout(x.permute(2, 0, 1))[:3], ((4, 2, 3), (1, 12, 4), 0), "permute(2, 0, 1): shape, strides, offset")
    expect_equal(layout(x[1, ::2, 1:3]), ((2, 2), (8, 1), 13, [[13, 14], [21, 22]]), "x[1, ::2, 1:3]")
    expect_equal(layout(x.transpose(0, 2).contiguous())[:2], ((4, 3, 2), (6, 2, 1)), "transpose(0, 2).contiguous()")
    expect_equal(layout(x.view(6, 4))[:3], ((6, 4), (4, 1), 0), "view(6, 4)")
    expect_equal(x.transpose(1, 2).is_contiguous(), False, "transpose(1, 2).is_contiguous()")
    expect_raises(RuntimeError, x.transpose(1, 2).view, 24, message="transpose(1, 2).view(24): not viewable")
    expect_equal(layout(x.transpose(0, 1).view(3, 2, 2, 2))[:3], ((3, 2, 2, 2), (4, 12, 2, 1), 0),
                 "transpose(0, 1).view(3, 2, 2, 2): splitting the last dim needs no copy")


@pytest.mark.points(2)
@pytest.mark.task("strided_tensor")
def test_views_share_storage(student):
    """Views (view, transpose, permute, slices) are windows on the same list: a write to the list shows through
    all of them; contiguous() of a contiguous tensor is itself, of a transposed one a copy."""
    storage = list(range(12))
    x = student.StridedTensor(storage, (3, 4))
    views = [x.view(4, 3), x.transpose(0, 1), x.permute(1, 0), x[1:, 1::2], x.view(-1)]
    shared = [v.storage is storage for v in views]
    storage[5] = 100
    seen = [x.view(4, 3).tolist()[1][2], x.transpose(0, 1).tolist()[1][1], x[1:, 1::2].tolist()[0][0]]
    copy = x.transpose(0, 1).contiguous()
    expect_equal(shared, [True] * 5, "view, transpose, permute, slice and view(-1) share the list")
    expect_equal(seen, [100, 100, 100], "element 5 after storage[5] = 100, read through three views")
    expect_equal((x.contiguous() is x, copy.storage is storage, copy.is_contiguous()), (True, False, True),
                 "(x.contiguous() is x, transpose's contiguous() shares the list, is it contiguous)")


def random_chain(rng: random.Random, x, t):
    """Applies the same random views to the learner's tensor and torch's; a view torch refuses must raise
    RuntimeError in both."""
    outcome = []
    for _ in range(5):
        op = rng.choice(["permute", "transpose", "slice", "view", "view", "contiguous", "index"])
        if op == "permute":
            dims = list(range(t.dim()))
            rng.shuffle(dims)
            x, t = x.permute(*dims), t.permute(*dims)
        elif op == "transpose":
            a, b = rng.randrange(-t.dim(), t.dim()), rng.randrange(t.dim())
            x, t = x.transpose(a, b), t.transpose(a, b)
        elif op == "slice":
            d = rng.randrange(t.dim())
            start = rng.randrange(t.shape[d])
            index = (slice(None),) * d + (slice(start, rng.randint(start + 1, t.shape[d]), rng.randint(1, 3)),)
            x, t = x[index], t[index]
        elif op == "index" and t.dim() > 1:
            d = rng.randrange(t.dim())
            index = (slice(None),) * d + (rng.randrange(-t.shape[d], t.shape[d]),)
            x, t = x[index], t[index]
        elif op == "view":
            shape, left = [], t.numel()
            while left > 1:
                f = rng.choice([k for k in range(2, left + 1) if left % k == 0])
                shape.append(f)
                left //= f
            shape = shape or [1]
            if rng.random() < 0.3:
                shape.insert(rng.randrange(len(shape) + 1), 1)
            if rng.random() < 0.3:
                shape[rng.randrange(len(shape))] = -1
            try:
                t2 = t.view(shape)
            except RuntimeError:
                outcome.append(("view raised", type(expect_raises(RuntimeError, x.view, *shape,
                                                                  message=f"view{tuple(shape)}")).__name__))
                continue
            x, t = x.view(*shape), t2
        elif op == "contiguous":
            x, t = x.contiguous(), t.contiguous()
        outcome.append((op, layout(x)))
    return outcome, x, t


@given(st.lists(st.integers(1, 4), min_size=1, max_size=4), st.integers(0, 2**32 - 1))
@seed(1718)
@lab_settings(80)
@pytest.mark.points(4)
@pytest.mark.task("strided_tensor")
def test_strided_matches_torch_on_random_chains(student, shape, chain_seed):
    """Random shapes, random chains of permute / transpose / slices / integer indices / view / contiguous: after
    each op the shape, strides, storage offset and values equal torch's; a view torch refuses raises."""
    n, t = pair(shape)
    x = student.StridedTensor([float(v) for v in range(n)], shape)
    got, _, t_final = random_chain(random.Random(chain_seed), x, t)
    want, _, _ = random_chain(random.Random(chain_seed), _TorchAsStrided(t), t)
    expect_equal(got, want, f"layouts after a random chain of views from shape {tuple(shape)} (torch's on the right)")


class _TorchAsStrided:
    """torch's tensor behind the learner's interface: the expected side of the random chains."""

    def __init__(self, t: torch.Tensor) -> None:
        self.t = t
        self.shape, self.strides, self.offset = tuple(t.shape), t.stride(), t.storage_offset()

    def tolist(self):
        return self.t.tolist()

    def __getitem__(self, index):
        return _TorchAsStrided(self.t[index])

    def view(self, *shape):
        return _TorchAsStrided(self.t.view(shape))

    def permute(self, *dims):
        return _TorchAsStrided(self.t.permute(dims))

    def transpose(self, a, b):
        return _TorchAsStrided(self.t.transpose(a, b))

    def contiguous(self):
        return _TorchAsStrided(self.t.contiguous())


@pytest.mark.points(2)
@pytest.mark.task("strided_tensor")
def test_broadcasting_and_matmul_match_torch(student):
    """Elementwise + and * broadcast as torch does (trailing dims aligned, size 1 stretched, a Python number),
    also on non-contiguous operands; matmul of 2-D tensors, one of them transposed. Integer values: exact."""
    rng = random.Random(7)
    cases = [((2, 3, 4), (3, 1)), ((4,), (2, 3, 4)), ((1, 3, 1), (2, 1, 5)), ((3, 2), (3, 2))]
    got, want = [], []
    for a_shape, b_shape in cases:
        a_vals = [rng.randint(-9, 9) for _ in range(math.prod(a_shape))]
        b_vals = [rng.randint(-9, 9) for _ in range(math.prod(b_shape))]
        a, b = student.StridedTensor(a_vals, a_shape), student.StridedTensor(b_vals, b_shape)
        ta = torch.tensor(a_vals, dtype=torch.float64).view(a_shape)
        tb = torch.tensor(b_vals, dtype=torch.float64).view(b_shape)
        got += [(a + b).tolist(), (a * b).tolist(), (a * 3).tolist()]
        want += [(ta + tb).tolist(), (ta * tb).tolist(), (ta * 3).tolist()]
    m = student.StridedTensor([float(v) for v in range(12)], (3, 4))
    tm = torch.arange(12, dtype=torch.float64).view(3, 4)
    got += [(m.transpose(0, 1) + m.transpose(0, 1)).tolist(), m.matmul(m.transpose(0, 1)).tolist(),
            (m.transpose(0, 1) @ m[:, 1:3]).tolist()]
    want += [(tm.t() + tm.t()).tolist(), (tm @ tm.t()).tolist(), (tm.t() @ tm[:, 1:3]).tolist()]
    expect_equal(got, want, "broadcast +, *, scalar * and matmul results against torch, case by case")
    expect_raises(RuntimeError, lambda: m + student.StridedTensor(list(range(3)), (3,)),
                  message="(3, 4) + (3,): sizes 4 and 3 do not broadcast")
    expect_raises(RuntimeError, m.matmul, m, message="(3, 4) @ (3, 4): inner sizes differ")


# ---- task 4: predictions and design questions (failures never show the answer) -------------------

@pytest.mark.points(1)
@pytest.mark.task("design")
def test_predicted_steps(student):
    """Four requests with max_tokens 2, 8, 3, 8, two slots, all waiting before the first step. Continuous: a and
    b at step 1, a done after step 2, c in steps 3-5, d in 6-13 beside b (done at 8): 13 steps. Static: the
    batch [a, b] runs 8 steps, then [c, d] 8 more: 16."""
    expect_prediction(student.predicted_steps(), (13, 16),
                      "predicted_steps(): (steps under continuous batching, under static batching); on a miss, replay "
                      "the schedule step by step: which slot frees when, and who takes it")


@pytest.mark.points(1)
@pytest.mark.task("design")
def test_predicted_layout(student):
    """arange(24).view(2, 3, 4).permute(2, 0, 1): its strides, and whether .view(24) of it works."""
    t = torch.arange(24).view(2, 3, 4).permute(2, 0, 1)
    expect_prediction(student.predicted_layout(), (t.stride(), _viewable(t, 24)),
                      "predicted_layout(): (strides, can it be viewed as (24,)); on a miss: a permute moves each stride "
                      "with its dim, and a view needs every new dim inside one contiguous run")


def _viewable(t: torch.Tensor, *shape: int) -> bool:
    try:
        t.view(shape)
    except RuntimeError:
        return False
    return True


@pytest.mark.points(3)
@pytest.mark.task("design")
def test_design_answers(student):
    """Three multiple-choice design questions on the batcher (notebook section 4)."""
    answers = student.design_answers()
    for question, hint in [("lock_during_step", "what happens to submit() while the model runs for 30 ms?"),
                           ("why_condition", "count the wake-ups of an idle thread either way"),
                           ("wait_in_loop", "a notify that comes before the wait, and a wake-up with nothing to do")]:
        expect_prediction(answers.get(question), {"lock_during_step": "b", "why_condition": "c",
                                                  "wait_in_loop": "a"}[question],
                          f"design_answers()[{question!r}], a letter; on a miss: {hint}")
