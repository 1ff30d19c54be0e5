"""Official tests of lab 04_chunked_prefill: the token-budget scheduling loop.

The learner writes three methods of `engine_core.core.scheduler.Scheduler` as plain functions
(`self` first): `_num_new_tokens` (the chunking rule), `_admit_waiting` (FCFS admission) and
`schedule` (running requests first, then swapped, then waiting). Every test runs inside
`plug(student, LAB)` (grader/plug.py): the three are the learner's and call each other (a wrong
_num_new_tokens also fails the tests of the two that use it); the engine's own raise. Set-up never
runs a seam of this lab. The end-to-end test runs the real engine against the reference engine.
Unit tests drive the Scheduler with `harness.FakeRunner`, whose output depends on getting every
block and chunk position right; expected values are worked out by hand in comments.
"""
import functools
import random

import pytest

from grader.harness import (FakeRunner, RequestStatus, ScheduledChunk, SchedulerOutput, assert_no_leaked_blocks,
                            make_request, make_scheduler, reference_output, run_engine, run_to_completion, step)
from grader.plug import plug

LAB = "04_chunked_prefill"


def chunks_of(out):
    return [(c.request.request_id, c.start, c.num_tokens) for c in out.scheduled]


# ---- task 1: _num_new_tokens -------------------------------------------------------------

def _new_tokens(student, sched, request, budget, num_computed=None):
    with plug(student, LAB):
        got = sched._num_new_tokens(request, budget, num_computed)
    assert isinstance(got, int), f"_num_new_tokens returned {got!r}, expected an int"
    return got


@pytest.mark.points(1)
@pytest.mark.task("_num_new_tokens")
def test_chunk_is_capped_by_budget_and_threshold(student):
    """Chunked prefill: min(remaining tokens, budget, long_prefill_token_threshold if > 0)."""
    # (prompt, computed so far, budget, threshold) -> tokens this step
    cases = [(100, 0, 16, 0, 16), (100, 96, 16, 0, 4), (10, 0, 16, 0, 10), (100, 0, 16, 6, 6),
             (100, 0, 4, 6, 4), (100, 98, 16, 6, 2), (1, 0, 16, 0, 1)]
    for prompt, computed, budget, threshold, want in cases:
        sched = make_scheduler(64, long_prefill_token_threshold=threshold)
        request = make_request("r", prompt)
        request.num_computed_tokens = computed
        got = _new_tokens(student, sched, request, budget)
        assert got == want, (f"chunked prefill, long_prefill_token_threshold={threshold}: a {prompt}-token prompt "
                             f"with {computed} computed and a budget of {budget} should get {want} tokens, got {got}")


@pytest.mark.points(1)
@pytest.mark.task("_num_new_tokens")
def test_unchunked_is_all_or_nothing(student):
    """Without chunked prefill the remaining tokens run whole or not at all (threshold ignored)."""
    for prompt, budget, threshold, want in [(10, 16, 0, 10), (16, 16, 0, 16), (17, 16, 0, 0), (40, 300, 8, 40)]:
        sched = make_scheduler(64, enable_chunked_prefill=False, long_prefill_token_threshold=threshold)
        got = _new_tokens(student, sched, make_request("r", prompt), budget)
        assert got == want, (f"enable_chunked_prefill=False, threshold {threshold}: a {prompt}-token prompt and a "
                             f"budget of {budget} should get {want} tokens (all or nothing), got {got}")


@pytest.mark.points(1)
@pytest.mark.task("_num_new_tokens")
def test_num_computed_argument_overrides(student):
    """`num_computed` (a prefix-cache hit at admission) replaces request.num_computed_tokens."""
    sched = make_scheduler(64)
    request = make_request("r", 30)  # 0 computed; a hit of 24 cached tokens leaves 6
    got = _new_tokens(student, sched, request, 16, num_computed=24)
    assert got == 6, f"a 30-token prompt with num_computed=24 and budget 16 should get 6 tokens, got {got}"
    got = _new_tokens(student, sched, request, 16, num_computed=None)
    assert got == 16, f"with num_computed=None it counts request.num_computed_tokens (0): expected 16, got {got}"


