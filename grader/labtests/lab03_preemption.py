"""Official tests of lab 03_preemption: victim choice, recompute-or-swap, swap-out and swap-in planning.

The learner writes `_preempt(self, out)` and `choose_preemption_mode(self, request)` of
`engine_core.core.scheduler.Scheduler`, and `swap_out(self, request)` / `swap_in(self, request)` of
`engine_core.core.kv_cache_manager.KVCacheManager`, as plain functions. Every test runs inside `plug(student, LAB)`
(grader/plug.py): all four are the learner's, the engine's own raise. Unit tests build the state
they start from directly (no seam runs during set-up); `_preempt`'s tests fix the mode on the
scheduler instance, so a wrong choose_preemption_mode fails its own tests only, while swap
preemption uses the learner's swap_out. The end-to-end tests run tiny-llama under memory
pressure: the tokens must equal the reference engine's on the same configuration (computed after
the plug ends), the preemption counts must be the ones derived by hand below, and every GPU and
CPU block must be free at the end.
"""
import functools

import pytest
import torch

from grader.harness import (TINY_SPEC, KVCache, ModelSpec, RequestStatus, SchedulerOutput, build_manager,
                            make_request, make_scheduler, memory, run_engine)
from grader.plug import plug

LAB = "03_preemption"
TINY = TINY_SPEC  # tiny-llama's shape: 512 bytes of fp32 KV per token
# Few weights, much KV per token (2 x 64 KV heads x 16 dims): at the default CPU rates recompute is cheaper.
WIDE_KV = ModelSpec(num_layers=1, hidden_size=16, num_attention_heads=64, num_kv_heads=64, head_dim=16,
                    intermediate_size=16, vocab_size=16)


def _scheduler(num_gpu_blocks, num_cpu_blocks=0, spec=TINY, kv_dtype="fp32", **config):
    return make_scheduler(num_gpu_blocks, num_cpu_blocks, spec, kv_dtype, **{"max_num_batched_tokens": 64, **config})


def _request(rid, n, priority=0, arrival=0.0, max_tokens=8):
    return make_request(rid, list(range(3, 3 + n)), max_tokens, priority=priority, arrival=arrival)


def _running(sched, specs) -> list:
    """specs: (rid, computed tokens, priority, arrival). Puts each in `running` with its blocks and KV computed
    (what the scheduler's admission and one forward pass would have done)."""
    reqs = []
    for rid, n, priority, arrival in specs:
        req = _request(rid, n, priority, arrival)
        sched.requests[rid] = req
        assert sched.kv_cache_manager.allocate_slots(req, n) is not None, "test set-up: the pool is too small"
        req.num_computed_tokens = n
        req.status = RequestStatus.RUNNING
        sched.running.append(req)
        reqs.append(req)
    return reqs


# ---- task 1: choose_preemption_mode ----------------------------------------------------------

@pytest.mark.points(2)
@pytest.mark.task("choose_preemption_mode")
def test_forced_modes_and_fallbacks(student):
    """preemption_mode forces the mode; swap falls back to recompute with no CPU room or nothing to copy."""
    slow_link = dict(swap_bandwidth_bytes_per_s=1.0)  # the cost model would recompute
    cases = [  # (preemption_mode, CPU blocks, computed tokens, expected, why, more config)
        ("recompute", 8, 6, "recompute", "preemption_mode='recompute' forces it", {}),
        ("swap", 8, 6, "swap", "preemption_mode='swap' with 2 of 8 CPU blocks needed", {}),
        ("swap", 8, 6, "swap", "preemption_mode='swap' forces it even over a 1 B/s host link", slow_link),
        ("recompute", 8, 6, "recompute", "preemption_mode='recompute' forces it even where swap is free",
         dict(swap_bandwidth_bytes_per_s=1e18)),
        ("swap", 1, 6, "recompute", "6 computed tokens need 2 CPU blocks of 4, only 1 exists", {}),
        ("auto", 0, 6, "recompute", "no CPU swap pool at all", {}),
        ("swap", 8, 0, "recompute", "nothing computed yet: nothing to copy", {}),
    ]
    for mode, cpu, n, want, why, more in cases:
        sched = _scheduler(16, cpu, preemption_mode=mode, **more)
        (req,) = _running(sched, [("a", n, 0, 0.0)]) if n else [_request("a", 3)]
        with plug(student, LAB):
            got = sched.choose_preemption_mode(req)
        assert got == want, (f"preemption_mode={mode!r}, {cpu} CPU blocks, {more or 'default rates'}, request with {n} computed tokens (block "
                             f"size 4): returned {got!r}, expected {want!r} ({why})")


