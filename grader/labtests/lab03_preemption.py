"""Official tests of lab 03_preemption: victim choice, recompute-or-swap, swap-out and swap-in planning.

The learner writes `_preempt(self, out)` and `choose_preemption_mode(self, request)` of
`engine_core.core.scheduler.Scheduler`, and `swap_out(self, request)` / `swap_in(self, request)` of
`engine_core.core.kv_cache_manager.KVCacheManager`, as plain functions; plus a prediction
(`predicted_crossover_tokens`) and a find-the-bug answer (`failing_input`, for `buggy_swap_out` below).
Every test of the four functions runs inside `plug(student, LAB)` (grader/plug.py): all four are the
learner's, the engine's own raise. Unit tests build the state they start from directly (block tables
written by `build_manager`, no seam runs during set-up); `_preempt`'s tests fix the mode on the
scheduler instance, so a wrong choose_preemption_mode fails its own tests only, while swap
preemption uses the learner's swap_out. The end-to-end tests run tiny-llama under memory pressure:
the tokens and the preemption counts must equal the reference engine's on the same configuration
(computed after the plug ends) and the counts derived by hand below, and every GPU and CPU block
must be free at the end. The sizing rule `knee_max_num_seqs` (issue #45, V6) is a plain function, graded on hand
cases and against the reference engine's preemption counter swept over max_num_seqs; `predicted_knee_llama3_8b`
is its graded prediction. Every graded check is an `expect_*` observation.
"""
import functools

import pytest
import torch

from grader.harness import (GPUS, TINY_SPEC, KVCache, ModelSpec, RequestStatus, SamplingParams, SchedulerOutput,
                            build_manager, make_engine, make_request, make_scheduler, memory, run_engine)
from grader.observe import expect_equal, expect_prediction, expect_raises
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