# ---- task 2: _admit_waiting --------------------------------------------------------------

def _admit(student, sched, budget):
    out = SchedulerOutput()
    with plug(student, LAB):
        sched._admit_waiting(out, budget)
    return out


def _prefilled(sched, runner, request):
    """`request` admitted and its whole prompt computed in one forward pass, set up without any seam of
    this lab: running, its blocks allocated and cached (as schedule() then update_from_output leave it)."""
    kvm = sched.kv_cache_manager
    kvm.allocate_slots(request, request.num_tokens)
    sched.requests[request.request_id] = request
    request.status = RequestStatus.RUNNING
    sched.running.append(request)
    out = SchedulerOutput([ScheduledChunk(request, 0, request.num_tokens, kvm.get_block_ids(request.request_id),
                                          resumed=True)])
    sched.update_from_output(out, runner.execute(out))


@pytest.mark.points(2)
@pytest.mark.task("_admit_waiting")
def test_admit_fcfs_until_first_misfit(student):
    """Admission is FCFS: the first waiting request that gets no tokens or no blocks stops it."""
    # budget 16: a (5) -> 5, b (8) -> 8, c (20) -> the 3 left over, as a first chunk
    sched = make_scheduler(64)
    for rid, n in (("a", 5), ("b", 8), ("c", 20)):
        sched.add_request(make_request(rid, n))
    out = _admit(student, sched, 16)
    assert chunks_of(out) == [("a", 0, 5), ("b", 0, 8), ("c", 0, 3)], (
        f"waiting a(5), b(8), c(20) tokens, budget 16: expected chunks (id, start, tokens) "
        f"[('a', 0, 5), ('b', 0, 8), ('c', 0, 3)], got {chunks_of(out)}")
    assert [r.request_id for r in sched.running] == ["a", "b", "c"] and not sched.waiting, (
        f"admitted requests move from waiting to the end of running: running "
        f"{[r.request_id for r in sched.running]}, waiting {[r.request_id for r in sched.waiting]}")
    assert all(r.status == RequestStatus.RUNNING for r in sched.running), f"statuses: {sched.running}"
    assert sched.kv_cache_manager.get_block_ids("c") and len(sched.kv_cache_manager.get_block_ids("c")) == 1, (
        f"c's 3-token chunk needs 1 block of 4, its table is {sched.kv_cache_manager.get_block_ids('c')}")

    # 3 blocks of 4 tokens: a (8 tokens, 2 blocks) fits, b (11, 3 blocks) does not, c (2) must wait behind b
    sched = make_scheduler(3)
    for rid, n in (("a", 8), ("b", 11), ("c", 2)):
        sched.add_request(make_request(rid, n, max_tokens=1))
    out = _admit(student, sched, 16)
    assert chunks_of(out) == [("a", 0, 8)], (
        f"3 free blocks of 4 tokens, waiting a(8), b(11), c(2): only a fits, and c must not overtake b "
        f"(FCFS); expected [('a', 0, 8)], got {chunks_of(out)}")
    assert [r.request_id for r in sched.waiting] == ["b", "c"], (
        f"b and c stay waiting in order, got {[r.request_id for r in sched.waiting]}")
    assert sched.kv_cache_manager.num_free_blocks == 1, (
        f"only a's 2 blocks may be allocated, {3 - sched.kv_cache_manager.num_free_blocks} are")


@pytest.mark.points(1)
@pytest.mark.task("_admit_waiting")
def test_admit_respects_max_num_seqs(student):
    """No more than max_num_seqs requests run at once, counting the ones already running."""
    sched = make_scheduler(64, max_num_seqs=3)
    for rid in "abcde":
        sched.add_request(make_request(rid, 2))
    _admit(student, sched, 2)  # budget 2: only a
    out = _admit(student, sched, 16)  # a runs; 2 more slots
    assert chunks_of(out) == [("b", 0, 2), ("c", 0, 2)], (
        f"max_num_seqs=3 with a already running: expected b and c admitted, got {chunks_of(out)}")
    assert len(sched.running) == 3, f"running: {sched.running}"