def _break_even_bandwidth(spec, n, kv_dtype, flops_per_s):
    """Host-link bytes/s at which swapping n tokens out and back costs as long as prefilling them again."""
    recompute_s = memory.prefill_flops(spec, n) / flops_per_s
    return 2 * n * memory.kv_cache_bytes_per_token(spec, kv_dtype) / recompute_s


@pytest.mark.points(2)
@pytest.mark.task("choose_preemption_mode")
def test_auto_follows_the_cost_model(student):
    """auto: swap when 2 x KV bytes / bandwidth < prefill FLOPs / FLOP/s, with the configured rates and KV dtype."""
    for n in (4, 16, 60):
        for kv_dtype in ("fp32", "fp8"):
            bandwidth = _break_even_bandwidth(TINY, n, kv_dtype, 1e9)
            for factor, want in ((1.25, "swap"), (0.8, "recompute")):
                sched = _scheduler(32, 32, kv_dtype=kv_dtype, preemption_mode="auto", prefill_flops_per_s=1e9,
                                   swap_bandwidth_bytes_per_s=bandwidth * factor)
                (req,) = _running(sched, [("a", n, 0, 0.0)])
                with plug(student, LAB):
                    got = sched.choose_preemption_mode(req)
                assert got == want, (
                    f"auto, {n} computed tokens of tiny-llama's shape, {kv_dtype} KV cache, 1e9 FLOP/s, host link "
                    f"{factor}x the break-even {bandwidth:.4g} B/s: returned {got!r}, expected {want!r} (swap = 2 x "
                    f"{n} x {memory.kv_cache_bytes_per_token(TINY, kv_dtype)} B / bandwidth; recompute = "
                    f"{memory.prefill_flops(TINY, n):.4g} FLOPs / 1e9)")


@pytest.mark.points(1)
@pytest.mark.task("choose_preemption_mode")
def test_auto_uses_the_device_default_rates(student):
    """Without configured rates, auto uses memory.DEFAULT_RATES of the device type ('cpu' here)."""
    flops, bandwidth = memory.DEFAULT_RATES["cpu"]
    for name, spec in (("tiny-llama's shape", TINY), ("a model with little compute and wide KV", WIDE_KV)):
        n = 8
        swap_s = 2 * n * memory.kv_cache_bytes_per_token(spec, "fp32") / bandwidth
        recompute_s = memory.prefill_flops(spec, n) / flops
        want = "swap" if swap_s < recompute_s else "recompute"
        sched = _scheduler(32, 32, spec=spec, preemption_mode="auto")
        (req,) = _running(sched, [("a", n, 0, 0.0)])
        with plug(student, LAB):
            got = sched.choose_preemption_mode(req)
        assert got == want, (f"auto on CPU without configured rates, {name}, {n} tokens: swap {swap_s:.3g} s vs "
                             f"recompute {recompute_s:.3g} s at DEFAULT_RATES['cpu'] = {memory.DEFAULT_RATES['cpu']}; "
                             f"returned {got!r}, expected {want!r}")


# ---- task 2: _preempt ------------------------------------------------------------------------

@pytest.mark.points(2)
@pytest.mark.task("preempt")
def test_victim_is_lowest_priority_then_latest_arrival(student):
    """The victim has the largest `priority` value (least important); among those, the latest arrival."""
    sched = _scheduler(32, preemption_mode="recompute")
    sched.choose_preemption_mode = lambda request: "recompute"  # this test grades _preempt alone
    specs = [("a", 3, 0, 1.0), ("b", 3, 1, 0.0), ("c", 3, 1, 2.0), ("d", 3, 0, 3.0)]
    _running(sched, specs)
    order = []
    with plug(student, LAB):
        for _ in specs:
            victim = sched._preempt(SchedulerOutput())
            order.append(victim.request_id)
    assert order == ["c", "b", "d", "a"], (f"running (id, priority, arrival) {[(s[0], s[2], s[3]) for s in specs]}: "
                                           f"you preempted in the order {order}, expected ['c', 'b', 'd', 'a']")