def _running(sched, specs, blocks=None, cpu_tables=None) -> list:
    """specs: (rid, computed tokens, priority, arrival). Puts each in `running` with its KV computed in
    ceil(n / 4) blocks (or `blocks[rid]`: a table allocated further, for a chunk not run yet), taken in
    order from block 0 (what admission and one forward pass would have done), and `cpu_tables` {rid: CPU
    block ids} held by swapped requests, written directly with build_manager: no seam runs."""
    reqs, tables, next_block = [], {}, 0
    for rid, n, priority, arrival in specs:
        req = _request(rid, n, priority, arrival)
        req.num_computed_tokens = n
        req.status = RequestStatus.RUNNING
        sched.requests[rid] = req
        sched.running.append(req)
        reqs.append(req)
        tables[rid] = list(range(next_block, next_block + (blocks or {}).get(rid, -(-n // 4))))
        next_block += len(tables[rid])
    kvm = sched.kv_cache_manager
    build_manager(kvm.num_gpu_blocks, tables, num_cpu_blocks=kvm.num_cpu_blocks, cpu_tables=cpu_tables, kvm=kvm)
    return reqs


def _ids(reqs):
    return [r.request_id for r in reqs]


# ---- task 1: choose_preemption_mode ----------------------------------------------------------

@pytest.mark.points(2)
@pytest.mark.task("choose_preemption_mode")
def test_forced_modes_and_fallbacks(student):
    """preemption_mode forces the mode, even against the cost model; swap falls back to recompute with no
    CPU room or nothing to copy."""
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
        (req,) = _running(sched, [("a", n, 0, 0.0)])
        with plug(student, LAB, only=['choose_preemption_mode']):
            got = sched.choose_preemption_mode(req)
        expect_equal(got, want, f"preemption_mode={mode!r}, {cpu} CPU blocks, {more or 'default rates'}, a request "
                                f"with {n} computed tokens (blocks of 4): {why}")


@pytest.mark.points(1)
@pytest.mark.task("choose_preemption_mode")
def test_swap_room_counts_written_blocks_only(student):
    """The CPU room a swap needs is the blocks holding written KV, ceil(num_computed_tokens / 4), against the CPU
    pool's free blocks: not the whole block table (a request preempted mid-prefill holds blocks for a chunk
    that never ran), and not the pool's size when a swapped request already holds some of it."""
    cases = [  # (CPU blocks, of them held by a swapped request, computed tokens, blocks in the table, expected, why)
        (2, 0, 5, 4, "swap", "5 tokens of KV in 2 blocks fit the 2 free CPU blocks; the table's other 2 blocks are "
                             "allocated for a chunk not run yet"),
        (4, 3, 6, 4, "recompute", "6 tokens of KV need 2 CPU blocks; a swapped request holds 3 of the 4, 1 is free"),
        (4, 2, 6, 4, "swap", "6 tokens of KV need 2 CPU blocks, 2 of the 4 are free; the table holds 4"),
    ]
    for cpu, held, n, table, want, why in cases:
        sched = _scheduler(16, cpu, preemption_mode="swap")
        (req,) = _running(sched, [("a", n, 0, 0.0)], blocks={"a": table}, cpu_tables={"s": list(range(held))})
        with plug(student, LAB, only=['choose_preemption_mode']):
            got = sched.choose_preemption_mode(req)
        expect_equal(got, want, f"preemption_mode='swap', {cpu} CPU blocks of which {held} held by a swapped request, a "
                                f"request with {n} computed tokens holding {table} GPU blocks of 4: {why}")


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
                with plug(student, LAB, only=['choose_preemption_mode']):
                    got = sched.choose_preemption_mode(req)
                expect_equal(got, want,
                             f"auto, {n} computed tokens of tiny-llama's shape, {kv_dtype} KV cache, 1e9 FLOP/s, host "
                             f"link {factor}x the break-even {bandwidth:.4g} B/s (swap = 2 x {n} x "
                             f"{memory.kv_cache_bytes_per_token(TINY, kv_dtype)} B / bandwidth; recompute = "
                             f"{memory.prefill_flops(TINY, n):.4g} FLOPs / 1e9)")


def _cheaper_at_default_cpu_rates(spec, n):
    flops, bandwidth = memory.DEFAULT_RATES["cpu"]
    swap_s = 2 * n * memory.kv_cache_bytes_per_token(spec, "fp32") / bandwidth
    return "swap" if swap_s < memory.prefill_flops(spec, n) / flops else "recompute"


@pytest.mark.points(1)
@pytest.mark.task("choose_preemption_mode")
def test_auto_uses_the_device_default_rates(student):
    """Without configured rates, auto uses memory.DEFAULT_RATES of the device type ('cpu' here)."""
    assert _cheaper_at_default_cpu_rates(TINY, 8) != _cheaper_at_default_cpu_rates(WIDE_KV, 8), (
        "the two shapes must prefer different modes at the CPU rates (a test bug)")
    for name, spec in (("tiny-llama's shape", TINY), ("a model with little compute and wide KV", WIDE_KV)):
        sched = _scheduler(32, 32, spec=spec, preemption_mode="auto")
        (req,) = _running(sched, [("a", 8, 0, 0.0)])
        with plug(student, LAB, only=['choose_preemption_mode']):
            got = sched.choose_preemption_mode(req)
        expect_equal(got, _cheaper_at_default_cpu_rates(spec, 8),
                     f"auto on CPU without configured rates, {name}, 8 computed tokens: the cheaper mode at "
                     f"DEFAULT_RATES['cpu'] = {memory.DEFAULT_RATES['cpu']} (FLOP/s, bytes/s)")


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
    with plug(student, LAB, only=['_preempt']):
        for _ in specs:
            order.append(sched._preempt(SchedulerOutput()).request_id)
    expect_equal(order, ["c", "b", "d", "a"], "running (id, priority, arrival) [('a', 0, 1.0), ('b', 1, 0.0), "
                                              "('c', 1, 2.0), ('d', 0, 3.0)]: the victims of four _preempt calls")


@pytest.mark.points(1)
@pytest.mark.task("preempt")
def test_recompute_preemption(student):
    """Recompute: blocks freed, progress reset, the victim first in line for admission, counted."""
    sched = _scheduler(16, preemption_mode="recompute")
    sched.choose_preemption_mode = lambda request: "recompute"  # this test grades _preempt alone
    a, b = _running(sched, [("a", 6, 0, 0.0), ("b", 5, 0, 1.0)])  # a holds blocks [0, 1], b [2, 3]
    b.output_token_ids = [7, 9]  # b had generated two tokens: they stay, and are recomputed with the prompt
    sched.waiting.append(_request("w", 3))
    out = SchedulerOutput()
    with plug(student, LAB, only=['_preempt']):
        victim = sched._preempt(out)
    kvm = sched.kv_cache_manager
    expect_equal(victim.request_id, "b", "running a (arrival 0) and b (arrival 1), same priority: the victim")
    expect_equal({"status": b.status, "computed": b.num_computed_tokens, "blocks": kvm.get_block_ids("b"),
                  "waiting": _ids(sched.waiting), "running": _ids(sched.running), "output": b.output_token_ids,
                  "num_preemptions": b.num_preemptions, "free blocks": kvm.num_free_blocks},
                 {"status": RequestStatus.PREEMPTED, "computed": 0, "blocks": [], "waiting": ["b", "w"],
                  "running": ["a"], "output": [7, 9], "num_preemptions": 1, "free blocks": 14},
                 "after preempting b (5 tokens in blocks [2, 3], 2 tokens generated) by recompute, w waiting, 16 blocks")
    expect_equal((out.preempted_request_ids, out.swap_out), (["b"], []),
                 "(out.preempted_request_ids, out.swap_out) after a recompute preemption of b")
    s = sched.stats()
    expect_equal((s["num_preemptions_recompute"], s["num_preemptions_swap"]), (1, 0),
                 "(recompute preemptions, swap preemptions) counted in self.counters")


@pytest.mark.points(2)
@pytest.mark.task("swap")
def test_swap_preemption(student):
    """Swap: the KV copy is planned in out.swap_out (by your swap_out), the victim keeps its progress and
    joins `swapped` in (priority, arrival) order, so the most important request comes back first.

    GPU tables (blocks of 4, taken in order): a 6 tokens [0, 1], b 3 [2], c 9 [3, 4, 5], d 5 [6, 7]. The
    victims are b (priority 2), c (1), d (latest of priority 0); the fresh CPU pool hands out 0, 1, 2 ...
    """
    sched = _scheduler(32, 16, preemption_mode="swap")
    sched.choose_preemption_mode = lambda request: "swap"  # this test grades _preempt (and swap_out)
    _running(sched, [("a", 6, 0, 0.0), ("b", 3, 2, 1.0), ("c", 9, 1, 2.0), ("d", 5, 0, 3.0)])
    plans = []
    with plug(student, LAB, only=['_preempt', 'swap_out']):
        for _ in range(3):
            out = SchedulerOutput()
            victim = sched._preempt(out)
            plans.append((victim.request_id, out.swap_out, victim.status, victim.num_computed_tokens))
    expect_equal(plans, [("b", [(2, 0)], RequestStatus.SWAPPED, 3),
                         ("c", [(3, 1), (4, 2), (5, 3)], RequestStatus.SWAPPED, 9),
                         ("d", [(6, 4), (7, 5)], RequestStatus.SWAPPED, 5)],
                 "(id, priority, arrival, GPU table) a 0 0 [0, 1], b 2 1 [2], c 1 2 [3, 4, 5], d 0 3 [6, 7], swap "
                 "mode, 16 free CPU blocks: (victim, out.swap_out, its status, its num_computed_tokens) of three "
                 "_preempt calls")
    expect_equal(_ids(sched.swapped), ["d", "c", "b"],
                 "the swapped queue after swapping b, c, d: sorted by (priority, arrival), the first to swap back in first")
    s = sched.stats()
    expect_equal((s["num_preemptions_swap"], s["num_preemptions_recompute"], s["num_blocks_swapped_out"]), (3, 0, 6),
                 "(swap preemptions, recompute preemptions, blocks swapped out) counted in self.counters")


# ---- find the bug: buggy_swap_out ------------------------------------------------------------

def buggy_swap_out(self, request):
    """Move the request's written KV to CPU blocks and free its GPU blocks; returns the
    (gpu_block_id, cpu_block_id) copies the runner performs before the next forward pass."""
    rid = request.request_id
    gpu_blocks = self.req_to_blocks.get(rid, [])
    n = request.num_computed_tokens // self.block_size  # the blocks that hold KV
    if n > self.cpu_block_pool.num_free_blocks:
        raise ValueError(f"swap_out: request {rid!r} needs {n} CPU blocks, "
                         f"{self.cpu_block_pool.num_free_blocks} are free")
    cpu_blocks = self.cpu_block_pool.get_new_blocks(n)
    self.block_pool.free_blocks(reversed(self.req_to_blocks.pop(rid, [])))
    self.num_cached_blocks.pop(rid, None)
    self.req_to_cpu_blocks[rid] = cpu_blocks
    return [(g.block_id, c.block_id) for g, c in zip(gpu_blocks, cpu_blocks)]


def _swap_out_verdict(args) -> str:
    """Runs buggy_swap_out on the learner's (num_computed_tokens, num_blocks_held) with blocks of 4, 16 GPU
    and 16 CPU blocks, and compares its copies with the specification: the first ceil(computed / 4) blocks of
    the table, each paired with a fresh CPU block (0, 1, 2 ... from a fresh pool)."""
    if not (isinstance(args, tuple) and len(args) == 2 and all(type(a) is int for a in args)):
        return "not a pair of ints (num_computed_tokens, num_blocks_held)"
    computed, held = args
    if not (1 <= held <= 16 and 0 <= computed <= 4 * held):
        return "out of range: need 1 <= num_blocks_held <= 16 and 0 <= num_computed_tokens <= 4 * num_blocks_held"
    kvm = build_manager(16, {"r": list(range(held))}, num_cpu_blocks=16)
    req = _request("r", 4 * held)
    req.num_computed_tokens = computed
    try:
        got = buggy_swap_out(kvm, req)
    except Exception as exc:  # noqa: BLE001 - an input that makes the buggy version raise also exposes it
        return f"buggy_swap_out raises {type(exc).__name__}: wrong here"
    want = [(i, i) for i in range(-(-computed // 4))]
    return "buggy_swap_out is wrong here" if got != want else "buggy_swap_out is right on this input"


@pytest.mark.points(2)
@pytest.mark.task("find_the_bug")
def test_failing_input_exposes_buggy_swap_out(student):
    """failing_input() returns (num_computed_tokens, num_blocks_held) on which buggy_swap_out (shown in the
    notebook; this module's copy is the one that runs) plans the wrong copies. Your own swap_out is the fix,
    graded by the swap tests."""
    expect_equal(_swap_out_verdict(student.failing_input()), "buggy_swap_out is wrong here",
                 "buggy_swap_out run on failing_input() (blocks of 4, a request holding table [0, 1, ...], a fresh "
                 "pool of 16 CPU blocks), compared with the copies the specification asks for")


# ---- prediction ------------------------------------------------------------------------------

LLAMA2_70B = ModelSpec(num_layers=80, hidden_size=8192, num_attention_heads=64, num_kv_heads=8, head_dim=128,
                       intermediate_size=28672, vocab_size=32000)


def crossover_tokens(tp=2, batch=64, context=2000) -> int:
    """The smallest n for which swapping n tokens of Llama-2-70B fp16 out and back over one H100's PCIe Gen5
    link costs less than adding them to a decode step of `batch` requests at `context` tokens (per GPU,
    roofline: max(bytes / HBM bandwidth, FLOPs / peak bf16))."""
    h100 = GPUS["H100-80GB"]
    kv_per_gpu = memory.kv_cache_bytes_per_token(LLAMA2_70B, "fp16") / tp
    weights = memory.weight_bytes(LLAMA2_70B, "fp16") / tp

    def step(extra):
        flops = batch * memory.prefill_flops(LLAMA2_70B, 1, context_start=context - 1) + (
            memory.prefill_flops(LLAMA2_70B, extra) if extra else 0)
        bytes_read = weights + (batch * context + extra) * kv_per_gpu
        return max(bytes_read / h100.hbm_bytes_per_s, flops / tp / h100.bf16_flops)

    n = 1
    while 2 * n * kv_per_gpu / h100.pcie_bytes_per_s >= step(n) - step(0):
        n += 1
    return n


@pytest.mark.points(2)
@pytest.mark.task("prediction")
def test_predicted_crossover(student):
    """Your predicted_crossover_tokens() against the roofline computation of section 5 (346 tokens).

    Tolerance 10%: a hand estimate that prices the extra tokens at 2 x parameters FLOPs each (ignoring their
    attention and their own KV reads), with 70e9 parameters and one-way or two-way PCIe, lands within 5%.
    Forgetting what the busy step already spends is a different answer: without the batch's 64 x 2,000
    tokens of KV reads the step looks compute-bound early (about 250 tokens, -29%); without the batch's own
    FLOPs the headroom looks larger (about 415, +20%)."""
    assert crossover_tokens() == 346, "section 5's number (a test bug)"
    expect_prediction(float(student.predicted_crossover_tokens()), float(crossover_tokens()),
                 "tokens n from which swapping n tokens out and back over PCIe Gen5 beats recomputing them inside a "
                 "decode step of 64 x 2,000 tokens (Llama-2-70B fp16, 2 x H100, TP 2, per GPU, roofline)", rtol=0.1)


# ---- task 3: swap_out / swap_in --------------------------------------------------------------

def _manager_with(num_gpu, num_cpu, computed, allocated):
    """Request x holds GPU block 0; r holds blocks 1.. for `allocated` positions, `computed` of them written."""
    table = list(range(1, 1 + -(-allocated // 4)))
    kvm = build_manager(num_gpu, {"x": [0], "r": table}, num_cpu_blocks=num_cpu)
    req = _request("r", allocated)
    req.num_computed_tokens = computed
    return kvm, req


def _tables(kvm, rid="r"):
    """What a swap changes: the request's GPU and CPU tables, the GPU free queue, the free CPU blocks."""
    return {"GPU table": kvm.get_block_ids(rid), "CPU table": kvm.get_cpu_block_ids(rid),
            "GPU free queue": list(kvm.block_pool.free_queue), "free CPU blocks": kvm.cpu_block_pool.num_free_blocks}


@pytest.mark.points(2)
@pytest.mark.task("swap")
def test_swap_out_copies_written_blocks_only(student):
    """Blocks holding written KV are copied to fresh CPU blocks; all GPU blocks are freed, tail first."""
    with plug(student, LAB, only=['swap_out', 'swap_in']):
        for computed, want_pairs in ((6, [(1, 0), (2, 1)]), (8, [(1, 0), (2, 1)]), (9, [(1, 0), (2, 1), (3, 2)])):
            kvm, req = _manager_with(8, 4, computed=computed, allocated=12)  # table [1, 2, 3]
            expect_equal(kvm.swap_out(req), want_pairs,
                         f"x holds block 0, r holds table [1, 2, 3] (12 positions allocated), {computed} computed "
                         f"tokens (blocks of 4), 4 free CPU blocks: swap_out(r), the (gpu, cpu) copies of the blocks "
                         f"holding KV (a block allocated for this step's tokens holds nothing yet)")
            expect_equal(_tables(kvm), {"GPU table": [], "CPU table": [b for _, b in want_pairs],
                                        "GPU free queue": [4, 5, 6, 7, 3, 2, 1], "free CPU blocks": 4 - len(want_pairs)},
                         f"after swap_out(r) with {computed} computed tokens: all three GPU blocks free, the table's "
                         f"tail first (as free() does)")


@pytest.mark.points(1)
@pytest.mark.task("swap")
def test_swap_out_rejects_without_cpu_room(student):
    """Not enough free CPU blocks: ValueError, nothing changed (choose_preemption_mode should have said recompute)."""
    with plug(student, LAB, only=['swap_out', 'swap_in']):
        kvm, req = _manager_with(8, 1, computed=6, allocated=8)
        expect_raises(ValueError, kvm.swap_out, req,
                      message="r holds [1, 2] with 6 computed tokens (2 blocks of KV), 1 free CPU block: swap_out(r)")
        expect_equal(_tables(kvm), {"GPU table": [1, 2], "CPU table": [], "GPU free queue": [3, 4, 5, 6, 7],
                                    "free CPU blocks": 1}, "after the rejected swap_out: unchanged")


@pytest.mark.points(2)
@pytest.mark.task("swap")
def test_swap_in_restores_the_table(student):
    """Swap-in takes fresh GPU blocks for the CPU blocks, in table order, and frees the CPU blocks."""
    # r (6 tokens of KV) was swapped out to CPU blocks [0, 1]; x holds GPU block 0 and y blocks 3, 4, 5
    with plug(student, LAB, only=['swap_out', 'swap_in']):
        kvm = build_manager(8, {"x": [0], "y": [3, 4, 5]}, free_order=[6, 7, 2, 1], num_cpu_blocks=4,
                            cpu_tables={"r": [0, 1]})
        req = _request("r", 8)
        req.num_computed_tokens = 6
        expect_equal(kvm.swap_in(req), [(0, 6), (1, 7)],
                     "r's CPU table [0, 1], GPU free queue [6, 7, 2, 1]: swap_in(r), the (cpu, gpu) copies; blocks "
                     "come from the free queue's front")
        expect_equal(_tables(kvm), {"GPU table": [6, 7], "CPU table": [], "GPU free queue": [2, 1], "free CPU blocks": 4},
                     "after swap_in(r)")


@pytest.mark.points(1)
@pytest.mark.task("swap")
def test_swap_in_rejects_without_gpu_room(student):
    """Not enough free GPU blocks: ValueError, nothing changed (the scheduler checks can_swap_in first)."""
    # r (8 tokens of KV) sits in CPU blocks [0, 1]; x and y hold 3 of the 4 GPU blocks: 1 free, r needs 2
    with plug(student, LAB, only=['swap_out', 'swap_in']):
        kvm = build_manager(4, {"x": [0], "y": [2, 1]}, num_cpu_blocks=4, cpu_tables={"r": [0, 1]})
        req = _request("r", 8)
        req.num_computed_tokens = 8
        expect_raises(ValueError, kvm.swap_in, req,
                      message="r's CPU table [0, 1], 1 free GPU block of 4: swap_in(r) needs 2")
        expect_equal((_tables(kvm), "r" in kvm.req_to_blocks),
                     ({"GPU table": [], "CPU table": [0, 1], "GPU free queue": [3], "free CPU blocks": 2}, False),
                     "after the rejected swap_in: (unchanged tables, does r have a GPU table?)")


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
    kvm.block_pool.get_new_blocks(2)  # another request holds blocks 3 and 4: r comes back into other blocks
    with plug(student, LAB, only=['swap_out', 'swap_in']):
        cache.swap_out(kvm.swap_out(req))
        for t in cache.key + cache.value:
            t.fill_(-1.0)  # and overwrites every GPU block
        mapping = kvm.swap_in(req)
    cache.swap_in(mapping)
    table = kvm.get_block_ids("r")
    after = [t[table].reshape(-1, 2, 3)[:7] for t in cache.key + cache.value]
    expect_equal(after, before,
                 "r's 7 tokens of KV (table [1, 2], blocks 3 and 4 held by another request) on real tensors: swap_out, "
                 "every GPU block overwritten, swap_in; the K and V rows of positions 0..6, layers 0 and 1 "
                 "([K0, K1, V0, V1], each [position][KV head][dim]) read through r's new table")


# ---- end to end ------------------------------------------------------------------------------

BLOCK_BYTES = 4 * 512  # tiny-llama in fp32: 512 bytes of KV per token, blocks of 4 tokens
COUNTS = ("num_preemptions_recompute", "num_preemptions_swap", "num_blocks_swapped_out", "num_blocks_swapped_in")


def _run(prompts, max_tokens, **engine_args):
    """tiny-llama on `prompts` (arrival i for prompt i) to the end."""
    return run_engine([[(f"r{i}", p, m) for i, (p, m) in enumerate(zip(prompts, max_tokens))]],
                      block_size=4, max_model_len=64, **engine_args)


@functools.cache
def _reference(key):
    """The reference engine's tokens and stats on a workload (run outside any plug, once per process)."""
    prompts, max_tokens, args = key
    run = _run(prompts, max_tokens, **dict(args))
    return run.tokens, run.stats


def _key(prompts, max_tokens, engine_args):
    return tuple(map(tuple, prompts)), tuple(max_tokens), tuple(sorted(engine_args.items()))


def _counts(stats, names=COUNTS):
    return {k: stats[k] for k in names}


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
    victim's KV (2 CPU blocks) swaps r3 (swap is cheaper at the CPU default rates, checked below) and
    must recompute r2 (no CPU room left); auto with a host link of 1 MB/s recomputes both.
    """
    flops, bandwidth = memory.DEFAULT_RATES["cpu"]
    recompute_s = memory.recompute_seconds(TINY, 8, flops)
    assert memory.swap_seconds(TINY, 8, "fp32", bandwidth) < recompute_s, "swap must be cheaper at the CPU rates (a test bug)"
    assert memory.swap_seconds(TINY, 8, "fp32", 1e6) > recompute_s, "1 MB/s must make swap the dearer (a test bug)"
    cases = [
        (dict(preemption_mode="recompute", swap_space=0), _expected_counts(2, 0)),
        (dict(preemption_mode="swap", swap_space=4 * BLOCK_BYTES / 2**30), _expected_counts(0, 2)),
        (dict(preemption_mode="auto", swap_space=2 * BLOCK_BYTES / 2**30), _expected_counts(1, 1)),
        (dict(preemption_mode="auto", swap_space=4 * BLOCK_BYTES / 2**30, swap_bandwidth_bytes_per_s=1e6),
         _expected_counts(2, 0)),
    ]
    for args, want in cases:
        engine_args = dict(num_gpu_blocks=8, max_num_batched_tokens=64, **args)
        with plug(student, LAB):
            run = _run(DESIGNED_PROMPTS, DESIGNED_MAX_TOKENS, **engine_args)
        key = _key(DESIGNED_PROMPTS, DESIGNED_MAX_TOKENS, engine_args)
        assert _counts(_reference(key)[1]) == want, "the reference engine disagrees with the derivation (a test bug)"
        setup = f"the designed workload of this test's docstring, {args}"
        expect_equal(_counts(run.stats), want, f"{setup}: preemption and swap counts")
        expect_equal(run.tokens, _reference(key)[0], f"{setup}: each request's tokens (the reference engine's)")
        expect_equal(run.held, [], f"{setup}: (pool, block, ref_cnt) still held after every request finished")


RANDOM_PROMPTS = [[(13 * i + 7 * j) % 500 + 3 for j in range(4 + (9 * i) % 23)] for i in range(10)]
RANDOM_MAX_TOKENS = [6 + (5 * i) % 13 for i in range(10)]


@pytest.mark.points(3)
@pytest.mark.task("end_to_end")
@pytest.mark.end_to_end
def test_engine_tokens_under_memory_pressure(student):
    """10 requests on 16 blocks of 4, in recompute, swap and auto mode: the reference tokens and preemption
    counts, no leaked block."""
    for mode in ("recompute", "swap", "auto"):
        engine_args = dict(num_gpu_blocks=16, max_num_batched_tokens=32, preemption_mode=mode,
                           swap_space=16 * BLOCK_BYTES / 2**30)
        with plug(student, LAB):
            run = _run(RANDOM_PROMPTS, RANDOM_MAX_TOKENS, **engine_args)
        key = _key(RANDOM_PROMPTS, RANDOM_MAX_TOKENS, engine_args)
        assert _reference(key)[1]["num_preemptions"] > 0, "the workload must preempt (a test bug)"
        setup = (f"tiny-llama, 16 blocks of 4, budget 32, preemption_mode={mode!r}, 16 CPU blocks, prompt lengths "
                 f"{[len(p) for p in RANDOM_PROMPTS]}, max_tokens {RANDOM_MAX_TOKENS}")
        expect_equal(run.tokens, _reference(key)[0], f"{setup}: each request's tokens (the reference engine's)")
        expect_equal(_counts(run.stats), _counts(_reference(key)[1]), f"{setup}: preemption and swap counts")
        expect_equal(run.held, [], f"{setup}: (pool, block, ref_cnt) still held after every request finished")


SHARED = [200 + j for j in range(8)]  # an 8-token shared prefix: two full blocks of 4
PREFIX_PROMPTS = [SHARED + [(17 * i + 5 * j) % 150 + 3 for j in range(3 + (5 * i) % 7)] for i in range(8)]
PREFIX_MAX_TOKENS = [6 + (3 * i) % 7 for i in range(8)]
PREFIX_COUNTS = COUNTS + ("prefix_cache_queries", "prefix_cache_hits")


@pytest.mark.points(2)
@pytest.mark.task("end_to_end")
@pytest.mark.end_to_end
def test_swap_with_prefix_caching(student):
    """Swap preemption with prefix caching on: a request swapped out and back must cache its later blocks
    again (forget its cached-block count in swap_out), so the prefix-cache hits and the swap counts are the
    reference engine's; tokens equal, nothing leaked."""
    engine_args = dict(num_gpu_blocks=14, max_num_batched_tokens=32, preemption_mode="swap",
                       swap_space=16 * BLOCK_BYTES / 2**30, enable_prefix_caching=True)
    with plug(student, LAB):
        run = _run(PREFIX_PROMPTS, PREFIX_MAX_TOKENS, **engine_args)
    key = _key(PREFIX_PROMPTS, PREFIX_MAX_TOKENS, engine_args)
    assert min(_reference(key)[1]["num_preemptions_swap"], _reference(key)[1]["prefix_cache_hits"]) > 0, (
        "the workload must swap and hit (a test bug)")
    setup = ("tiny-llama, 14 blocks of 4, budget 32, preemption_mode='swap', 16 CPU blocks, prefix caching on, "
             f"8 requests sharing an 8-token prefix, prompt lengths {[len(p) for p in PREFIX_PROMPTS]}")
    expect_equal(_counts(run.stats, PREFIX_COUNTS), _counts(_reference(key)[1], PREFIX_COUNTS),
                 f"{setup}: preemption, swap and prefix-cache counts")
    expect_equal(run.tokens, _reference(key)[0], f"{setup}: each request's tokens (the reference engine's)")
    expect_equal(run.held, [], f"{setup}: (pool, block, ref_cnt) still held after every request finished")


# ---- the max_num_seqs knee -------------------------------------------------------------------

# (num_blocks, block_size, prompt_len, max_tokens, knee, why): the engine writes KV for every position but the
# last sampled token, so a request ends holding ceil((prompt_len + max_tokens - 1) / block_size) blocks
KNEE_CASES = [
    (24, 4, 9, 8, 6, "9 + 8 - 1 = 16 positions of KV fill exactly 4 blocks: the last sampled token needs no slot"),
    (24, 4, 9, 6, 6, "9 + 6 - 1 = 14 positions: 3.5 blocks, and a partly filled block is a whole block"),
    (8, 4, 8, 1, 4, "max_tokens 1: only the prompt's 8 positions are ever written"),
    (10, 16, 1, 1, 10, "one position per request, one block each"),
    (100, 16, 300, 200, 3, "499 positions in 32 blocks: 3 requests take 96 of the 100 blocks"),
    (5, 4, 20, 10, 0, "29 positions need 8 blocks: no request ever fits alone, no setting avoids preemption"),
]


@pytest.mark.points(2)
@pytest.mark.task("knee")
def test_knee_max_num_seqs_hand_cases(student):
    """knee_max_num_seqs: num_blocks // ceil((prompt_len + max_tokens - 1) / block_size), the most identical
    requests whose KV at their last step fits the cache together."""
    for blocks, size, prompt, out, want, why in KNEE_CASES:
        expect_equal(student.knee_max_num_seqs(blocks, size, prompt, out), want,
                     f"knee_max_num_seqs(num_blocks={blocks}, block_size={size}, prompt_len={prompt}, "
                     f"max_tokens={out}): {why}")


SWEEP = (1, 2, 4, 6, 7, 8, 16)
SWEEP_BLOCKS, SWEEP_PROMPT, SWEEP_OUTPUT, SWEEP_REQUESTS = 24, 9, 8, 12


def sweep_run(max_num_seqs: int) -> dict:
    """tiny-llama, 24 blocks of 4, recompute mode, 12 requests of 9 prompt + 8 output tokens arriving together:
    the engine's preemption count and the most requests it ever held in `running` at once."""
    engine = make_engine("tiny-llama", block_size=4, num_gpu_blocks=SWEEP_BLOCKS, max_model_len=64,
                         max_num_batched_tokens=64, max_num_seqs=max_num_seqs, preemption_mode="recompute")
    for i in range(SWEEP_REQUESTS):
        engine.add_request(f"r{i}", [3 + 11 * i + j for j in range(SWEEP_PROMPT)],
                           SamplingParams(max_tokens=SWEEP_OUTPUT, temperature=0.0, ignore_eos=True),
                           arrival_time=float(i))
    peak = steps = 0
    while engine.has_unfinished_requests():
        steps += 1
        assert steps <= 2000, "the engine made no progress in 2000 steps (a test bug)"
        engine.step()
        peak = max(peak, len(engine.scheduler.running))
    return {"preemptions": engine.stats()["num_preemptions"], "peak_running": peak}


@pytest.mark.points(2)
@pytest.mark.task("knee")
def test_knee_matches_the_engine_sweep(student):
    """The engine run at each max_num_seqs of SWEEP, with your preemption code plugged in: no preemption exactly
    up to your knee, and up to it every allowed seat is taken (peak running = max_num_seqs); above it admission fills the blocks with prompts (3 blocks each: 8 requests) and the
    growing KV forces preemptions."""
    knee = student.knee_max_num_seqs(SWEEP_BLOCKS, 4, SWEEP_PROMPT, SWEEP_OUTPUT)
    admitted = SWEEP_BLOCKS // -(-SWEEP_PROMPT // 4)
    setup = (f"tiny-llama, {SWEEP_BLOCKS} blocks of 4, {SWEEP_REQUESTS} requests of {SWEEP_PROMPT} prompt + "
             f"{SWEEP_OUTPUT} output tokens, recompute mode")
    with plug(student, LAB):  # in batch grading the engine's preemption code is the learner's
        got = {m: sweep_run(m) for m in SWEEP}
    expect_equal({m: r["preemptions"] == 0 for m, r in got.items()}, {m: m <= knee for m in SWEEP},
                 f"{setup}: max_num_seqs -> no preemption (the engine's counter), against max_num_seqs <= your knee "
                 f"{knee}")
    expect_equal({m: r["peak_running"] for m, r in got.items()},
                 {m: min(m, SWEEP_REQUESTS, admitted) for m in SWEEP},
                 f"{setup}: max_num_seqs -> the most requests running at once (seats, or blocks for {admitted} "
                 f"prompts)")


LLAMA3_8B_KV_BYTES_PER_TOKEN = 2 * 32 * 8 * 128 * 2  # K and V, 32 layers, 8 KV heads, 128 dims, bf16


@pytest.mark.points(1)
@pytest.mark.task("knee_prediction")
def test_predicted_knee_llama3_8b(student):
    """Llama-3.1-8B in bf16 with 54 GiB of KV cache in blocks of 16, requests of 1,800 prompt + 600 output tokens:
    the largest max_num_seqs that never preempts (exact: an integer rule)."""
    num_blocks = 54 * 2**30 // (16 * LLAMA3_8B_KV_BYTES_PER_TOKEN)
    want = num_blocks // -(-(1800 + 600 - 1) // 16)
    expect_prediction(int(student.predicted_knee_llama3_8b()), want,
                      "the largest max_num_seqs that never preempts: Llama-3.1-8B bf16, 54 GiB of KV cache in blocks "
                      "of 16 tokens, every request 1,800 prompt + 600 output tokens (requests)")