@pytest.mark.points(2)
@pytest.mark.task("_admit_waiting")
def test_admit_prefix_hit_starts_after_cached_tokens(student):
    """A prefix-cache hit: the request starts at the cached tokens, which count as hits."""
    sched = make_scheduler(64, enable_prefix_caching=True)
    runner = FakeRunner(64, 4)
    _prefilled(sched, runner, make_request("a", 10, max_tokens=8))  # blocks [1-4] and [5-8] are cached
    sched.add_request(make_request("b", list(range(1, 9)) + [30, 31, 32], max_tokens=3))
    out = _admit(student, sched, 16)
    assert chunks_of(out) == [("b", 8, 3)], (
        f"b (11 tokens) shares a's first 2 full blocks (8 tokens): its chunk must start at 8 with 3 tokens, "
        f"got {chunks_of(out)}")
    b = sched.running[-1]
    assert b.num_computed_tokens == 8 and b.num_cached_tokens == 8, (
        f"after a hit of 8 tokens b.num_computed_tokens and b.num_cached_tokens must be 8, got "
        f"{b.num_computed_tokens} and {b.num_cached_tokens}")
    kvm = sched.kv_cache_manager
    assert kvm.get_block_ids("b")[:2] == kvm.get_block_ids("a")[:2], (
        f"b's table {kvm.get_block_ids('b')} must start with a's cached blocks {kvm.get_block_ids('a')[:2]}")
    stats = sched.stats()
    assert (stats["prefix_cache_queries"], stats["prefix_cache_hits"]) == (11, 8), (
        f"queries count every admitted token (b: 11; a was set up directly), hits the cached ones (8): got "
        f"{stats['prefix_cache_queries']} queries, {stats['prefix_cache_hits']} hits")
    outputs = {r.request_id: r.output_token_ids for r in sched.update_from_output(out, runner.execute(out))}
    with plug(student, LAB):
        run_to_completion(sched, runner, max_steps=200, outputs=outputs)
    assert outputs["b"] == reference_output(list(range(1, 9)) + [30, 31, 32], 3), "b's tokens are wrong after the hit"


# ---- task 3: schedule --------------------------------------------------------------------

@pytest.mark.points(2)
@pytest.mark.task("schedule")
def test_running_before_waiting(student):
    """Running requests (decodes, unfinished chunks) are served first, waiting ones get the rest."""
    sched = make_scheduler(64)  # budget 16
    runner = FakeRunner(64, 4)
    sched.add_request(make_request("a", 3, max_tokens=10))
    sched.add_request(make_request("b", 20, max_tokens=10))
    with plug(student, LAB):
        out = step(sched, runner)
    assert chunks_of(out) == [("a", 0, 3), ("b", 0, 13)], (
        f"step 1, budget 16, waiting a(3) b(20): expected [('a', 0, 3), ('b', 0, 13)], got {chunks_of(out)}")
    sched.add_request(make_request("c", 6, max_tokens=10))
    with plug(student, LAB):
        out = step(sched, runner)
    # a decodes (1), b's next chunk (7 left), c gets the 8 tokens that remain of 16: 6
    assert chunks_of(out) == [("a", 3, 1), ("b", 13, 7), ("c", 0, 6)], (
        f"step 2: a decodes, b finishes its prompt (7 tokens), then c (6) is admitted: expected "
        f"[('a', 3, 1), ('b', 13, 7), ('c', 0, 6)], got {chunks_of(out)}")
    sched.add_request(make_request("d", 30, max_tokens=10))
    with plug(student, LAB):
        out = step(sched, runner)
    assert chunks_of(out) == [("a", 4, 1), ("b", 20, 1), ("c", 6, 1), ("d", 0, 13)], (
        f"step 3: three decodes first, then d's first chunk of 13: got {chunks_of(out)}")
    assert out.total_num_scheduled_tokens == 16


def _random_workload(rng, n):
    return [(f"r{i}", [rng.randrange(1, 50) for _ in range(rng.randrange(1, 60))], rng.randrange(1, 12))
            for i in range(n)]