@pytest.mark.points(1)
@pytest.mark.task("preempt")
def test_recompute_preemption(student):
    """Recompute: blocks freed, progress reset, the victim first in line for admission, counted."""
    sched = _scheduler(16, preemption_mode="recompute")
    sched.choose_preemption_mode = lambda request: "recompute"  # this test grades _preempt alone
    a, b = _running(sched, [("a", 6, 0, 0.0), ("b", 5, 0, 1.0)])
    b.output_token_ids = [7, 9]  # b had generated two tokens: they stay, and are recomputed with the prompt
    sched.waiting.append(_request("w", 3))
    out = SchedulerOutput()
    with plug(student, LAB):
        victim = sched._preempt(out)
    kvm = sched.kv_cache_manager
    assert victim is b, f"a (arrival 0) and b (arrival 1), same priority: victim {victim.request_id}, expected b"
    state = (b.status, b.num_computed_tokens, kvm.get_block_ids("b"), [r.request_id for r in sched.waiting],
             [r.request_id for r in sched.running], b.output_token_ids, b.num_preemptions)
    want = (RequestStatus.PREEMPTED, 0, [], ["b", "w"], ["a"], [7, 9], 1)
    assert state == want, ("after preempting b by recompute, (status, num_computed_tokens, b's blocks, waiting, "
                           f"running, b's output, b.num_preemptions) is {state}, expected {want}")
    assert kvm.num_free_blocks == 16 - 2, f"b's 2 blocks must be free again: {kvm.num_free_blocks} of 16 free"
    assert out.preempted_request_ids == ["b"] and out.swap_out == [], (
        f"out.preempted_request_ids {out.preempted_request_ids} (expected ['b']), out.swap_out {out.swap_out} (expected [])")
    s = sched.stats()
    assert (s["num_preemptions_recompute"], s["num_preemptions_swap"]) == (1, 0), f"counters: {s}"


@pytest.mark.points(2)
@pytest.mark.task("preempt")
def test_swap_preemption(student):
    """Swap: the KV copy is planned in out.swap_out (by your swap_out), the victim keeps its progress and
    joins `swapped` in (priority, arrival) order, so the most important request comes back first."""
    sched = _scheduler(32, 16, preemption_mode="swap")
    sched.choose_preemption_mode = lambda request: "swap"  # this test grades _preempt (and swap_out)
    _running(sched, [("a", 6, 0, 0.0), ("b", 3, 2, 1.0), ("c", 9, 1, 2.0), ("d", 5, 0, 3.0)])
    kvm = sched.kv_cache_manager
    order, copies = [], 0
    for _ in range(3):
        out = SchedulerOutput()
        victim_blocks = {r.request_id: kvm.get_block_ids(r.request_id) for r in sched.running}
        with plug(student, LAB):
            victim = sched._preempt(out)
        order.append(victim.request_id)
        want = list(zip(victim_blocks[victim.request_id], kvm.get_cpu_block_ids(victim.request_id)))
        assert out.swap_out == want and len(want) == -(-victim.num_computed_tokens // 4), (
            f"swapping {victim.request_id} ({victim.num_computed_tokens} computed tokens, GPU blocks "
            f"{victim_blocks[victim.request_id]}): out.swap_out {out.swap_out}, expected {want} (from "
            f"kv_cache_manager.swap_out)")
        copies += len(want)
        assert victim.status == RequestStatus.SWAPPED and victim.num_computed_tokens > 0, (
            f"{victim.request_id} after a swap: status {victim.status.name}, {victim.num_computed_tokens} computed "
            f"tokens (expected SWAPPED, progress kept)")
    assert order == ["b", "c", "d"], f"(id, priority, arrival) a 0 0, b 2 1, c 1 2, d 0 3: victims {order}"
    swapped = [r.request_id for r in sched.swapped]
    assert swapped == ["d", "c", "b"], (f"swapped queue {swapped}, expected ['d', 'c', 'b']: sorted by (priority, "
                                        f"arrival), the first to swap back in first")
    s = sched.stats()
    got = (s["num_preemptions_swap"], s["num_preemptions_recompute"], s["num_blocks_swapped_out"])
    assert got == (3, 0, copies), f"(swap preemptions, recompute preemptions, blocks swapped out) {got}, expected {(3, 0, copies)}"


# ---- task 3: swap_out / swap_in --------------------------------------------------------------

