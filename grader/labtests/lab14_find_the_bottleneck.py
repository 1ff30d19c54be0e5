"""Official tests of lab 14_find_the_bottleneck: profile a slow engine, fix what the profile shows.

The slow engine (grader/slow_engine) is the reference step with slowdowns planted at five seams
(grader/seams.py): `AttentionPlan.write_kv` and `AttentionPlan.attend` (the KV write and attention of
every layer), `Sampler.__call__` (a contract-only task, `sample`), `InputBatch.block_tables` and
`Scheduler._remove_finished`. The learner rewrites each as a plain function. Every check is an
`expect_*` observation of what the learner's code did through the engine: the tokens of a fixed
workload against the reference engine's (run outside the plug), torch calls and host syncs counted
(grader.harness.CountTorchCalls), decode-op launches counted, copies of the KV cache caught, and the
speedup over the slow engine measured in this process (alternating runs, the median of the ratios).
Plus three predictions, the OOM hunt (lab 01's capacity model, engine_core.memory) and a quiz of
hardware numbers from memory.
"""
import contextlib
import dataclasses
import functools
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Iterator

import pytest
import torch

from grader.harness import (GPUS, LLM, AttentionMetadata, AttentionPlan, CountTorchCalls, InputBatch, LayerKV,
                            ModelSpec, Request, Sampler, SamplingParams, make_engine, make_request,
                            make_scheduler, memory)
from grader.observe import expect_close, expect_equal, expect_prediction
from grader.plug import plug
from grader.seams import seams_of
from grader.slow_engine import SLOW as SLOW_VARIANTS
from grader.slow_engine import slow_engine, variants

LAB = "14_find_the_bottleneck"

# ---- task 1: the predictions -------------------------------------------------------------------

@pytest.mark.points(1)
@pytest.mark.task("predictions")
def test_predicted_decode_launches(student):
    """One decode step of 16 sequences through tiny-llama's 2 layers: the slow attention launches the decode
    op once per sequence and layer (16 x 2 = 32), the fixed one once per layer (2). Exact counts."""
    expect_prediction(tuple(student.predicted_decode_launches()), (32, 2),
                 "predicted_decode_launches(): (decode-op launches of the slow engine, of the fixed one) in one "
                 "decode step of 16 sequences, tiny-llama (2 layers)")


@pytest.mark.points(1)
@pytest.mark.task("predictions")
def test_predicted_kv_write_iterations(student):
    """One prefill step of 8 prompts of 24 tokens: the slow KV write runs one Python iteration per token and
    layer, 8 x 24 x 2 = 384. Exact."""
    expect_prediction(student.predicted_kv_write_iterations(), 384,
                 "predicted_kv_write_iterations(): Python iterations of the slow write_kv in one prefill step of 8 "
                 "prompts of 24 tokens, tiny-llama (2 layers)")


@pytest.mark.points(1)
@pytest.mark.task("predictions")
def test_predicted_clone_bytes(student):
    """The bytes the slow attention's defensive copy writes in one forward of tiny-llama with 512 blocks of 16
    slots: per layer K and V, each 512 x 16 slots x 2 KV heads x 16 dims x 4 bytes (fp32) = 1,048,576 bytes
    (1 MiB); x 2 tensors x 2 layers = 4,194,304 bytes (4 MiB). Tolerance 1%: rounding only; one tensor instead
    of two, or one layer, is off by 2x."""
    expect_prediction(student.predicted_clone_bytes(), 2 * 2 * 512 * 16 * 2 * 16 * 4,
                 "predicted_clone_bytes(): bytes copied by the slow attend's clone in one forward (tiny-llama, 512 "
                 "blocks of 16, fp32)", rtol=0.01)


# ---- task 2: write_kv ------------------------------------------------------------------------

NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 2, 16, 4