def _check_step(out, sched, budget, max_num_seqs, where):
    total = out.total_num_scheduled_tokens
    assert total <= budget, f"{where}: {total} tokens scheduled, budget max_num_batched_tokens={budget}: {chunks_of(out)}"
    assert len(out.scheduled) <= max_num_seqs, (
        f"{where}: {len(out.scheduled)} requests scheduled, max_num_seqs={max_num_seqs}: {chunks_of(out)}")
    ids = [c.request.request_id for c in out.scheduled]
    assert len(ids) == len(set(ids)), f"{where}: a request is scheduled twice: {chunks_of(out)}"
    for c in out.scheduled:
        rid = c.request.request_id
        assert rid not in out.preempted_request_ids, (
            f"{where}: request {rid} was preempted this step, yet it has a chunk: drop a victim's chunk (and give "
            f"its tokens back to the budget), and admit no waiting request in a step that preempted: {chunks_of(out)}")
        assert c.request.status == RequestStatus.RUNNING, (
            f"{where}: request {rid} is {c.request.status.name} but has a chunk: {chunks_of(out)}")
        assert c.num_tokens >= 1 and c.start == c.request.num_computed_tokens, (
            f"{where}: chunk {(rid, c.start, c.num_tokens)} must start at num_computed_tokens "
            f"{c.request.num_computed_tokens} with at least 1 token")


def _run_workload(student, workload, num_blocks, arrivals_per_step=3, **config):
    with plug(student, LAB):
        return _run_workload_plugged(workload, num_blocks, arrivals_per_step, **config)


def _run_workload_plugged(workload, num_blocks, arrivals_per_step=3, **config):
    sched = make_scheduler(num_blocks, **config)
    runner = FakeRunner.for_scheduler(sched)
    pending, outputs, steps = list(workload), {}, 0
    while pending or sched.has_unfinished_requests():
        for rid, prompt, max_tokens, *priority in pending[:arrivals_per_step]:
            sched.add_request(make_request(rid, prompt, max_tokens, priority=priority[0] if priority else 0))
        pending = pending[arrivals_per_step:]
        out = sched.schedule()
        _check_step(out, sched, sched.max_num_batched_tokens, sched.max_num_seqs, f"step {steps} ({config})")
        for r in sched.update_from_output(out, runner.execute(out)):
            outputs[r.request_id] = list(r.output_token_ids)
        steps += 1
        assert steps < 2000, f"{config}: not finished after 2000 steps; still running {sched.running}"
    for rid, prompt, max_tokens, *_ in workload:
        want = reference_output(prompt, max_tokens)
        assert outputs.get(rid) == want, (f"{config}: request {rid} (prompt of {len(prompt)} tokens) produced "
                                          f"{outputs.get(rid)}, the reference is {want}")
    assert_no_leaked_blocks(sched, str(config))
    return sched


@pytest.mark.points(3)
@pytest.mark.task("schedule")
def test_budget_and_max_num_seqs_never_exceeded(student):
    """Random workloads: every step within budget and max_num_seqs, and the reference tokens."""
    rng = random.Random(4)
    for config in (dict(max_num_batched_tokens=16), dict(max_num_batched_tokens=7, max_num_seqs=2),
                   dict(max_num_batched_tokens=32, long_prefill_token_threshold=5),
                   dict(enable_chunked_prefill=False, max_model_len=128)):
        _run_workload(student, _random_workload(rng, 12), 128, **config)


@pytest.mark.points(3)
@pytest.mark.task("schedule")
def test_long_prompt_never_stalls_decodes(student):
    """Three requests are decoding when a 200-token prompt arrives: each still gets a token every step."""
    sched = make_scheduler(128)  # budget 16, blocks of 4
    runner = FakeRunner(128, 4)
    for rid in "abc":
        _prefilled(sched, runner, make_request(rid, 4, max_tokens=40))  # each has its first token
    sched.add_request(make_request("long", 200, max_tokens=2))
    long_chunks, token_steps = [], {rid: [] for rid in "abc"}
    with plug(student, LAB):
        for k in range(1, 20):
            out = step(sched, runner)
            long_chunks += [c.num_tokens for c in out.scheduled if c.request.request_id == "long"]
            for rid in "abc":
                if any(c.request.request_id == rid for c in out.scheduled):
                    token_steps[rid].append(k)
    for rid, steps in token_steps.items():
        gaps = [b - a for a, b in zip([0] + steps, steps)]
        assert steps and max(gaps) == 1, (
            f"request {rid} was decoding when a 200-token prompt arrived (budget 16): it must get a token every "
            f"step, but it got tokens at steps {steps} (largest gap {max(gaps, default=None)} steps)")
    # each step: 3 decodes + a 13-token chunk of the long prompt; 200 = 15 x 13 + 5
    assert long_chunks[:16] == [13] * 15 + [5], (
        f"the long prompt should be prefilled in chunks of 13 (16 minus three decodes), then 5: got {long_chunks}")