def _manager_with(num_gpu, num_cpu, computed, allocated):
    """Request x holds GPU block 0; r holds blocks 1.. for `allocated` positions, `computed` of them written."""
    table = list(range(1, 1 + -(-allocated // 4)))
    kvm = build_manager(num_gpu, {"x": [0], "r": table}, num_cpu_blocks=num_cpu)
    req = _request("r", allocated)
    req.num_computed_tokens = computed
    return kvm, req


@pytest.mark.points(2)
@pytest.mark.task("swap")
def test_swap_out_copies_written_blocks_only(student):
    """Blocks holding written KV are copied to fresh CPU blocks; all GPU blocks are freed, tail first."""
    kvm, req = _manager_with(8, 4, computed=6, allocated=12)  # table [1, 2, 3]; KV written in positions 0..5
    with plug(student, LAB):
        got = kvm.swap_out(req)
    assert got == [(1, 0), (2, 1)], (f"table [1, 2, 3], 6 computed tokens (blocks of 4): swap_out returned {got}, "
                                     f"expected [(1, 0), (2, 1)]: (gpu, cpu) pairs for the 2 blocks with KV; block 3 "
                                     f"was allocated for this step's tokens but never written")
    assert kvm.get_cpu_block_ids("r") == [0, 1] and kvm.get_block_ids("r") == [], (
        f"after swap_out: CPU table {kvm.get_cpu_block_ids('r')} (expected [0, 1]), GPU table "
        f"{kvm.get_block_ids('r')} (expected [])")
    assert list(kvm.block_pool.free_queue) == [4, 5, 6, 7, 3, 2, 1], (
        f"GPU free queue {list(kvm.block_pool.free_queue)}, expected [4, 5, 6, 7, 3, 2, 1]: all three blocks free, "
        f"the table's tail first (as free() does)")
    assert kvm.cpu_block_pool.num_free_blocks == 2, f"2 of 4 CPU blocks in use, {kvm.cpu_block_pool.num_free_blocks} free"


@pytest.mark.points(1)
@pytest.mark.task("swap")
def test_swap_out_rejects_without_cpu_room(student):
    """Not enough free CPU blocks: ValueError, nothing changed (choose_preemption_mode should have said recompute)."""
    kvm, req = _manager_with(8, 1, computed=6, allocated=8)
    with plug(student, LAB), pytest.raises(ValueError):
        kvm.swap_out(req)
    assert (kvm.get_block_ids("r"), kvm.num_free_blocks, kvm.cpu_block_pool.num_free_blocks) == ([1, 2], 5, 1), (
        f"a rejected swap_out must change nothing: GPU table {kvm.get_block_ids('r')}, {kvm.num_free_blocks} GPU "
        f"and {kvm.cpu_block_pool.num_free_blocks} CPU blocks free")


@pytest.mark.points(2)
@pytest.mark.task("swap")
def test_swap_in_restores_the_table(student):
    """Swap-in takes fresh GPU blocks for the CPU blocks, in table order, and frees the CPU blocks."""
    # r (6 tokens of KV) was swapped out to CPU blocks [0, 1]; x holds GPU block 0 and y blocks 3, 4, 5
    kvm = build_manager(8, {"x": [0], "y": [3, 4, 5]}, free_order=[6, 7, 2, 1], num_cpu_blocks=4,
                        cpu_tables={"r": [0, 1]})
    req = _request("r", 8)
    req.num_computed_tokens = 6
    with plug(student, LAB):
        got = kvm.swap_in(req)
    assert got == [(0, 6), (1, 7)], (f"CPU table [0, 1], GPU free queue [6, 7, 2, 1]: swap_in returned {got}, "
                                     f"expected [(0, 6), (1, 7)] ((cpu, gpu) pairs, blocks from the free queue's front)")
    assert kvm.get_block_ids("r") == [6, 7] and kvm.get_cpu_block_ids("r") == [], (
        f"after swap_in: GPU table {kvm.get_block_ids('r')} (expected [6, 7]), CPU table {kvm.get_cpu_block_ids('r')}")
    assert kvm.cpu_block_pool.num_free_blocks == 4, f"CPU blocks must be free again: {kvm.cpu_block_pool.num_free_blocks} of 4"


@pytest.mark.points(1)
@pytest.mark.task("swap")
def test_swap_in_rejects_without_gpu_room(student):
    """Not enough free GPU blocks: ValueError, nothing changed (the scheduler checks can_swap_in first)."""
    # r (8 tokens of KV) sits in CPU blocks [0, 1]; x and y hold 3 of the 4 GPU blocks: 1 free, r needs 2
    kvm = build_manager(4, {"x": [0], "y": [2, 1]}, num_cpu_blocks=4, cpu_tables={"r": [0, 1]})
    req = _request("r", 8)
    req.num_computed_tokens = 8
    with plug(student, LAB), pytest.raises(ValueError):
        kvm.swap_in(req)
    assert (kvm.get_cpu_block_ids("r"), kvm.num_free_blocks, "r" in kvm.req_to_blocks) == ([0, 1], 1, False), (
        f"a rejected swap_in must change nothing: CPU table {kvm.get_cpu_block_ids('r')}, {kvm.num_free_blocks} GPU "
        f"blocks free, GPU table {kvm.get_block_ids('r')}")


@pytest.mark.points(2)
@pytest.mark.task("swap")
def test_swap_round_trip_keeps_the_kv(student):
    """Executed on real KV tensors, your two plans bring back exactly the keys and values that left."""
    kvm, req = _manager_with(6, 4, computed=7, allocated=8)  # table [1, 2]
    cache = KVCache(2, 6, 4, 2, 3, torch.float32, torch.device("cpu"), num_cpu_blocks=4)
    gen = torch.Generator().manual_seed(0)
    for t in cache.key + cache.value:
        t.copy_(torch.randn(t.shape, generator=gen))
    before = [t[[1, 2]].reshape(-1, 2, 3)[:7].clone() for t in cache.key + cache.value]  # positions 0..6
    with plug(student, LAB):
        cache.swap_out(kvm.swap_out(req))
        kvm.allocate_slots(_request("y", 8), 8)  # another request takes the freed blocks (front of the queue: 3, 4)
        for t in cache.key + cache.value:
            t.fill_(-1.0)  # and overwrites every GPU block
        mapping = kvm.swap_in(req)
    cache.swap_in(mapping)
    table = kvm.get_block_ids("r")
    after = [t[table].reshape(-1, 2, 3)[:7] for t in cache.key + cache.value]
    for layer, (b, a) in enumerate(zip(before, after)):
        assert torch.equal(a, b), (f"{'KV'[layer // 2]} of layer {layer % 2}: positions 0..6 of request r differ after "
                                   f"swap_out {kvm.get_cpu_block_ids('r') or '(done)'} and swap_in {mapping} into "
                                   f"table {table}")


# ---- end to end ------------------------------------------------------------------------------

BLOCK_BYTES = 4 * 512  # tiny-llama in fp32: 512 bytes of KV per token, blocks of 4 tokens


def _run(prompts, max_tokens, **engine_args):
    """tiny-llama on `prompts` (arrival i for prompt i) to the end."""
    return run_engine([[(f"r{i}", p, m) for i, (p, m) in enumerate(zip(prompts, max_tokens))]],
                      block_size=4, max_model_len=64, **engine_args)


@functools.cache
def _reference(key):
    prompts, max_tokens, args = key
    run = _run(prompts, max_tokens, **dict(args))
    return run.tokens, run.stats


def _check_run(student, prompts, max_tokens, **engine_args):
    """Runs the workload with the learner's pieces; asserts the reference tokens and no leaked block."""
    with plug(student, LAB):
        run = _run(prompts, max_tokens, **engine_args)
    key = (tuple(map(tuple, prompts)), tuple(max_tokens), tuple(sorted(engine_args.items())))
    want, ref_stats = _reference(key)  # the engine's own pieces, after the plug ended
    got, stats = run.tokens, run.stats
    setup = f"tiny-llama, blocks of 4, {engine_args}, prompt lengths {[len(p) for p in prompts]}, max_tokens {list(max_tokens)}"
    for rid in sorted(want):
        assert got.get(rid) == want[rid], (f"{setup}: request {rid} generated {got.get(rid)}, the reference engine "
                                           f"{want[rid]} (stats with your pieces: {stats})")
    assert not run.held, f"{setup}: every request finished, yet these (pool, block, ref_cnt) are still held: {run.held}"
    return stats, ref_stats


def _counts(stats):
    return {k: stats[k] for k in ("num_preemptions_recompute", "num_preemptions_swap", "num_blocks_swapped_out",
                                  "num_blocks_swapped_in")}


# Four requests of 8 prompt tokens and 5 output tokens on 8 GPU blocks of 4 slots, one token budget of 64.
DESIGNED_PROMPTS = [[3 + 11 * i + j for j in range(8)] for i in range(4)]
DESIGNED_MAX_TOKENS = [5, 5, 5, 5]


def _expected_counts(recompute, swap):
    return {"num_preemptions_recompute": recompute, "num_preemptions_swap": swap,
            "num_blocks_swapped_out": 2 * swap, "num_blocks_swapped_in": 2 * swap}


@pytest.mark.points(3)
@pytest.mark.task("end_to_end")
@pytest.mark.end_to_end
def test_designed_workload_preemption_counts(student):
    """Counts derived by hand, then checked with your pieces in the engine (tokens equal, nothing leaked).

    Step 1 admits r0..r3: 8 prompt tokens = 2 blocks each, all 8 blocks used; each samples its 1st token.
    Step 2: each must compute position 8, which needs a 3rd block. r0 finds none: preempt the latest
    arrival, r3 (2 blocks back); r0 and r1 take one each. r2 finds none: the latest running request is r2
    itself, so it is preempted. 2 preemptions, both of requests with 8 computed tokens = 2 blocks of KV.
    Steps 3-5: r0 and r1 compute positions 9, 10, 11 in their 3rd block and finish (5 tokens); r2 and r3
    need 3 blocks (9 tokens) each to come back, and only 2 are free. Step 6: both come back (6 of 8
    blocks) and finish by position 11. No other preemption.
    So: recompute mode 2 recomputes; swap mode 2 swaps, 4 blocks out and 4 in; auto with room for one
    victim's KV (2 CPU blocks) swaps r3 (swap is cheaper at the CPU default rates, computed below) and
    must recompute r2 (no CPU room left); auto with a host link of 1 MB/s recomputes both.
    """
    flops, bandwidth = memory.DEFAULT_RATES["cpu"]
    swap_s = memory.swap_seconds(TINY, 8, "fp32", bandwidth)
    recompute_s = memory.recompute_seconds(TINY, 8, flops)
    assert swap_s < recompute_s, "the derivation assumes swap is cheaper at the default CPU rates (a test bug)"
    assert memory.swap_seconds(TINY, 8, "fp32", 1e6) > recompute_s, "1 MB/s must make swap the dearer (a test bug)"
    cases = [
        (dict(preemption_mode="recompute", swap_space=0), _expected_counts(2, 0)),
        (dict(preemption_mode="swap", swap_space=4 * BLOCK_BYTES / 2**30), _expected_counts(0, 2)),
        (dict(preemption_mode="auto", swap_space=2 * BLOCK_BYTES / 2**30), _expected_counts(1, 1)),
        (dict(preemption_mode="auto", swap_space=4 * BLOCK_BYTES / 2**30, swap_bandwidth_bytes_per_s=1e6),
         _expected_counts(2, 0)),
    ]
    for args, want in cases:
        stats, ref_stats = _check_run(student, DESIGNED_PROMPTS, DESIGNED_MAX_TOKENS, num_gpu_blocks=8,
                                      max_num_batched_tokens=64, **args)
        assert _counts(ref_stats) == want, f"the reference engine disagrees with the derivation (a test bug): {ref_stats}"
        assert _counts(stats) == want, (f"designed workload (see this test's docstring), {args}: your pieces gave "
                                        f"{_counts(stats)}, expected {want}")


RANDOM_PROMPTS = [[(13 * i + 7 * j) % 500 + 3 for j in range(4 + (9 * i) % 23)] for i in range(10)]
RANDOM_MAX_TOKENS = [6 + (5 * i) % 13 for i in range(10)]


@pytest.mark.points(3)
@pytest.mark.task("end_to_end")
@pytest.mark.end_to_end
def test_engine_tokens_under_memory_pressure(student):
    """10 requests on 16 blocks of 4, in recompute, swap and auto mode: the reference tokens, no leaked block."""
    for mode in ("recompute", "swap", "auto"):
        stats, _ = _check_run(student, RANDOM_PROMPTS, RANDOM_MAX_TOKENS, num_gpu_blocks=16,
                              max_num_batched_tokens=32, preemption_mode=mode, swap_space=16 * BLOCK_BYTES / 2**30)
        key = {"recompute": "num_preemptions_recompute", "swap": "num_preemptions_swap", "auto": "num_preemptions"}
        assert stats[key[mode]] > 0, f"preemption_mode={mode!r}: expected {key[mode]} > 0 under this pressure, {stats}"