def _layer_kv(num_blocks: int, seed: int = 0) -> LayerKV:
    gen = torch.Generator().manual_seed(seed)
    shape = (num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    return LayerKV(torch.randn(shape, generator=gen), torch.randn(shape, generator=gen), torch.ones(()), torch.ones(()))


def _plan(seq_lens: list[int], query_lens: list[int], num_blocks: int, seed: int = 0) -> AttentionPlan:
    """A CPU plan for sequences of `seq_lens` tokens (context after the step) with `query_lens` new rows each
    (rows of 1 first: the decode rows), blocks handed out shuffled, slots of the new rows as the engine maps them."""
    gen = torch.Generator().manual_seed(seed)
    perm = torch.randperm(num_blocks, generator=gen)
    blocks = [-(-n // BLOCK_SIZE) for n in seq_lens]
    tables = torch.zeros(len(seq_lens), max(blocks) + 1, dtype=torch.int32)
    taken, slots = 0, []
    for i, (n, q, nb) in enumerate(zip(seq_lens, query_lens, blocks)):
        tables[i, :nb] = perm[taken:taken + nb].to(torch.int32)
        taken += nb
        for pos in range(n - q, n):
            slots.append(int(tables[i, pos // BLOCK_SIZE]) * BLOCK_SIZE + pos % BLOCK_SIZE)
    qsl = torch.zeros(len(seq_lens) + 1, dtype=torch.int32)
    qsl[1:] = torch.tensor(query_lens).cumsum(0)
    meta = AttentionMetadata(slot_mapping=torch.tensor(slots, dtype=torch.int64), block_tables=tables,
                             seq_lens=torch.tensor(seq_lens, dtype=torch.int32), query_start_loc=qsl,
                             num_decode_seqs=sum(1 for q in query_lens if q == 1), backend="torch")
    return AttentionPlan(meta, torch.device("cpu"), torch.float32)


def _new_kv(num_tokens: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(num_tokens, NUM_KV_HEADS, HEAD_DIM, generator=gen),
            torch.randn(num_tokens, NUM_KV_HEADS, HEAD_DIM, generator=gen))


def _written(plan: AttentionPlan, key: torch.Tensor, value: torch.Tensor, kv: LayerKV) -> tuple[torch.Tensor, torch.Tensor]:
    """The caches as a correct write leaves them: slot s of the flat view holds the new row mapped to s."""
    k, v = kv.key_cache.clone(), kv.value_cache.clone()
    for i, s in enumerate(plan.meta.slot_mapping.tolist()):
        k.view(-1, NUM_KV_HEADS, HEAD_DIM)[s] = key[i]
        v.view(-1, NUM_KV_HEADS, HEAD_DIM)[s] = value[i]
    return k, v


@pytest.mark.points(2)
@pytest.mark.task("write_kv")
def test_write_kv_writes_every_slot(student):
    """2 decode rows and chunks of 5 and 3 rows, blocks of 4 handed out shuffled: each new K and V row lands in
    the slot slot_mapping names, in the K and in the V cache, and no other slot changes."""
    plan = _plan([7, 3, 9, 5], [1, 1, 5, 3], num_blocks=12)
    kv = _layer_kv(12)
    key, value = _new_kv(len(plan.meta.slot_mapping))
    expected = _written(plan, key, value, kv)
    with plug(student, LAB, only=["write_kv"]):
        student.write_kv(plan, key, value, kv)
    setup = f"write_kv with slot_mapping {plan.meta.slot_mapping.tolist()} (blocks of {BLOCK_SIZE})"
    expect_close(kv.key_cache, expected[0], f"{setup}: the key cache after the write", atol=0)
    expect_close(kv.value_cache, expected[1], f"{setup}: the value cache after the write", atol=0)


@pytest.mark.points(2)
@pytest.mark.task("write_kv")
def test_write_kv_no_loop_over_tokens(student):
    """The KV write is one batched op, not a Python loop over tokens: as many torch calls (CountTorchCalls) and no
    more host syncs for 64 new tokens as for 4."""
    counts = []
    for lens in ([1, 1, 1, 1], [16, 16, 16, 16]):
        plan = _plan(lens, lens, num_blocks=24)
        kv = _layer_kv(24)
        key, value = _new_kv(sum(lens))
        with plug(student, LAB, only=["write_kv"]):
            with CountTorchCalls() as counted:
                student.write_kv(plan, key, value, kv)
        counts.append((counted.calls, counted.host_syncs))
    expect_equal(counts[1][0] - counts[0][0], 0, "torch calls of write_kv for 64 new tokens minus those for 4: more "
                                                 "tokens must not mean more calls")
    expect_equal(counts[1][1] - counts[0][1], 0, "host syncs (item, tolist, int() of a tensor) of write_kv for 64 "
                                                 "tokens minus those for 4")


# ---- task 3: attend -------------------------------------------------------------------------

def _attend_reference(plan: AttentionPlan, query: torch.Tensor, kv: LayerKV, scale: float) -> torch.Tensor:
    """float64 softmax attention, row by row: each query row over its sequence's positions up to its own."""
    meta, out = plan.meta, torch.empty(query.shape, dtype=torch.float64)
    qsl, group = meta.query_start_loc.tolist(), query.shape[1] // NUM_KV_HEADS
    k_flat = kv.key_cache.double().view(-1, NUM_KV_HEADS, HEAD_DIM)
    v_flat = kv.value_cache.double().view(-1, NUM_KV_HEADS, HEAD_DIM)
    for i, n in enumerate(meta.seq_lens.tolist()):
        slots = [int(meta.block_tables[i, p // BLOCK_SIZE]) * BLOCK_SIZE + p % BLOCK_SIZE for p in range(n)]
        k, v = k_flat[slots].repeat_interleave(group, 1), v_flat[slots].repeat_interleave(group, 1)  # [n, H, D]
        rows = range(qsl[i], qsl[i + 1])
        for j, row in enumerate(rows):
            visible = n - len(rows) + j + 1
            w = torch.einsum("hd,nhd->hn", query[row].double(), k[:visible]) * scale
            out[row] = torch.einsum("hn,nhd->hd", w.softmax(-1), v[:visible])
    return out


def _query(num_rows: int, seed: int = 2) -> torch.Tensor:
    return torch.randn(num_rows, 2 * NUM_KV_HEADS, HEAD_DIM, generator=torch.Generator().manual_seed(seed))


def _counting_ops(plan: AttentionPlan) -> dict[str, int]:
    """Counts the plan's decode-op and varlen-op launches from now on."""
    launches = {"decode": 0, "varlen": 0}

    def counted(kind, fn):
        def launch(*args, **kwargs):
            launches[kind] += 1
            return fn(*args, **kwargs)
        return launch
    plan.ops = dataclasses.replace(plan.ops, paged_attention_decode=counted("decode", plan.ops.paged_attention_decode),
                                   paged_attention=counted("varlen", plan.ops.paged_attention))
    return launches


@pytest.mark.points(2)
@pytest.mark.task("attend")
def test_attend_mixed_batch(student):
    """3 decode rows (GQA 2:1) and prefill chunks of 4 and 2 rows over contexts of 9 and 6: every row's output
    equals float64 attention over its sequence's positions up to its own (1e-4: fp32 sums of a few terms)."""
    plan = _plan([5, 11, 2, 9, 6], [1, 1, 1, 4, 2], num_blocks=16)
    kv, query = _layer_kv(16), _query(9)
    with plug(student, LAB, only=["attend"]):
        out = student.attend(plan, query, kv, 0.25)
    expect_close(out, _attend_reference(plan, query, kv, 0.25), "attend on decode rows of contexts [5, 11, 2] and "
                 "chunks of 4 and 2 rows over contexts [9, 6] (4 query heads, 2 KV heads, blocks of 4)", atol=1e-4)


@pytest.mark.points(2)
@pytest.mark.task("attend")
def test_attend_one_decode_launch_for_the_batch(student):
    """A decode-only batch of 12 sequences: one launch of the decode op for all of them (not one per sequence) and
    no launch of the varlen op; with two prefill chunks beside them, one launch of each."""
    lens = [3 + (5 * i) % 17 for i in range(12)]
    plan = _plan(lens, [1] * 12, num_blocks=64)
    launches = _counting_ops(plan)
    mixed = _plan(lens + [7, 5], [1] * 12 + [3, 2], num_blocks=80)
    mixed_launches = _counting_ops(mixed)
    with plug(student, LAB, only=["attend"]):
        out = student.attend(plan, _query(12), _layer_kv(64), 0.25)
        student.attend(mixed, _query(17), _layer_kv(80), 0.25)
    expect_equal(launches, {"decode": 1, "varlen": 0}, "attend on 12 decode rows: launches of the decode and the "
                                                       "varlen (prefill) op")
    expect_equal(mixed_launches, {"decode": 1, "varlen": 1}, "attend on 12 decode rows and 2 prefill chunks: launches")
    expect_close(out, _attend_reference(plan, _query(12), _layer_kv(64), 0.25), "attend on 12 decode rows", atol=1e-4)


class _CacheCopies(CountTorchCalls):
    """Catches torch calls that return a tensor as large as the KV cache but not the cache itself: a copy."""

    def __init__(self, cache_numel: int, caches: list[torch.Tensor]) -> None:
        super().__init__()
        self.cache_numel, self.ptrs, self.copies = cache_numel, {c.data_ptr() for c in caches}, []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = super().__torch_function__(func, types, args, kwargs)
        if isinstance(out, torch.Tensor) and out.numel() >= self.cache_numel and out.data_ptr() not in self.ptrs:
            self.copies.append(getattr(func, "__name__", repr(func)))
        return out


@pytest.mark.points(2)
@pytest.mark.task("attend")
def test_attend_never_copies_the_cache(student):
    """The kernels read the cache where it is: no call inside attend returns a tensor the size of a layer's K or V
    cache (a clone, a contiguous copy of a view, a cast), on a decode batch and a mixed one."""
    copies = []
    for lens, q in (([6, 9, 4], [1, 1, 1]), ([6, 9, 4, 8], [1, 1, 1, 3])):
        plan, kv = _plan(lens, q, num_blocks=32), _layer_kv(32)
        with plug(student, LAB, only=["attend"]):
            with _CacheCopies(kv.key_cache.numel(), [kv.key_cache, kv.value_cache]) as counted:
                student.attend(plan, _query(sum(q)), kv, 0.25)
        copies.append(counted.copies)
    expect_equal(copies, [[], []], "torch calls in attend that returned a copy of the KV cache (decode batch, mixed "
                                   "batch)")


# ---- task 4: sample (contract only) --------------------------------------------------------------

VOCAB = 64


def _requests(kinds: list[str]) -> list[Request]:
    """g: greedy; s: seeded, temperature 0.7; t: seeded with top-k 5 and top-p 0.9; u: unseeded, temperature 1.3."""
    params = {"g": dict(temperature=0.0), "s": dict(temperature=0.7), "t": dict(temperature=1.0, top_k=5, top_p=0.9),
              "u": dict(temperature=1.3)}
    out = []
    for i, k in enumerate(kinds):
        seed = None if k in "gu" else 100 + i
        r = Request(f"r{i}", [3, 4, 5], SamplingParams(max_tokens=8, seed=seed, **params[k]))
        r.append_token(7 + i, 0.0)  # one output token already: the draw seeds on the position
        out.append(r)
    return out


def _logits(num_rows: int, seed: int = 3) -> torch.Tensor:
    return 2.0 * torch.randn(num_rows, VOCAB, generator=torch.Generator().manual_seed(seed))


def _spoiled(logits: torch.Tensor, rows: tuple[tuple[int, str], ...]) -> torch.Tensor:
    """`logits` with each (row, how) spoiled: "nan" a NaN logit, "inf" a +inf one, "-inf" no finite logit at all."""
    for row, how in rows:
        if how == "-inf":
            logits[row] = float("-inf")
        else:
            logits[row, 5] = float(how)
    return logits


@functools.cache
def _reference_sample(kinds: str, spoiled: tuple[tuple[int, str], ...] = ()) -> list[int]:
    return Sampler(0)(_spoiled(_logits(len(kinds)), spoiled), _requests(list(kinds)))


@pytest.mark.points(2)
@pytest.mark.task("sample")
def test_sample_follows_the_contract(student):
    """Greedy, seeded (temperature 0.7), seeded top-k 5 / top-p 0.9 and unseeded rows in one batch: the tokens of
    the reference sampler with the same engine seed (seeded draws depend on (seed, position) alone, unseeded rows
    take one draw of the engine generator in row order)."""
    kinds = "gstugsut"
    with plug(student, LAB, only=["sample"]):
        tokens = student.sample(Sampler(0), _logits(len(kinds)), _requests(list(kinds)))
    expect_equal(list(tokens), _reference_sample(kinds), f"sample on rows {list(kinds)} (g greedy, s seeded, t top-k "
                                                         "top-p, u unseeded), engine seed 0")


@pytest.mark.points(1)
@pytest.mark.task("sample")
def test_sample_rows_without_a_finite_max_are_invalid(student):
    """A row whose max logit is not finite gives INVALID_TOKEN (-1), greedy or sampled: a NaN logit, a +inf one
    (argmax would pick it silently), or no finite logit at all (all -inf: nothing to sample). The other rows keep
    their tokens."""
    kinds = "gsgsgsgu"
    spoiled = ((1, "nan"), (2, "nan"), (3, "inf"), (4, "inf"), (5, "-inf"), (6, "-inf"))
    with plug(student, LAB, only=["sample"]):
        tokens = student.sample(Sampler(0), _spoiled(_logits(len(kinds)), spoiled), _requests(list(kinds)))
    expect_equal(list(tokens), _reference_sample(kinds, spoiled),
                 f"sample on rows {list(kinds)} (g greedy, s seeded, u unseeded) spoiled as {list(spoiled)} (a NaN "
                 "logit, a +inf logit, every logit -inf); rows 0 and 7 untouched")


@pytest.mark.points(2)
@pytest.mark.task("sample")
def test_sample_one_host_sync_for_the_batch(student):
    """Sampling is vectorised over the batch: as many torch calls for 48 greedy and unseeded rows as for 4, and at
    most one host sync (the tokens read back once) whatever the batch."""
    counts = []
    for n in (4, 48):
        kinds = list("gu" * (n // 2))
        with plug(student, LAB, only=["sample"]):
            with CountTorchCalls() as counted:
                student.sample(Sampler(0), _logits(n), _requests(kinds))
        counts.append((counted.calls, counted.host_syncs))
    expect_equal(counts[1][0] - counts[0][0], 0, "torch calls of sample on 48 rows minus those on 4")
    expect_equal(counts[1][1] <= 1, True, f"sample on 48 rows: at most one host sync (got {counts[1][1]})")


# ---- task 5: block_tables -----------------------------------------------------------------------

def _input_batch(num_blocks: list[int], max_blocks: int = 32) -> InputBatch:
    """An InputBatch whose row r holds a table of num_blocks[r] blocks (ids 1000 r + j), written directly."""
    batch = InputBatch(len(num_blocks) + 2, max_blocks)
    batch.block_table[:] = -7  # stale entries: never part of a table
    for r, n in enumerate(num_blocks):
        batch.block_table[r, :n] = [1000 * r + j for j in range(n)]
        batch.num_blocks[r] = n
    return batch


def _tables_seen(tables: torch.Tensor, batch: InputBatch, rows: list[int]) -> list:
    """What a kernel reads of the result: shape, dtype and each row's own blocks."""
    return [list(tables.shape), str(tables.dtype)] + [tables[i, :int(batch.num_blocks[r])].tolist()
                                                      for i, r in enumerate(rows)]


@pytest.mark.points(2)
@pytest.mark.task("block_tables")
def test_block_tables_ragged_rows(student):
    """Rows [3, 0, 2] of tables of 5, 1, 7 and 2 blocks, then one row, then no row: int32, as wide as the widest
    table asked for, each row starting with its own blocks."""
    batch = _input_batch([5, 1, 7, 2])
    seen = []
    with plug(student, LAB, only=["block_tables"]):
        for rows in ([3, 0, 2], [1], []):
            seen.append(_tables_seen(student.block_tables(batch, rows), batch, rows))
    expect_equal(seen, [[[3, 7], "torch.int32", [3000, 3001], [0, 1, 2, 3, 4], [2000 + j for j in range(7)]],
                        [[1, 1], "torch.int32", [1000]], [[0, 0], "torch.int32"]],
                 "block_tables for rows [3, 0, 2], [1], [] of tables of 5, 1, 7, 2 blocks: [shape, dtype, each row's "
                 "blocks]")


# Every timing here is the CPU time of the calling thread (time.thread_time) with torch on one thread, so that
# thread does all the work: a busy machine steals wall-clock time from both sides of a ratio unevenly (a pair can
# straddle a burst of other work), but not CPU time, which counts only the work done. Not time.process_time: under
# an RLIMIT_CPU (batch grading's sandbox sets one) Linux reads the process clock at scheduler-tick granularity,
# and a 10 us call measures 0.
CLOCK = time.thread_time


@contextlib.contextmanager
def _one_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _median_ratio(slow, fast, pairs: int) -> float:
    """Median over alternating pairs of slow CPU time / fast CPU time (order flipped every pair)."""
    with _one_thread():
        return statistics.median(_ratios(slow, fast, pairs))


def _ratios(slow, fast, pairs: int) -> list[float]:
    ratios = []
    for i in range(pairs):
        first, second = (slow, fast) if i % 2 == 0 else (fast, slow)
        t0 = CLOCK()
        first()
        t1 = CLOCK()
        second()
        t2 = CLOCK()
        t_first, t_second = t1 - t0, t2 - t1
        ratios.append(t_first / t_second if first is slow else t_second / t_first)
    return ratios


@pytest.mark.points(1)
@pytest.mark.task("block_tables")
def test_block_tables_not_rebuilt_from_python_lists(student):
    """1,024 rows of 48-block tables: the tables gathered as one array slice, not rebuilt from Python lists. Measured
    against the slow variant in this process (11 alternating pairs, median ratio). The target, 8x, fails a rebuild
    from lists (1x) or a per-row copy into a tensor (about 3x: both scale with the rows). At 256 rows a correct
    gather through torch (`index_select`, tests/labs/test_lab_alternatives.py) measured 7.7x under load: its fixed
    cost of a few torch calls weighed against too little work; at 1,024 rows the slow side does 4x more, and the
    engine's slice is hundreds of times faster."""
    batch = _input_batch([48] * 1024, max_blocks=64)
    rows = list(range(1023, -1, -1))
    with plug(student, LAB, only=["block_tables"]):
        ratio = _median_ratio(lambda: variants.block_tables(batch, rows), lambda: student.block_tables(batch, rows), 11)
    expect_equal(ratio >= 8, True, f"block_tables for 1024 rows of 48 blocks: {ratio:.1f}x faster than rebuilding "
                                   "them from Python lists; the target is 8x")


# ---- task 6: remove_finished ------------------------------------------------------------------

def _running(num: int):
    sched = make_scheduler(num_gpu_blocks=8, max_num_seqs=num)
    sched.running = [make_request(f"r{i}", 2) for i in range(num)]
    return sched


@pytest.mark.points(2)
@pytest.mark.task("remove_finished")
def test_remove_finished_keeps_the_order(student):
    """Running r0..r9, r3, r0, r9 and r4 finish (in that order): the rest stay, in their running order; a step with
    one finished request, and one that finishes them all."""
    kept = []
    with plug(student, LAB, only=["remove_finished"]):
        for finished in (["r3", "r0", "r9", "r4"], ["r5"], [f"r{i}" for i in range(10)]):
            sched = _running(10)
            by_id = {r.request_id: r for r in sched.running}
            student.remove_finished(sched, [by_id[rid] for rid in finished])
            kept.append([r.request_id for r in sched.running])
    expect_equal(kept, [["r1", "r2", "r5", "r6", "r7", "r8"], [f"r{i}" for i in range(10) if i != 5], []],
                 "running after remove_finished of [r3, r0, r9, r4], of [r5], of all 10")


@pytest.mark.points(1)
@pytest.mark.task("remove_finished")
def test_remove_finished_is_linear(student):
    """2000 running requests, 1000 of them finishing in one step: one pass with a set, not a scan of the finished
    list per running request. Against the slow variant's scan (7 alternating pairs, median ratio): measured 300x
    to 1000x for a set on the loaded machine; the target is 20x, which a list membership test (`in` a list of
    1000 ids, about 10x) also fails."""
    def states():  # built before the timing: each call gets a fresh scheduler of its own
        out = []
        for _ in range(7):
            sched = _running(2000)
            out.append((sched, sched.running[::2]))
        return out
    slow_states, fast_states = states(), states()

    def slow():
        variants.remove_finished(*slow_states.pop())

    def fast():
        student.remove_finished(*fast_states.pop())
    with plug(student, LAB, only=["remove_finished"]):
        ratio = _median_ratio(slow, fast, 7)
    expect_equal(ratio >= 20, True, f"remove_finished of 1000 of 2000 running requests: {ratio:.1f}x faster than "
                                    "the slow variant's scan; the target is 20x")


# ---- task 7: end to end: the same tokens, faster --------------------------------------------

E2E_ARGS = dict(num_gpu_blocks=1024, max_num_seqs=64, max_num_batched_tokens=512)


def _workload(num: int, prompt_len: int, max_tokens: int) -> list[tuple[str, list[int], SamplingParams]]:
    """Every fourth request seeded sampling (temperature 0.8, top-k 50, top-p 0.95; seeded, so the tokens are
    reproducible), the others greedy; prompts of prompt_len to prompt_len + 4 tokens."""
    greedy, sampled = dict(temperature=0.0), dict(temperature=0.8, top_k=50, top_p=0.95)
    return [(f"r{i}", [(7 * i + j) % 500 + 3 for j in range(prompt_len + i % 5)],
             SamplingParams(max_tokens=max_tokens, seed=None if i % 4 else 1000 + i, ignore_eos=True,
                            **(greedy if i % 4 else sampled)))
            for i in range(num)]


def _run(workload, **engine_args) -> dict[str, list[int]]:
    engine = make_engine("tiny-llama", **{**E2E_ARGS, **engine_args})
    for rid, prompt, params in workload:
        engine.add_request(rid, prompt, params)
    tokens, steps = {}, 0
    while engine.has_unfinished_requests() and steps < 500:
        steps += 1
        for out in engine.step():
            if out.finished:
                tokens[out.request_id] = list(out.outputs[0].token_ids)
    return tokens


TOKENS_WORKLOAD = dict(num=12, prompt_len=9, max_tokens=10)
TOKENS_ARGS = dict(max_num_batched_tokens=40, num_gpu_blocks=64)  # chunked prefill beside decodes


@functools.cache
def _reference_tokens() -> dict[str, list[int]]:
    return _run(_workload(**TOKENS_WORKLOAD), **TOKENS_ARGS)


@pytest.mark.points(3)
@pytest.mark.task("end_to_end")
@pytest.mark.end_to_end
def test_engine_tokens_match_the_reference(student):
    """tiny-llama with all five of your functions: 12 requests (a quarter seeded sampling), a 40-token
    budget so prefill chunks run beside decodes: every request's tokens equal the reference engine's."""
    with plug(student, LAB) as plugged:
        tokens = _run(_workload(**TOKENS_WORKLOAD), **TOKENS_ARGS)
    expect_equal(plugged.uncalled(), [], "the workload: your functions the engine never called")
    expect_equal(tokens, _reference_tokens(), "tiny-llama, 12 requests of 9-13 prompt tokens, 10 output tokens, "
                                              "a quarter seeded sampling, a 40-token budget: each request's tokens")


def _decode_step_counts(num_seqs: int) -> tuple[int, int, list[int]]:
    """(torch calls, host syncs, tokens per request after it) of the third step of `num_seqs` greedy requests
    through the whole engine: a decode step of every sequence."""
    engine = make_engine("tiny-llama", num_gpu_blocks=256, max_num_seqs=64)
    for i in range(num_seqs):
        engine.add_request(f"r{i}", [(3 * i + j) % 400 + 3 for j in range(10 + i % 7)],
                           SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    engine.step()
    engine.step()
    with CountTorchCalls() as counted:
        outputs = engine.step()
    return counted.calls, counted.host_syncs, sorted(len(o.outputs[0].token_ids) for o in outputs if o.error is None)


@pytest.mark.points(2)
@pytest.mark.task("end_to_end")
@pytest.mark.end_to_end
def test_engine_decode_step_cost_does_not_grow_with_the_batch(student):
    """One engine decode step (scheduler, batch, 2 layers, sampling) with your functions: every sequence gets its
    third token, and the step makes as many torch calls and host syncs for 32 sequences as for 8. Any
    per-sequence launch, per-token write or per-request read-back left in the hot loop adds calls for every
    sequence. (No request finishes in these three steps: remove_finished stays out of the plug.)"""
    with plug(student, LAB, only=["write_kv", "attend", "sample", "block_tables"]):
        few, many = _decode_step_counts(8), _decode_step_counts(32)
    expect_equal([few[2], many[2]], [[3] * 8, [3] * 32], "tokens per request after the third step of 8 and of 32 "
                                                       "greedy requests (failed requests left out)")
    expect_equal(many[0] - few[0], 0, "torch calls in one decode step of 32 sequences minus those of 8")
    expect_equal(many[1] - few[1], 0, "host syncs in one decode step of 32 sequences minus those of 8")


SPEED_WORKLOAD = dict(num=48, prompt_len=64, max_tokens=8)
SPEED_ARGS = dict(num_gpu_blocks=2048)  # 4 MiB per K or V tensor and layer: what a copy of it costs shows
PAIRS = 5  # a median of 5 pairs: one pair that straddles a burst of other work cannot move it
# Measured on the loaded 2-core machine (load average 4 to 8, and inside make test with a CPU hog), slow / fixed,
# medians of 5 alternating pairs, in CPU time on one torch thread (CLOCK). Whole runs: every fix 2.4x to 3.1x (the
# engine's own per-step cost, the same in both, is most of a fixed run); the attention left slow 1.2x to 1.65x,
# the KV write 1.7x to 2.1x: too close to a full fix to tell apart. Time inside each function against its slow
# version, every fix: write_kv 22x to 42x, attend 11.7x to 12.1x (sample 2.1x to 2.4x, remove_finished 2.9x to
# 3.4x, block_tables 0.9x to 1.1x: this workload's tables are small); a function left slow: 0.9x to 1.0x. The
# ratio of all five summed, the first design, fell from 6.3x-9.2x to 4.3x for the solution under make test and a
# hog, and rose to 3.6x for a partial fix: one threshold could not separate them. Per function the gap is 10x. So:
# whole runs >= 1.5x (faster overall, nothing finer), write_kv >= 4x and attend >= 2.5x (the two this workload
# times well); the sampler, the block tables and the queue are caught by their own checks above (one host sync,
# 1,024-row tables >= 8x, 1,000-request removal >= 20x) and by the decode-step count. attend's target was 4x
# until two make test runs on 2026-12-02 measured the solution's attend at 3.8x under the suite and a CPU hog
# (15x quiet the same day; write_kv 14x and 24x there): cache contention slows the fixed kernel's scattered reads
# more than the slow version's streaming copies. 2.5x stays far above a slow attend left in place (0.9x-1.0x).
TIMED_HERE = ("write_kv", "attend")
MIN_SPEEDUP = 1.5
MIN_FUNCTION_SPEEDUP = {"write_kv": 4.0, "attend": 2.5}


def _timed(spent: dict[str, float]):
    """wrap(name, fn): fn, adding the seconds spent inside it to spent[name]."""
    def wrap(name, fn):
        @functools.wraps(fn)
        def timed(*args, **kwargs):
            start = CLOCK()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[name] = spent.get(name, 0.0) + CLOCK() - start
        return timed
    return wrap


@pytest.mark.points(4)
@pytest.mark.task("end_to_end")
@pytest.mark.end_to_end
def test_engine_speedup_over_the_slow_engine(student):
    """48 requests (64-68 prompt tokens, 8 output tokens, a quarter seeded top-k/top-p sampling) through tiny-llama,
    with your functions and with the slow engine, in turn (PAIRS alternating pairs after one warm-up each): the same
    tokens; the median of slow time / your time over whole runs at least MIN_SPEEDUP, and over the time spent
    inside write_kv and inside attend, each against its slow version, at least MIN_FUNCTION_SPEEDUP's (the engine's
    own per-step cost, the same in both, left out: a bottleneck left in place shows there)."""
    workload = _workload(**SPEED_WORKLOAD)
    names = ("write_kv", "attend", "sample", "block_tables", "remove_finished")

    def slow():
        spent: dict[str, float] = {}
        with slow_engine(wrap=_timed(spent)):
            start = CLOCK()
            tokens = _run(workload, **SPEED_ARGS)
            return CLOCK() - start, spent, tokens

    def fixed():
        spent: dict[str, float] = {}
        wrap = _timed(spent)
        with plug(student, LAB, overrides={name: wrap(name, getattr(student, name)) for name in names}):
            start = CLOCK()
            tokens = _run(workload, **SPEED_ARGS)
            return CLOCK() - start, spent, tokens
    slow_tokens, fixed_tokens = slow()[2], fixed()[2]
    expect_equal(fixed_tokens, slow_tokens, "48 requests through tiny-llama: your engine's tokens against the slow "
                                            "engine's (the same tokens, only faster)")
    whole, inside = [], {name: [] for name in names}
    with _one_thread():
        for i in range(PAIRS):
            if i % 2 == 0:
                slow_run, fixed_run = slow(), fixed()
            else:
                fixed_run = fixed()
                slow_run = slow()
            whole.append(slow_run[0] / fixed_run[0])
            for name in names:
                inside[name].append(slow_run[1].get(name, 0.0) / max(fixed_run[1].get(name, 0.0), 1e-9))
    ratio = statistics.median(whole)
    per_function = {name: statistics.median(r) for name, r in inside.items()}
    setup = f"48 requests through tiny-llama, median of {PAIRS} alternating pairs"
    expect_equal(ratio >= MIN_SPEEDUP, True, f"{setup}: your engine is {ratio:.2f}x faster than the slow one; the "
                                             f"target is {MIN_SPEEDUP}x")
    expect_equal({name: per_function[name] >= MIN_FUNCTION_SPEEDUP[name] for name in TIMED_HERE},
                 {name: True for name in TIMED_HERE},
                 f"{setup}: time inside each of your functions against its slow version: "
                 + ", ".join(f"{name} {r:.1f}x" for name, r in per_function.items())
                 + "; the targets are " + " and ".join(f"{MIN_FUNCTION_SPEEDUP[n]}x for {n}" for n in TIMED_HERE))


# ---- task 8: the OOM hunt ----------------------------------------------------------------------

LLAMA3_8B = ModelSpec(num_layers=32, hidden_size=4096, num_attention_heads=32, num_kv_heads=8, head_dim=128,
                      intermediate_size=14336, vocab_size=128256)
GIB = 2**30
HELD_AT_START = GIB  # what the device holds before the engine allocates (CUDA context, another process)
L4_BYTES = 24 * GIB


def _free(gpu_bytes: float, util: float, mnbt: int) -> float:
    """Bytes left for the KV cache: lab 01's model (weights and the activation peak inside the budget)."""
    return (gpu_bytes * util - memory.weight_bytes(LLAMA3_8B, "bf16")
            - memory.activation_bytes(LLAMA3_8B, "bf16", mnbt))


def _expected_fixes() -> dict[str, tuple[str, float]]:
    kv = memory.kv_cache_bytes_per_token(LLAMA3_8B, "bf16")
    h100 = GPUS["H100-80GB"].memory_bytes
    act = memory.activation_bytes(LLAMA3_8B, "bf16", 1)
    return {
        "A": ("gpu_memory_utilization", 1 - HELD_AT_START / h100),
        "B": ("max_num_batched_tokens", math.floor((L4_BYTES * 0.9 - memory.weight_bytes(LLAMA3_8B, "bf16")
                                                    - 8192 * kv) / act)),
        "C": ("max_model_len", math.floor(_free(L4_BYTES, 0.9, 8192) / (16 * kv)) * 16),
        "D": ("swap_space", 0.7 * 512 / 8),
    }


@pytest.mark.points(4)
@pytest.mark.task("oom_hunt")
def test_oom_hunt(student):
    """Four configurations of Llama-3-8B in bf16 that run out of memory (the notebook's table), each broken by one
    limit. A: vLLM v1's start-up check: the GPU's free memory must cover utilization x total, so what the device
    already holds (1 GiB here) must fit in (1 - 0.99) x 79.65 GiB = 816 MiB; the largest utilization is
    1 - 1 GiB / 79.65 GiB = 0.98745. (Everything the engine allocates is inside the budget, as in lab 01: NCCL
    buffers, CUDA graphs, and the sampler's logits, which the profile run's dummy sampler pass includes.) B: max_num_batched_tokens 65536 on a 24 GiB GPU at 0.9: its
    activation peak (6.71 GB) leaves 0.42 GB, less than one 8192-token request's KV (1.07 GB); the largest budget
    is (0.9 x 24 GiB - 16.06 GB - 1.07 GB) / 102,400 bytes per token = 59,165 tokens. C: max_model_len 131072 on
    the same GPU with an 8192-token budget: one request needs 17.2 GB of KV, 6.29 GB is free, the longest that
    fits is 48,000 (a multiple of the block size 16), exact: 48,016 is one block more than fits. D: 8 engines with
    swap_space 64 GiB each on a 512 GiB host: the lab's rule keeps all engines' pinned swap under 70% of host memory
    (vLLM checks one engine's, swap_space x its TP size on the node, and does not see the other engines), so 44.8
    GiB each. Names exact; values within 0.5% (A: its headroom within 2%; C exact): rounding of the inputs. A rule
    left out is off by 13% or more: the sampler's logits counted outside the budget in A (+24% of the headroom),
    one request's KV in B (+18%), the activation peak in C (+13%), the 40% warning level in D (-43%)."""
    got = student.oom_fixes()
    expected = _expected_fixes()
    expect_equal(sorted(got), sorted(expected), "oom_fixes(): the configurations answered")
    for name, (limit, value) in expected.items():
        expect_prediction(got[name][0], limit, f"oom_fixes()[{name!r}]: the limit that breaks")
        if name == "A":  # graded on the headroom 1 - utilization: forgetting the logits is 0.3% of the utilization
            expect_prediction(1 - got[name][1], 1 - value, "oom_fixes()['A']: 1 - the largest gpu_memory_utilization "
                         "that fits (the headroom outside the budget, as a fraction of the GPU)", rtol=0.02)
        else:  # C is a count of whole blocks: exact
            expect_prediction(got[name][1], value, f"oom_fixes()[{name!r}]: the largest value of {limit} that fits"
                              + (" (tokens, a multiple of 16)" if name == "C" else ""), rtol=0.0 if name == "C" else 0.005)


# ---- task 9: hardware numbers from memory ------------------------------------------------------

# Datasheet figures, dense (no sparsity), SXM boards; NVLink and PCIe per direction. Sources: NVIDIA A100
# datasheet (80 GB HBM2e, 2,039 GB/s; 40 GB: 1,555 GB/s; 312 TFLOP/s bf16; NVLink3 600 GB/s both directions);
# NVIDIA H100 datasheet (SXM5 80 GB HBM3, 3.35 TB/s; 989 TFLOP/s bf16, 1,979 fp8, dense; NVLink4 900 GB/s both
# directions); NVIDIA H200 datasheet (141 GB HBM3e, 4.8 TB/s); PCI-SIG (Gen4 x16 16 GT/s x 16 lanes, about 32 GB/s
# per direction; Gen5 about 64 GB/s); NVIDIA Quantum-2 (InfiniBand NDR 400 Gb/s = 50 GB/s per port) against
# 100 GbE (12.5 GB/s). Ridge point: peak FLOP/s / HBM bytes/s. engine_core.capacity_planner.GPUS holds the same figures.
HARDWARE = {
    "a100_hbm_bytes": 80e9, "a100_hbm_bytes_per_s": 2.039e12, "h100_hbm_bytes": 80e9,
    "h100_hbm_bytes_per_s": 3.35e12, "h200_hbm_bytes": 141e9, "h200_hbm_bytes_per_s": 4.8e12,
    "nvlink4_bytes_per_s": 450e9, "pcie_gen4_x16_bytes_per_s": 32e9, "pcie_gen5_x16_bytes_per_s": 64e9,
    "infiniband_ndr_bytes_per_s": 50e9, "ethernet_100g_bytes_per_s": 12.5e9,
    "h100_bf16_flops": 989e12, "h100_fp8_flops": 1979e12, "a100_bf16_flops": 312e12,
    "h100_bf16_ridge_flops_per_byte": 989e12 / 3.35e12, "a100_bf16_ridge_flops_per_byte": 312e12 / 2.039e12,
}


@pytest.mark.points(4)
@pytest.mark.task("hardware_quiz")
def test_hardware_numbers(student):
    """Sixteen numbers from memory, each within 10% of the datasheet (80 GB and 80 GiB are both inside; a
    per-direction figure given as both directions, Gb/s for GB/s, sparse FLOP/s or the A100 40 GB's bandwidth
    are not)."""
    got = student.hardware_numbers()
    expect_equal(sorted(got), sorted(HARDWARE), "hardware_numbers(): the keys asked for")
    for key, value in HARDWARE.items():
        expect_prediction(got[key], value, f"hardware_numbers()[{key!r}] (SI units: bytes, bytes/s, FLOP/s)", rtol=0.10)


@pytest.mark.points(2)
@pytest.mark.task("hardware_quiz")
def test_slips_caught(student):
    """Two slips in circulation: "the H100 has 141 GB" (that is the H200; the H100 SXM has 80 GB) and "the A100
    80 GB at 1.5 TB/s" (1.555 TB/s is the A100 40 GB; the 80 GB moves 2.039 TB/s)."""
    got = student.slips()
    expect_prediction(got["gpu_with_141_gb"], "H200", "slips()['gpu_with_141_gb']: the GPU that has 141 GB")
    expect_prediction(got["h100_gb"], 80, "slips()['h100_gb']: the H100 SXM's HBM in GB", rtol=0.10)
    expect_prediction(got["a100_80gb_tb_per_s"], 2.039, "slips()['a100_80gb_tb_per_s']: the A100 80 GB's HBM bandwidth "
                                                   "in TB/s", rtol=0.10)
    expect_prediction(got["a100_gb_at_1_5_tb_per_s"], 40, "slips()['a100_gb_at_1_5_tb_per_s']: the A100 whose HBM moves "
                                                     "about 1.5 TB/s (GB)")


# ---- task 8: MFU ------------------------------------------------------------------------------
# PaLM (Chowdhery et al. 2022), appendix B: model FLOPs per token 6N + 12LHQT for a training step (forward and
# backward); a forward alone is a third of it, 2N + 4LHQT: 2 FLOPs per weight, and QK^T plus PV (2 FLOPs per
# multiply-add each) over the T keys the token attends, for L layers of H query heads of Q dims. N here is
# memory.num_params (every weight, embedding included, as PaLM counts its N).
LLAMA3_8B = ModelSpec(num_layers=32, hidden_size=4096, num_attention_heads=32, num_kv_heads=8, head_dim=128,
                      intermediate_size=14336, vocab_size=128256)


def _flops_per_token(spec: ModelSpec, context: float) -> float:
    """2N + 4 L H Q context: the independent count the learner's mfu is held to."""
    return 2 * memory.num_params(spec) + 4 * spec.num_layers * spec.num_attention_heads * spec.head_dim * context


@pytest.mark.points(2)
@pytest.mark.task("mfu")
def test_mfu_formula(student):
    """Llama-3-8B at 1,000 tokens/s with 2,048 keys per token: (2 x 8.03e9 + 4 x 32 x 32 x 128 x 2048) x 1000 /
    989e12 on an H100 (1.73%), the same over an A100's 312e12 (5.5%) given by name; a context of 0 leaves 2N only,
    and at 32k keys attention is 40% of the FLOPs (a formula without it is off by that much)."""
    for tps, context, gpu in ((1000.0, 2048, "H100-80GB"), (1000.0, 2048, "A100-80GB"), (250.0, 0, "H100-80GB"),
                              (40.0, 32768, "H200-141GB")):
        expect_close(student.mfu(tps, LLAMA3_8B, context, GPUS[gpu]), tps * _flops_per_token(LLAMA3_8B, context)
                     / GPUS[gpu].bf16_flops, f"mfu({tps}, Llama-3-8B, context {context}, GPUS[{gpu!r}])", rtol=1e-6)
    expect_close(student.mfu(1000.0, LLAMA3_8B, 2048, "A100-80GB"),
                 1000.0 * _flops_per_token(LLAMA3_8B, 2048) / GPUS["A100-80GB"].bf16_flops,
                 "mfu(1000, Llama-3-8B, 2048, 'A100-80GB'): the GPU given by its name in GPUS", rtol=1e-6)


MFU_PROMPTS = [[(5 * i + j) % 400 + 3 for j in range(48)] for i in range(4)]
MFU_MAX_TOKENS = 9


def _engine_rates(student) -> tuple[ModelSpec, list[tuple[str, float, float]]]:
    """tiny-llama's ModelSpec, and (phase, tokens/s, mean keys per token) of tiny-llama's prefill steps and decode steps, from the engine's
    own per-step stats (StepInfo: tokens and seconds of each step), with the learner's five functions plugged."""
    with plug(student, LAB):
        engine = make_engine("tiny-llama", num_gpu_blocks=64, max_num_batched_tokens=256)
        for i, prompt in enumerate(MFU_PROMPTS):
            engine.add_request(f"m{i}", prompt, SamplingParams(max_tokens=MFU_MAX_TOKENS, temperature=0.0,
                                                               ignore_eos=True))
        tokens, seconds = {"prefill": 0, "decode": 0}, {"prefill": 0.0, "decode": 0.0}
        while engine.has_unfinished_requests():
            engine.step()
            info = engine.last_step
            phase = "prefill" if info.num_prefill_tokens else "decode"
            tokens[phase] += info.num_prefill_tokens + info.num_decode_tokens
            seconds[phase] += info.duration_s
    prompt = len(MFU_PROMPTS[0])
    return engine.model_config.args.model_spec(), [("prefill", tokens["prefill"] / seconds["prefill"], (prompt + 1) / 2),
            ("decode", tokens["decode"] / seconds["decode"], prompt + MFU_MAX_TOKENS / 2)]


@pytest.mark.points(2)
@pytest.mark.task("mfu")
def test_mfu_on_the_engine_stats(student):
    """tiny-llama's own prefill and decode rates (4 prompts of 48 tokens, 9 tokens each, the engine's per-step
    stats) through mfu on an H100: MFU x peak / rate is the FLOPs per token, 2N + 4LHQ x context, whatever the
    rate this machine measured (so the check does not depend on the machine's load)."""
    spec, rates = _engine_rates(student)
    for phase, tps, context in rates:
        got = student.mfu(tps, spec, context, GPUS["H100-80GB"])
        expect_close(got * GPUS["H100-80GB"].bf16_flops / tps, _flops_per_token(spec, context),
                     f"tiny-llama's measured {phase} rate: mfu(rate, spec, context, H100) x 989e12 / rate, the "
                     f"FLOPs per {phase} token", rtol=1e-6)


@pytest.mark.points(2)
@pytest.mark.task("mfu")
def test_predicted_decode_mfu(student):
    """Llama-3-8B bf16 decoding on an H100 at 1,024 keys per request, at the memory roofline (weights and every
    request's KV read once per step at 3.35 TB/s): batch 1 reads 16.2 GB per step (4.83 ms, 207 tokens/s, MFU
    0.35%); batch 64 reads 24.7 GB (7.36 ms, 8,698 tokens/s, 14.6%). Within 5%: bf16 bytes, the KV formula and
    the attention FLOPs all matter at that tolerance (a KV left out is 2x off at batch 64)."""
    def at(batch: int) -> float:
        kv = memory.kv_cache_bytes_per_token(LLAMA3_8B, "bf16")
        step_s = (memory.weight_bytes(LLAMA3_8B, "bf16") + batch * 1024 * kv) / GPUS["H100-80GB"].hbm_bytes_per_s
        return batch / step_s * _flops_per_token(LLAMA3_8B, 1024) / GPUS["H100-80GB"].bf16_flops
    got = tuple(student.predicted_decode_mfu())
    expect_prediction(got[0], at(1), "predicted_decode_mfu()[0]: MFU of one request decoding, Llama-3-8B bf16, "
                                     "H100, 1,024 keys", rtol=0.05)
    expect_prediction(got[1], at(64), "predicted_decode_mfu()[1]: MFU of 64 requests decoding, Llama-3-8B bf16, "
                                      "H100, 1,024 keys each", rtol=0.05)


# ---- task 9: the call stack ---------------------------------------------------------------------
# The grader records the call path of one request with sys.setprofile on the engine itself, with the slow
# engine's variants at this lab's five seams (so the recording does not depend on the learner's fixes: it runs
# the same in the batch kit, where the seams' own bodies are removed): every call of a function defined under
# engine_core/ or kernels/, a seam recorded under the engine's name (`AttentionPlan.attend`), and inside a seam
# only the kernels it launches.
CALL_ROOTS = ("engine_core", "kernels")
KEY_LAYERS = {  # layer -> the names that stand for it
    "the entry point": ("LLM.generate",),
    "the engine's step": ("LLMEngine.step",),
    "the scheduler": ("Scheduler.schedule",),
    "the model runner": ("ModelRunner.execute_model",),
    "the model's forward": ("LlamaForCausalLM.forward",),
    "the attention layer": ("AttentionPlan.attend",),
    "the attention kernel": ("paged_attention", "paged_attention_decode"),
}
PATH_OK = "a path the engine runs, every layer named"


@functools.cache
def _recorded_call_path() -> tuple[str, ...]:
    """Every call, in order, of one greedy request of 6 prompt tokens asking for one token (one step, a prefill)
    through LLM.generate."""
    seam_names = _seam_codes()
    llm = LLM("tiny-llama", device="cpu", num_gpu_blocks=64)
    path: list[str] = []
    inside: list[object] = []  # the seam frames open now

    def record(frame, event, arg) -> None:
        code = frame.f_code
        if event == "return":
            if inside and frame is inside[-1]:
                inside.pop()
            return
        if event != "call":
            return
        if code in seam_names:
            path.append(seam_names[code])
            inside.append(frame)
            return
        parts = Path(code.co_filename).parts
        if not any(root in parts for root in CALL_ROOTS) or "<" in code.co_qualname:
            return
        if inside and "kernels" not in parts:
            return
        path.append(code.co_qualname)

    with slow_engine():
        sys.setprofile(record)
        try:
            llm.generate([[5, 6, 7, 8, 9, 10]], SamplingParams(max_tokens=1, temperature=0.0), use_tqdm=False)
        finally:
            sys.setprofile(None)
    return tuple(path)


def _seam_codes() -> dict:
    """The slow variants' code objects -> the engine's names of their seams (`Class.attr`)."""
    return {SLOW_VARIANTS[s.student_name].__code__: f"{s.owner.rsplit('.', 1)[-1]}.{s.attr}" for s in seams_of(LAB)}


def _path_verdict(names: object) -> str:
    """PATH_OK, or the first thing wrong with `names` against the recorded path."""
    if not isinstance(names, (list, tuple)) or not names or not all(isinstance(n, str) for n in names):
        return "not a non-empty list of function names"
    recorded, at = _recorded_call_path(), 0
    for i, name in enumerate(names):
        if name not in recorded:
            return f"{name!r} is not called for this request"
        try:
            at = recorded.index(name, at) + 1
        except ValueError:
            return f"{name!r} is never called after {names[i - 1]!r}"
    missing = [layer for layer, accepted in KEY_LAYERS.items() if not set(accepted) & set(names)]
    return f"missing: {', '.join(missing)}" if missing else PATH_OK


@pytest.mark.points(3)
@pytest.mark.task("call_stack")
def test_call_path_is_the_engines(student):
    """The learner's list, in order, is a subsequence of the call path recorded with sys.setprofile for one request
    through LLM.generate, and names the entry point, the step, the scheduler, the runner, the model's forward, the
    attention layer and its kernel. Order and membership only: any correct depth of detail passes."""
    expect_equal(_path_verdict(student.call_path()), PATH_OK,
                 "call_path() against the path recorded for one request (6 prompt tokens, one output token)")


VLLM_NAMES = {"LLM.generate": "LLM", "LLMEngine.add_request": "LLMEngine", "LLMEngine.step": "EngineCore",
              "Scheduler.schedule": "Scheduler", "ModelRunner.execute_model": "GPUModelRunner",
              "AttentionPlan.attend": "FlashAttentionImpl"}


@pytest.mark.points(2)
@pytest.mark.task("call_stack")
def test_vllm_names(student):
    """vLLM v1's class for each step of the path: LLM; LLMEngine.add_request (the processor, then the engine-core
    client); EngineCore.step does schedule / execute / update (LLMEngine.step only collects outputs from the
    client); Scheduler; GPUModelRunner (under a Worker); FlashAttentionImpl.forward, the default backend's."""
    expect_equal(student.vllm_names(), VLLM_NAMES, "vllm_names(): the vLLM v1 class of each of the kit's functions")


# ---- task 10: TensorRT-LLM against vLLM, and the price of static shapes -------------------------
# Checked against the projects' docs: TensorRT-LLM's overview and key-features pages (in-flight batching, paged
# KV cache, speculative decoding, multi-LoRA, FP8, CUDA graphs) and its legacy TensorRT workflow (`trtllm-build`
# compiles an engine for fixed max_batch_size / max_num_tokens / max_seq_len before serving); vLLM's docs (paged
# attention, continuous batching, speculative decoding, multi-LoRA, FP8, CUDA graphs unless enforce_eager; no
# build step: the checkpoint loads at start-up).
FEATURES = {"paged_kv": (True, True), "in_flight_batching": (True, True), "speculative_decoding": (True, True),
            "lora": (True, True), "fp8": (True, True), "cuda_graphs": (True, True),
            "ahead_of_time_build": (True, False)}


@pytest.mark.points(2)
@pytest.mark.task("trtllm_vs_vllm")
def test_feature_table(student):
    """(TensorRT-LLM, vLLM) for each feature: both batch in flight over a paged KV cache, speculate, serve LoRA and
    FP8 and replay CUDA graphs; only TensorRT-LLM's TensorRT backend compiles an engine ahead of time."""
    got = {k: tuple(v) for k, v in student.feature_table().items()}
    expect_equal(got, FEATURES, "feature_table(): {feature: (TensorRT-LLM has it, vLLM has it)}")


PAD_REQUESTS, PAD_MAX_NUM_SEQS = 40, 48


def _decode_batches() -> list[int]:
    """Rows of each decode-only step of the padding workload on the engine (the slow engine's variants at the
    seams: the schedule is the scheduler's, whatever fills the seams): 40 requests of 8 prompt tokens arriving
    together, request i asking for i + 1 tokens, max_num_seqs 48."""
    engine = make_engine("tiny-llama", num_gpu_blocks=128, max_num_seqs=PAD_MAX_NUM_SEQS, max_num_batched_tokens=512)
    for i in range(PAD_REQUESTS):
        engine.add_request(f"p{i}", [(3 * i + j) % 400 + 3 for j in range(8)],
                           SamplingParams(max_tokens=i + 1, temperature=0.0, ignore_eos=True))
    rows = []
    with slow_engine():
        while engine.has_unfinished_requests():
            engine.step()
            if engine.last_step.num_prefill_tokens == 0 and engine.last_step.num_decode_tokens:
                rows.append(engine.last_step.num_seqs)
    return rows


def _padding(rows: list[int], max_num_seqs: int) -> int:
    """Rows added when each batch of n rows runs the smallest captured size >= n: 1, 2, 4, 8, then multiples of 16,
    and max_num_seqs itself (engine_core/worker/cuda_graphs.py, written out here)."""
    sizes = [s for s in (1, 2, 4, 8) if s < max_num_seqs] + list(range(16, max_num_seqs, 16)) + [max_num_seqs]
    return sum(next(s for s in sizes if s >= n) - n for n in rows)


@pytest.mark.points(2)
@pytest.mark.task("trtllm_vs_vllm")
def test_padding_of_the_measured_schedule(student):
    """The decode batches the engine ran on the padding workload (39 rows down to 1), padded to the captured
    sizes (1, 2, 4, 8, multiples of 16, max_num_seqs): padded_decode_rows counts the rows computed for nothing, on
    that schedule and on three cases at the buckets' edges."""
    rows = _decode_batches()
    expect_equal(student.padded_decode_rows(rows, PAD_MAX_NUM_SEQS), _padding(rows, PAD_MAX_NUM_SEQS),
                 "padded_decode_rows(the engine's decode batches of the padding workload, 48)")
    for case, max_seqs in (([1, 2, 3, 8, 9], 64), ([16, 17, 33], 40), ([40, 39], 40)):
        expect_equal(student.padded_decode_rows(case, max_seqs), _padding(case, max_seqs),
                     f"padded_decode_rows({case}, {max_seqs})")


@pytest.mark.points(1)
@pytest.mark.task("trtllm_vs_vllm")
def test_predicted_padding(student):
    """The padding workload, predicted before the run: decode steps of 39, 38, ..., 1 rows (780 rows of work);
    padded to the buckets of max_num_seqs 48 they cost 1 + 6 + 28 + 120 + 84 = 239 rows more. Exact."""
    rows = list(range(PAD_REQUESTS - 1, 0, -1))
    expect_prediction(tuple(student.predicted_padding()), (sum(rows), _padding(rows, PAD_MAX_NUM_SEQS)),
                      "predicted_padding(): (decode rows the engine computes, padding rows a graph adds), 40 "
                      "requests asking for 1..40 tokens, max_num_seqs 48")


# ---- task 11: TTFT from the prefill rate ---------------------------------------------------------
TTFT_PROMPTS = [64, 128, 96, 160]


def _ttft_run(student) -> tuple[float, dict[str, float]]:
    """Your engine (your five functions plugged) serving 4 prompts one at a time (max_num_seqs 1, one token each):
    the prefill rate from its per-step stats, and each request's TTFT from its metrics."""
    with plug(student, LAB):
        engine = make_engine("tiny-llama", num_gpu_blocks=128, max_num_seqs=1, max_num_batched_tokens=256)
        for i, n in enumerate(TTFT_PROMPTS):
            engine.add_request(f"t{i}", [(11 * i + j) % 400 + 3 for j in range(n)],
                               SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
        tokens, seconds, ttft = 0, 0.0, {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                ttft[out.request_id] = out.metrics.ttft
            tokens += engine.last_step.num_prefill_tokens
            seconds += engine.last_step.duration_s
    return tokens / seconds, ttft


@pytest.mark.points(3)
@pytest.mark.task("ttft")
@pytest.mark.end_to_end
def test_ttft_against_the_prefill_rate(student):
    """The last request's measured TTFT over predicted_ttft_s(prompt lens, 3, the measured prefill rate): near 1.
    Tolerance: within 0.5 of 1. Rate and TTFT come from the same steps (the last request waits for all of them),
    so a loaded machine moves both together; measured on a loaded 2-core machine the ratio stayed within 1.00-1.02.
    An earlier request's ratio is not observed: it spans one or two steps of a few milliseconds, and a burst of
    other work moved it from 0.7 to 3.9 there. A prediction without the queue ahead (160 tokens for 448) is 2.8x
    off; milliseconds for seconds 1000x. Then the prediction for every request at 1,000 tokens/s: 64, 192, 288 and
    448 ms (the queue ahead of each, its own prompt included), within 1e-6."""
    rate, ttft = _ttft_run(student)
    last = len(TTFT_PROMPTS) - 1
    expect_close(ttft[f"t{last}"] / student.predicted_ttft_s(TTFT_PROMPTS, last, rate), 1.0,
                 f"the last request's measured TTFT / predicted_ttft_s({TTFT_PROMPTS}, {last}, measured rate)",
                 rtol=0.5)
    expect_close([student.predicted_ttft_s(TTFT_PROMPTS, i, 1000.0) for i in range(len(TTFT_PROMPTS))],
                  [sum(TTFT_PROMPTS[:i + 1]) / 1000.0 for i in range(len(TTFT_PROMPTS))],
                  f"predicted_ttft_s({TTFT_PROMPTS}, i, 1000.0) for i = 0..3", rtol=1e-6)