@pytest.mark.points(2)
@pytest.mark.task("schedule")
def test_preemption_under_memory_pressure(student):
    """Too few blocks for everyone: preempted requests are dropped from the step, recomputed later,
    and every request still produces the reference tokens with no block leaked. Priorities differ, so
    a victim (lowest priority: largest value) may already have a chunk in the step being planned; one
    configuration has a CPU swap pool, so victims are swapped out and brought back."""
    rng = random.Random(5)
    for num_blocks, config in ((12, dict(max_num_batched_tokens=16)), (9, dict(max_num_batched_tokens=10)),
                               (16, dict(max_num_batched_tokens=16, enable_prefix_caching=True)),
                               # a CPU swap pool: swapped requests come back before any admission
                               (10, dict(max_num_batched_tokens=16, num_cpu_blocks=24, preemption_mode="swap"))):
        workload = [(f"r{i}", [rng.randrange(1, 50) for _ in range(rng.randrange(2, 20))], rng.randrange(4, 14),
                     rng.randrange(3)) for i in range(8)]
        sched = _run_workload(student, workload, num_blocks, arrivals_per_step=8, **config)
        stats = sched.stats()
        assert stats["num_preemptions"] > 0, f"{num_blocks} blocks, {config}: the workload never preempted (a test bug)"
        if "num_cpu_blocks" in config:
            assert stats["num_blocks_swapped_in"] > 0, f"{config}: nothing was swapped back in (a test bug): {stats}"


ENGINE_PROMPTS = [[(7 * i + 3 * k) % 500 + 3 for k in range(n)] for i, n in enumerate((5, 40, 23, 60, 9, 30))]
ENGINE_MAX_TOKENS = (8, 4, 6, 3, 10, 5)
ENGINE_CONFIGS = ((("max_num_batched_tokens", 16), ("long_prefill_token_threshold", 12)),
                  (("enable_chunked_prefill", False), ("max_model_len", 128)))


def _engine_run(config: tuple):
    """tiny-llama on ENGINE_PROMPTS, two arriving per step while earlier ones decode."""
    requests = [(f"r{i}", p, m) for i, (p, m) in enumerate(zip(ENGINE_PROMPTS, ENGINE_MAX_TOKENS))]
    return run_engine([requests[i:i + 2] for i in range(0, len(requests), 2)], steps_per_wave=1, num_gpu_blocks=32,
                      swap_space=0, **dict(config))


@functools.cache
def reference_engine_tokens(config: tuple) -> dict:
    """The unmodified engine's tokens (computed once per process: the planted-bug runs share it)."""
    return _engine_run(config).tokens


@pytest.mark.points(3)
@pytest.mark.task("schedule")
@pytest.mark.end_to_end
def test_engine_matches_reference_tokens(student):
    """The real engine (tiny-llama) with all three of your methods produces the reference engine's
    tokens, chunked prefill on (small budget, a threshold) and off, and frees every block."""
    for config in ENGINE_CONFIGS:
        with plug(student, LAB):
            run = _engine_run(config)
        engine, got, want = run.engine, run.tokens, reference_engine_tokens(config)
        for rid in want:
            assert got.get(rid) == want[rid], (f"{dict(config)}: request {rid} (prompt of "
                                               f"{len(ENGINE_PROMPTS[int(rid[1:])])} tokens) produced {got.get(rid)}, "
                                               f"the reference engine {want[rid]}")
        assert_no_leaked_blocks(engine.scheduler, f"engine with {dict(config)}")
