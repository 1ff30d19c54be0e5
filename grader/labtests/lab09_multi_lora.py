"""Official tests of lab 09_multi_lora: serving many LoRA adapters on one base model, unmerged and batched.

The learner writes three engine pieces as plain functions (the seams in grader/seams.py):
`add_lora(y, x, stack, m)` of `engine_core.models.lora` (the mixed-batch delta in PyTorch: rows
mapped one by one as BGMV does, segments as SGMV does, the slices of a fused projection, the
scaling), `LoRASlotPool.assign(self, needed, pinned)` (the GPU slot pool: LRU with pinning; a
contract-only task) and `Scheduler._lora_slot_available(self, request, running_loras)` (the slot
rule), a Triton BGMV shrink kernel with its launcher (not a seam: called directly, under the
interpreter on CPU, its launches counted), plus three numeric predictions. Every test that runs the learner's code does it inside
`plug(student, LAB)`; set-up is written directly (slot weights, pool state, scheduler queues).
Expected values come from a float64 oracle written here, from a small model of the slot pool's
contract (`_spec_assign`), from hand arithmetic in the docstrings, or from the reference engine
and Hugging Face + PEFT run in `functools.cache` helpers after the plug block. Every check is an
`expect_*` observation.
"""
import functools
import os
from collections import OrderedDict

import pytest
import torch
from hypothesis import given, seed
from hypothesis import strategies as st

from grader.harness import (CountLaunches, CountTorchCalls, FakeRunner, LoRAMapping, LoRARequest, LoRASlotPool, LoRAStack, SamplingParams,
                            adapter_path, lab_settings, make_engine, make_request, make_scheduler, preset_path, reference_output)
from grader.observe import expect_close, expect_equal, expect_prediction, expect_raises
from grader.plug import plug

if not torch.cuda.is_available():  # the learner's Triton kernel runs under the interpreter, chosen before triton loads
    os.environ.setdefault("TRITON_INTERPRET", "1")

LAB = "09_multi_lora"
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")

# ---- task 1: the predictions -------------------------------------------------------------------

# Llama-3-8B: hidden 4096, 32 query heads and 8 KV heads of 128, MLP 14336, 32 layers, bf16.
# Per layer, rank 16, every projection: 16 * ((4096 + 4096) [q] + 2 * (4096 + 1024) [k, v] + (4096 + 4096) [o]
# + 3 * (4096 + 14336) [gate, up, down]) = 16 * 81920 = 1,310,720 parameters; x 32 layers x 2 bytes.
LLAMA3_8B_RANK16_BYTES = 16 * 81920 * 32 * 2  # 83,886,080 bytes = 80 MiB
# H100 SXM (engine_core.capacity_planner.GPUS): HBM3 3.35 TB/s, PCIe Gen5 x16 64 GB/s per direction; Llama-3-8B's
# 8,030,261,248 parameters in bf16 (lab 01).
PCIE_BYTES_PER_S, HBM_BYTES_PER_S, LLAMA3_8B_WEIGHT_BYTES = 64e9, 3.35e12, 16_060_522_496


@pytest.mark.points(1)
@pytest.mark.task("predictions")
def test_predicted_adapter_bytes(student):
    """Bytes of a rank-16 adapter on all seven projections of Llama-3-8B in bf16: 83,886,080 (80 MiB).

    Tolerance 0.5%: the answer is exact arithmetic, so this only admits rounding of intermediate
    values, and it rejects every slip worth catching: the smallest module left out (k_proj or v_proj
    is 6.25% of the total), MHA instead of GQA for k/v (+12.5%), MB for MiB (4.9%), fp32 (x2)."""
    expect_prediction(student.predicted_adapter_bytes(), LLAMA3_8B_RANK16_BYTES,
                 "predicted_adapter_bytes(): a rank-16 LoRA on q, k, v, o, gate, up, down of Llama-3-8B, bf16",
                 rtol=0.005)


@pytest.mark.points(1)
@pytest.mark.task("predictions")
def test_predicted_load_vs_decode_step(student):
    """Loading that adapter from host memory over PCIe Gen5 (64 GB/s) takes ~0.27 of one memory-bound
    decode step of Llama-3-8B on an H100 (16.06 GB of weights at 3.35 TB/s = 4.79 ms; 83.9 MB at
    64 GB/s = 1.31 ms).

    Tolerance 3%: admits rounding the given figures (16 GB for 16.06 GB is 0.4%, 3.35 TB/s as 3.3 is
    1.5%); rejects 80 MB for 80 MiB (4.9%), bits for bytes (x8), PCIe Gen4's 32 GB/s (x2), fp32
    weights (x0.5) or the adapter in fp32 (x2)."""
    expect_prediction(student.predicted_load_vs_decode_step(),
                 (LLAMA3_8B_RANK16_BYTES / PCIE_BYTES_PER_S) / (LLAMA3_8B_WEIGHT_BYTES / HBM_BYTES_PER_S),
                 "predicted_load_vs_decode_step(): (the rank-16 adapter's copy over PCIe Gen5 at 64 GB/s) / (one "
                 "decode step's read of Llama-3-8B's bf16 weights at 3.35 TB/s) on an H100", rtol=0.03)


@pytest.mark.points(1)
@pytest.mark.task("predictions")
def test_predicted_engine_steps(student):
    """The experiment's deterministic measure: 4 adapters x 4 requests, 8-token prompts, 8 output
    tokens each (greedy, ignore_eos), a 256-token budget and max_loras=4. Unmerged and batched, all 16
    requests prefill together in step 1 (128 tokens, each emits its first token), then 7 decode steps:
    8 steps. Merged one adapter at a time, each adapter's 4 requests take the same 8 steps, in turn:
    32. Exact: these are counts the scheduler determines, not timings."""
    expect_prediction(tuple(student.predicted_engine_steps()), (8, 32),
                 "predicted_engine_steps(): (steps unmerged and batched, steps merged one adapter at a time)")


# ---- task 2: add_lora ------------------------------------------------------------------------

# fp32 slot weights and inputs of size ~1, K <= 24: the learner's fp32 (or fp64) sums differ from
# the float64 oracle by a few fp32 ulps of values below ~50, far under 1e-4; every planted bug is
# off by more than 1e-2.
ATOL = 1e-4


def _stack(num_slots, max_rank, in_features, slice_outs, ranks, scalings, seed=0):
    """Slot weights with adapter s of rank ranks[s] (0: an empty slot) padded to max_rank, as the engine
    loads them: random A [r, in], B [out_j, r] per slice."""
    gen = torch.Generator().manual_seed(seed)
    scaling = torch.tensor(scalings, dtype=torch.float32)
    stack = LoRAStack.empty(num_slots, max_rank, in_features, list(slice_outs), scaling, torch.float32,
                            torch.device("cpu"))
    for s, r in enumerate(ranks):
        if r:
            stack.write(s, [(torch.randn(r, in_features, generator=gen), torch.randn(out, r, generator=gen))
                            for out in slice_outs])
    return stack


def _mapping(row_slots, segments):
    """Rows mapped one by one (`row_slots`, the batch's first rows), then segments [(length, slot)]."""
    starts = [0]
    for n, _ in segments:
        starts.append(starts[-1] + n)
    longest = max((n for n, _ in segments), default=0)
    return LoRAMapping(torch.tensor(row_slots, dtype=torch.int32), torch.tensor(starts, dtype=torch.int32),
                       torch.tensor([s for _, s in segments], dtype=torch.int32), longest, "torch")


def _rows(row_slots, segments):
    return list(row_slots) + [s for n, s in segments for _ in range(n)]


def _inputs(stack, num_rows, seed=1):
    gen = torch.Generator().manual_seed(seed)
    out = sum(b.shape[1] for b in stack.b)
    return torch.randn(num_rows, stack.a.shape[2], generator=gen), torch.randn(num_rows, out, generator=gen)


def _oracle(y0, x, stack, slots):
    """float64, row by row: y[i] += scaling[s] * x[i] @ A_s.T @ B_s.T, slice by slice (A's rank rows
    j*max_rank.. for slice j) for every row whose slot s >= 0."""
    y = y0.double().clone()
    r, col = stack.max_rank, 0
    for j, b in enumerate(stack.b):
        for i, s in enumerate(slots):
            if s >= 0:
                a = stack.a[s, j * r:(j + 1) * r].double()
                y[i, col:col + b.shape[1]] += float(stack.scaling[s]) * (b[s].double() @ (a @ x[i].double()))
        col += b.shape[1]
    return y


def _add(student, y, x, stack, m):
    with plug(student, LAB, only=["add_lora"]):
        student.add_lora(y, x, stack, m)
    return y


@pytest.mark.points(1)
@pytest.mark.task("add_lora")
def test_add_lora_by_hand(student):
    """One row, one slice, rank 2: x = [1, 2], A = I, B = [[1, 1]], scaling 0.5 gives a delta of
    0.5 * (1 + 2) = 1.5 on y = [10]. A row with slot -1 is left alone."""
    stack = LoRAStack.empty(1, 2, 2, [1], torch.tensor([0.5]), torch.float32, torch.device("cpu"))
    stack.write(0, [(torch.eye(2), torch.tensor([[1.0, 1.0]]))])
    y = torch.tensor([[10.0], [10.0]])
    _add(student, y, torch.tensor([[1.0, 2.0], [1.0, 2.0]]), stack, _mapping([0, -1], []))
    expect_close(y, [[11.5], [10.0]], "x = [[1, 2], [1, 2]], A = I (rank 2), B = [[1, 1]], scaling 0.5, y = [[10], [10]], "
                 "rows mapped one by one to slots [0, -1]: y after add_lora", atol=ATOL)


@pytest.mark.points(2)
@pytest.mark.task("add_lora")
def test_add_lora_decode_rows(student):
    """Decode rows (BGMV): every row has its own slot, in any order, -1 for the base model; ranks
    below max_rank are zero-padded."""
    stack = _stack(3, 4, 6, [5], ranks=[4, 2, 3], scalings=[0.5, 2.0, 1.25])
    slots = [2, 0, -1, 0, 1, 2]
    x, y0 = _inputs(stack, len(slots))
    got = _add(student, y0.clone(), x, stack, _mapping(slots, []))
    expect_close(got, _oracle(y0, x, stack, slots),
                 "3 slots (ranks 4, 2, 3 padded to 4; scaling 0.5, 2, 1.25), in 6 -> out 5, six decode rows with "
                 "row_slots [2, 0, -1, 0, 1, 2] and no segment: y after add_lora", atol=ATOL)


@pytest.mark.points(2)
@pytest.mark.task("add_lora")
def test_add_lora_prefill_segments(student):
    """Prefill chunks (SGMV): segments of consecutive rows share a slot; the segment rows come after the
    decode rows; an empty segment and a segment of slot -1 add nothing."""
    stack = _stack(2, 4, 6, [5], ranks=[3, 4], scalings=[1.5, 0.25])
    row_slots, segments = [1], [(3, 0), (0, 1), (2, -1), (4, 1)]
    x, y0 = _inputs(stack, 10, seed=2)
    got = _add(student, y0.clone(), x, stack, _mapping(row_slots, segments))
    expect_close(got, _oracle(y0, x, stack, _rows(row_slots, segments)),
                 "2 slots (ranks 3, 4; scaling 1.5, 0.25), one decode row (slot 1), then segments (length, slot) "
                 "[(3, 0), (0, 1), (2, -1), (4, 1)]: y after add_lora", atol=ATOL)


@pytest.mark.points(2)
@pytest.mark.task("add_lora")
def test_add_lora_fused_slices(student):
    """A fused projection (q|k|v): A stacks the slices' ranks (slice j uses A's rows j*max_rank ..
    (j+1)*max_rank), each slice has its own B and adds into its own columns of y; a module the
    adapter does not target is zero in its slot."""
    stack = _stack(2, 4, 8, [6, 2, 2], ranks=[4, 2], scalings=[2.0, 0.5], seed=3)
    stack.a[1, 4:8].zero_()  # adapter 1 does not target k_proj
    stack.b[1][1].zero_()
    row_slots, segments = [0, -1, 1], [(2, 1), (3, 0)]
    x, y0 = _inputs(stack, 8, seed=4)
    got = _add(student, y0.clone(), x, stack, _mapping(row_slots, segments))
    expect_close(got, _oracle(y0, x, stack, _rows(row_slots, segments)),
                 "q|k|v fused: in 8 -> out 6 | 2 | 2, max_rank 4, adapter 0 rank 4 on q, k, v, adapter 1 rank 2 on "
                 "q and v only; decode rows [0, -1, 1], segments [(2, 1), (3, 0)]: y after add_lora", atol=ATOL)


@pytest.mark.points(2)
@pytest.mark.task("add_lora")
def test_add_lora_equals_merged_weights(student):
    """Unmerged equals merged: x @ W.T followed by add_lora gives, on each row, x @ (W + scaling_s B_s A_s).T:
    the adapter's weights merged into the base weights (what serving one adapter merged computes)."""
    stack = _stack(3, 8, 12, [10], ranks=[8, 4, 6], scalings=[2.0, 1.0, 0.75], seed=5)
    gen = torch.Generator().manual_seed(6)
    w = torch.randn(10, 12, generator=gen) / 3
    slots = [1, 2, 0, -1]
    x = torch.randn(4, 12, generator=gen)
    got = _add(student, x @ w.T, x, stack, _mapping(slots, []))
    expect_close(got, _merged(x, w, stack, slots),
                 "base W [10, 12], 3 adapters (ranks 8, 4, 6; scaling 2, 1, 0.75), rows with slots [1, 2, 0, -1]: "
                 "x @ W.T plus add_lora, against x @ (W + scaling * B @ A).T with each row's adapter merged", atol=ATOL)


@pytest.mark.points(1)
@pytest.mark.task("add_lora")
def test_add_lora_no_python_loop_over_rows(student):
    """Rows grouped by slot, not one matmul per row: add_lora makes as many torch calls (functions, tensor methods,
    operators, indexing: grader.harness.CountTorchCalls) for 45 decode rows and segments of 30 and 20 rows as for
    3 decode rows and segments of 3 and 2, over the same slots. A loop over the rows gives the same values and
    thousands of tiny matmuls per step on a GPU."""
    stack = _stack(2, 4, 6, [5, 3], ranks=[4, 3], scalings=[0.5, 2.0], seed=7)
    few_rows, few_segments = [0, 1, -1], [(3, 0), (2, 1)]
    many_rows, many_segments = [0, 1, -1] * 15, [(30, 0), (20, 1)]
    x_few, y_few = _inputs(stack, len(_rows(few_rows, few_segments)), seed=8)
    x, y0 = _inputs(stack, len(_rows(many_rows, many_segments)), seed=9)
    y = y0.clone()
    with plug(student, LAB, only=["add_lora"]):
        with CountTorchCalls() as few:
            student.add_lora(y_few, x_few, stack, _mapping(few_rows, few_segments))
        with CountTorchCalls() as many:
            student.add_lora(y, x, stack, _mapping(many_rows, many_segments))
    expect_equal(many.calls - few.calls, 0,
                 "torch calls of add_lora on decode rows [0, 1, -1] x 15 and segments (length, slot) [(30, 0), (20, 1)] "
                 "minus those on decode rows [0, 1, -1] and segments [(3, 0), (2, 1)]: more rows must not mean more calls")
    expect_close(y, _oracle(y0, x, stack, _rows(many_rows, many_segments)),
                 "2 slots (ranks 4, 3; scaling 0.5, 2), in 6 -> slices [5, 3], decode rows [0, 1, -1] x 15, segments "
                 "[(30, 0), (20, 1)]: y after add_lora", atol=ATOL)


def _merged(x, w, stack, slots):
    out = []
    for i, s in enumerate(slots):
        merged = w.double() if s < 0 else w.double() + float(stack.scaling[s]) * stack.b[0][s].double() @ stack.a[s].double()
        out.append(merged @ x[i].double())
    return torch.stack(out)


@pytest.mark.points(2)
@pytest.mark.task("add_lora")
@lab_settings(25)
@seed(20240909)  # the same examples in the reference run and in the kit (derandomize would hash the source)
@given(num_slots=st.integers(1, 4), slices=st.lists(st.integers(1, 5), min_size=1, max_size=3),
       row_slots=st.lists(st.integers(-1, 3), max_size=6),
       segments=st.lists(st.tuples(st.integers(0, 5), st.integers(-1, 3)), max_size=4), data_seed=st.integers(0, 99))
def test_add_lora_mixed_batches(student, num_slots, slices, row_slots, segments, data_seed):
    """Any mix of decode rows and prefill segments over any slots equals the per-row loop (the oracle)."""
    row_slots = [s % (num_slots + 1) - 1 for s in row_slots]  # -1 .. num_slots - 1
    segments = [(n, s % (num_slots + 1) - 1) for n, s in segments]
    ranks = [(data_seed + s) % 4 + 1 for s in range(num_slots)]
    stack = _stack(num_slots, 4, 5, slices, ranks, [0.5 + s for s in range(num_slots)], seed=data_seed)
    x, y0 = _inputs(stack, len(_rows(row_slots, segments)), seed=data_seed + 1)
    got = _add(student, y0.clone(), x, stack, _mapping(row_slots, segments))
    expect_close(got, _oracle(y0, x, stack, _rows(row_slots, segments)),
                 f"{num_slots} slots of ranks {ranks} (max_rank 4), in 5 -> slices {slices}, decode rows "
                 f"{row_slots}, segments (length, slot) {segments}: y after add_lora", atol=ATOL)


# ---- task 3: the decode rows' shrink in Triton (BGMV) ---------------------------------------------

def _run_bgmv_shrink(student, x, lora_a, row_slots):
    """The learner's launcher, counting launches of their `bgmv_shrink_kernel`; (output, launches). No
    seam of the lab is plugged (the kernel is not one): the launch count shows the learner's kernel ran."""
    launcher, kernel = student.bgmv_shrink, student.bgmv_shrink_kernel
    counter = CountLaunches(kernel)
    launcher.__globals__["bgmv_shrink_kernel"] = counter  # the name the launcher resolves at call time
    try:
        out = launcher(x, lora_a, row_slots)
    finally:
        launcher.__globals__["bgmv_shrink_kernel"] = kernel
    return out, counter.launches


def _shrink_oracle(x, lora_a, slots):
    """float64: t[i] = x[i] @ A[s].T, zeros for slot -1."""
    t = torch.zeros(len(slots), lora_a.shape[1], dtype=torch.float64)
    for i, s in enumerate(slots):
        if s >= 0:
            t[i] = lora_a[s].cpu().double() @ x[i].cpu().double()
    return t


def _shrink_case(num_slots, rank, k, slots, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(len(slots), k, generator=gen).to(dtype)
    lora_a = torch.randn(num_slots, rank, k, generator=gen).to(dtype)
    return x.to(DEVICE), lora_a.to(DEVICE), torch.tensor(slots, dtype=torch.int32, device=DEVICE)


# fp32 / fp16 inputs accumulated in fp32 over K <= 100 terms of size ~1: errors are a few fp32 ulps
# of sums below ~30 (fp16 inputs are exact in fp32), far under 1e-3; a wrong slot or row is off by ~1.
SHRINK_ATOL = 1e-3


@pytest.mark.points(2)
@pytest.mark.task("bgmv_shrink")
@pytest.mark.triton
def test_bgmv_shrink_matches_the_oracle(student):
    """Decode rows, each with its own slot in any order, -1 rows all zeros, a rank below the
    16-wide tile, K not a multiple of the K tile; fp32 then fp16 inputs, the output float32. Then a rank of
    24, above 16, every column non-zero: BLOCK_R follows the rank (32 here), never a fixed 16."""
    for dtype in (torch.float32, torch.float16):
        x, lora_a, row_slots = _shrink_case(3, 5, 70, [2, -1, 0, 0, 1, -1, 2], dtype, seed=7)
        out, _ = _run_bgmv_shrink(student, x, lora_a, row_slots)
        expect_equal((tuple(out.shape), str(out.dtype)), ((7, 5), "torch.float32"),
                     f"bgmv_shrink on 7 rows, A [3 slots, rank 5, K 70] in {dtype}: (shape, dtype) of the output")
        expect_close(out, _shrink_oracle(x, lora_a, [2, -1, 0, 0, 1, -1, 2]),
                     f"bgmv_shrink, A [3 slots, rank 5, K 70] in {dtype}, row_slots [2, -1, 0, 0, 1, -1, 2]: "
                     f"t[i] = x[i] @ A[slot].T, zeros for slot -1", atol=SHRINK_ATOL)
    x, lora_a, row_slots = _shrink_case(2, 24, 40, [1, 0, -1, 1], torch.float32, seed=9)
    out, _ = _run_bgmv_shrink(student, x, lora_a, row_slots)
    expect_close(out, _shrink_oracle(x, lora_a, [1, 0, -1, 1]),
                 "bgmv_shrink, A [2 slots, rank 24, K 40] in fp32 (no zero padding: columns 16-23 count), row_slots "
                 "[1, 0, -1, 1]: the output [4, 24]", atol=SHRINK_ATOL)


@pytest.mark.points(1)
@pytest.mark.task("bgmv_shrink")
@pytest.mark.triton
def test_bgmv_shrink_one_launch_for_the_batch(student):
    """Every row of the step, whatever its adapter, in one launch of your kernel (Punica's point: no
    loop over adapters on the host); a rank-16 adapter padded to max_rank 32; no row, no work."""
    x, lora_a, row_slots = _shrink_case(4, 32, 24, [3, 1, 3, 0, 2], torch.float32, seed=8)
    lora_a[:, 16:] = 0.0  # rank 16 in slots of max_rank 32 (zero padding, as the engine loads it)
    out, launches = _run_bgmv_shrink(student, x, lora_a, row_slots)
    expect_equal(launches, 1, "bgmv_shrink on 5 rows of 4 distinct adapters: launches of bgmv_shrink_kernel")
    expect_close(out, _shrink_oracle(x, lora_a, [3, 1, 3, 0, 2]),
                 "A [4 slots, max_rank 32 (rank 16 used), K 24], row_slots [3, 1, 3, 0, 2]: the output", atol=SHRINK_ATOL)
    out, _ = _run_bgmv_shrink(student, x[:0], lora_a, row_slots[:0])
    expect_equal(tuple(out.shape), (0, 32), "bgmv_shrink on 0 rows: the output's shape")


# ---- task 4: the slot pool (contract only) ---------------------------------------------------------

def _pool(num_slots, resident=(), free=None):
    """A pool whose `resident` [(lora id, slot)] are listed least recently used first; the other slots free."""
    pool = LoRASlotPool(num_slots)
    pool.slot_of = OrderedDict(resident)
    used = {s for _, s in resident}
    pool.free_slots = [s for s in range(num_slots - 1, -1, -1) if s not in used] if free is None else list(free)
    return pool


def _view(pool, loads, needed):
    """What the contract fixes after assign(needed, ...): the resident ids with their slots when they
    were resident before (new ones: which free slot they took is free), the LRU order of the adapters
    not in this step, the loads' ids, each load naming the slot the pool now gives that id, and every
    slot either held or free exactly once."""
    step = set(needed)
    return {"resident": sorted(pool.slot_of), "older adapters, LRU first": [i for i in pool.slot_of if i not in step],
            "step's adapters are the most recent": sorted(list(pool.slot_of)[len(pool.slot_of) - len(step):]),
            "loaded ids": sorted(i for i, _ in loads),
            "each load's slot is its slot now": [pool.slot_of.get(i) == s for i, s in loads],
            "held + free slots": sorted(list(pool.slot_of.values()) + list(pool.free_slots))}


def _spec_assign(num_slots, resident, needed, pinned):
    """The contract on (resident [(id, slot)] LRU first, needed, pinned): the expected `_view`, plus
    each previously resident id's slot; None when no slot can be found (RuntimeError)."""
    order = [i for i, _ in resident]
    step = list(dict.fromkeys(needed))
    missing = [i for i in step if i not in order]
    free = num_slots - len(order)
    evictable = [i for i in order if i not in step and i not in pinned]
    if len(missing) > free + len(evictable):
        return None
    evicted = evictable[:max(0, len(missing) - free)]
    kept = [i for i in order if i not in evicted]
    final = [i for i in kept if i not in step] + step
    return {"resident": sorted(final), "older adapters, LRU first": [i for i in final if i not in step],
            "step's adapters are the most recent": sorted(step), "loaded ids": sorted(missing),
            "each load's slot is its slot now": [True] * len(missing), "held + free slots": list(range(num_slots))}


def _kept_slots(pool, resident):
    return {i: pool.slot_of.get(i) for i, _ in resident if i in pool.slot_of}


def _spec_kept(resident, view):
    return {i: s for i, s in resident if i in view["resident"]}


@pytest.mark.points(2)
@pytest.mark.task("assign")
def test_assign_free_slots_then_lru(student):
    """Resident adapters keep their slot; a missing one takes a free slot while there is one, then the
    slot of the least recently used adapter that is neither in this step nor pinned."""
    with plug(student, LAB, only=["assign"]):
        pool = _pool(3)
        loads = pool.assign([7], set())
        expect_equal((loads, dict(pool.slot_of)), ([(7, 0)], {7: 0}),
                     "3 free slots (free_slots [2, 1, 0]: pop() gives slot 0): assign([7], pinned=set()) -> "
                     "(loads, slot_of)")
        pool = _pool(3, resident=[(5, 0), (6, 1), (7, 2)], free=[])
        loads = pool.assign([6, 8], set())
        expect_equal((loads, list(pool.slot_of.items())), ([(8, 0)], [(7, 2), (6, 1), (8, 0)]),
                     "slots full, slot_of {5: 0, 6: 1, 7: 2} least recently used first: assign([6, 8], set()) -> "
                     "(loads, slot_of items in LRU order); 5 is the LRU adapter not needed now")
        loads = pool.assign([9], {7})
        expect_equal((loads, list(pool.slot_of.items())), ([(9, 1)], [(7, 2), (8, 0), (9, 1)]),
                     "then assign([9], pinned={7}): 7 is least recently used but pinned (a running request uses "
                     "it), so 6 goes")


@pytest.mark.points(1)
@pytest.mark.task("assign")
def test_assign_resident_adapters_cost_nothing(student):
    """A step whose adapters are all resident loads nothing and only refreshes their recency; a
    repeated id counts once, also a missing one: it is loaded once and evicts one adapter, not two."""
    with plug(student, LAB, only=["assign"]):
        pool = _pool(4, resident=[(1, 3), (2, 0), (3, 1)], free=[2])
        loads = pool.assign([1, 1, 3], set())
        expect_equal((loads, [i for i in pool.slot_of if i not in (1, 3)], sorted(pool.slot_of.items()),
                      list(pool.free_slots)), ([], [2], [(1, 3), (2, 0), (3, 1)], [2]),
                     "slot_of {1: 3, 2: 0, 3: 1} (LRU first), free_slots [2]: assign([1, 1, 3], set()) -> (loads, "
                     "the adapters not in the step in LRU order, slot_of sorted, free_slots)")
        pool = _pool(3, resident=[(1, 0), (2, 1), (3, 2)], free=[])
        loads = pool.assign([4, 4], set())
        expect_equal((loads, list(pool.slot_of.items()), list(pool.free_slots)), ([(4, 0)], [(2, 1), (3, 2), (4, 0)], []),
                     "3 slots full, slot_of {1: 0, 2: 1, 3: 2} (LRU first): assign([4, 4], set()) -> (loads, slot_of items "
                     "in LRU order, free_slots): adapter 4 is missing once, so only adapter 1 goes")


@pytest.mark.points(2)
@pytest.mark.task("assign")
def test_assign_no_room_changes_nothing(student):
    """When the step's missing adapters cannot all get a slot (the others are needed now or pinned),
    RuntimeError naming max_loras, and the pool is unchanged (no half-applied eviction)."""
    with plug(student, LAB, only=["assign"]):
        pool = _pool(2, resident=[(1, 0), (2, 1)], free=[])
        expect_raises(RuntimeError, pool.assign, [3], {1, 2}, match="max_loras",
                      message="2 slots holding adapters 1 and 2, both pinned: assign([3], pinned={1, 2})")
        expect_equal((list(pool.slot_of.items()), list(pool.free_slots)), ([(1, 0), (2, 1)], []),
                     "after the rejected assign([3], {1, 2}): (slot_of items, free_slots) unchanged")
        expect_raises(RuntimeError, pool.assign, [3, 4], {1}, match="max_loras",
                      message="then assign([3, 4], pinned={1}): two adapters missing, only adapter 2 can go")
        expect_equal((list(pool.slot_of.items()), list(pool.free_slots)), ([(1, 0), (2, 1)], []),
                     "after the rejected assign([3, 4], {1}): unchanged, adapter 2 not evicted")
        expect_raises(RuntimeError, pool.assign, [1, 2, 3], set(), match="max_loras",
                      message="then assign([1, 2, 3], set()): three adapters in one step, two slots")


@pytest.mark.points(2)
@pytest.mark.task("assign")
@lab_settings(60)
@seed(20240910)
@given(num_slots=st.integers(1, 4),
       steps=st.lists(st.tuples(st.lists(st.integers(1, 6), max_size=4), st.sets(st.integers(1, 6), max_size=3)),
                      min_size=1, max_size=12))
def test_assign_random_workloads(student, num_slots, steps):
    """Random steps (needed ids, pinned ids): after each, the state the contract fixes (resident ids,
    kept slots, LRU order, loads, no slot held twice or lost) or RuntimeError and no change."""
    with plug(student, LAB, only=["assign"]):
        pool = _pool(num_slots)
        log = []
        for needed, pinned in steps:
            resident = list(pool.slot_of.items())
            log.append(f"assign({needed}, pinned={sorted(pinned)})")
            where = f"{num_slots} slots, after {log}"
            if _spec_assign(num_slots, resident, needed, pinned) is None:
                expect_raises(RuntimeError, pool.assign, needed, pinned, message=f"{where}: no slot can be found")
                expect_equal(list(pool.slot_of.items()), resident, f"{where}: slot_of after the RuntimeError")
                continue
            loads = pool.assign(needed, pinned)
            expect_equal(_view(pool, loads, needed), _spec_assign(num_slots, resident, needed, pinned), where)
            expect_equal(_kept_slots(pool, resident),
                         _spec_kept(resident, _spec_assign(num_slots, resident, needed, pinned)),
                         f"{where}: the adapters resident before and after keep their slot")


# ---- task 5: the scheduler's slot rule -------------------------------------------------------------

@pytest.mark.points(2)
@pytest.mark.task("lora_slot_available")
def test_slot_rule_cases(student):
    """A request may join the running ones if it has no adapter, its adapter is running already, or fewer
    than max_loras adapters are running; without enable_lora adapter ids are only cache keys."""
    with plug(student, LAB, only=["_lora_slot_available"]):
        sched = make_scheduler(16, enable_lora=True, max_loras=2)
        got = [sched._lora_slot_available(make_request("r", 4, lora_id=lora), set(running))
               for lora, running in ((None, {1, 2}), (1, {1, 2}), (3, {1, 2}), (3, {1}), (3, set()))]
        expect_equal(got, [True, True, False, True, True],
                     "max_loras=2: (request's adapter, running adapters) = (none, {1, 2}), (1, {1, 2}), (3, {1, 2}), "
                     "(3, {1}), (3, {}) -> may it join?")
        sched = make_scheduler(16, enable_lora=False, max_loras=1)
        expect_equal(sched._lora_slot_available(make_request("r", 4, lora_id=3), {1, 2}), True,
                     "enable_lora=False, a request with lora_id 3, running {1, 2}")


def _trace(sched, runner, arrivals, max_steps=60):
    """Steps the scheduler; `arrivals` {step: [requests]} are added before that step. Per step: the
    scheduled request ids and the distinct adapters running after it; the outputs by request id."""
    steps, outputs = [], {}
    for k in range(max_steps):
        for req in arrivals.get(k, []):
            sched.add_request(req)
        if not sched.has_unfinished_requests() and k > max(arrivals):
            break
        out = sched.schedule()
        adapters = sorted({c.request.lora_id for c in out.scheduled if c.request.lora_id is not None})
        steps.append(([c.request.request_id for c in out.scheduled], adapters))
        for req in sched.update_from_output(out, runner.execute(out)):
            outputs[req.request_id] = list(req.output_token_ids)
    return steps, outputs


@pytest.mark.points(2)
@pytest.mark.task("lora_slot_available")
def test_slot_rule_in_the_scheduler(student):
    """max_loras=2, requests (adapter) r0 (1), r1 (2), r2 (3), r3 (none), r4 (1), 4 tokens each and 3
    output tokens: r2 waits for a slot, and FCFS admission stops there, so r3 and r4 wait behind it;
    when r0 and r1 finish (after 3 steps), r2, r3, r4 run together."""
    with plug(student, LAB, only=["_lora_slot_available"]):
        sched = make_scheduler(64, enable_lora=True, max_loras=2, max_num_batched_tokens=64)
        reqs = [make_request(f"r{i}", [10 + i, 11, 12, 13], max_tokens=3, lora_id=lora)
                for i, lora in enumerate([1, 2, 3, None, 1])]
        steps, outputs = _trace(sched, FakeRunner.for_scheduler(sched), {0: reqs})
    expect_equal(steps, [(["r0", "r1"], [1, 2])] * 3 + [(["r2", "r3", "r4"], [1, 3])] * 3,
                 "max_loras=2, adapters r0: 1, r1: 2, r2: 3, r3: none, r4: 1, all waiting at step 0: per step (the "
                 "scheduled requests, the distinct adapters among them)")
    expect_equal(outputs, {f"r{i}": reference_output([10 + i, 11, 12, 13], 3) for i in range(5)},
                 "the tokens of each request (the fake model's reference)")


STREAM_STEPS = 24


def _stream():
    """A stream of adapter-1 and adapter-2 requests (one every step, 6 tokens, 6 output tokens) with one
    adapter-3 request arriving at step 2, under max_loras=2."""
    arrivals = {k: [make_request(f"s{k}", [20 + k, 5, 6, 7, 8, 9], max_tokens=6, lora_id=1 + k % 2)]
                for k in range(STREAM_STEPS)}
    arrivals[2].append(make_request("late", [3, 4, 5, 6], max_tokens=4, lora_id=3))
    return arrivals


def _run_stream():
    sched = make_scheduler(256, enable_lora=True, max_loras=2, max_num_batched_tokens=64, max_num_seqs=16)
    return _trace(sched, FakeRunner.for_scheduler(sched), _stream(), max_steps=200)


@functools.cache
def _reference_stream():
    """The reference scheduler's trace on the stream (run outside any plug)."""
    return _run_stream()


def _first_step(steps, rid):
    return next((k for k, (ids, _) in enumerate(steps) if rid in ids), None)


@pytest.mark.points(2)
@pytest.mark.task("lora_slot_available")
@pytest.mark.end_to_end
def test_no_starvation_under_a_stream(student):
    """A steady stream of adapter-1 and adapter-2 requests keeps both slots busy; an adapter-3 request
    arriving at step 2 must still run, in the step the reference scheduler gives it (a rule letting
    requests of running adapters overtake it starves it), and no step runs more than 2 adapters."""
    with plug(student, LAB, only=["_lora_slot_available"]) as plugged:
        steps, outputs = _run_stream()
    expect_equal(plugged.uncalled(), [], "the stream: your functions the scheduler never called")
    expect_equal(_first_step(steps, "late"), _first_step(_reference_stream()[0], "late"),
                 "max_loras=2, one adapter-1 or adapter-2 request arriving every step for 24 steps, an adapter-3 "
                 "request arriving at step 2: the step in which it is first scheduled")
    expect_equal(max(len(adapters) for _, adapters in steps), 2,
                 "the same stream: the most distinct adapters in one step")
    expect_equal(steps, _reference_stream()[0], "the same stream: per step (scheduled requests, their adapters)")
    expect_equal(sorted(outputs), sorted(_reference_stream()[1]), "the same stream: the requests that finished")


# ---- end to end: tiny-llama with three adapters, against the reference engine and HF + PEFT ----------

E2E_MODEL = "tiny-llama"
E2E_ADAPTERS = ("r8-attn", "r16-all", "r4-mlp")
E2E_PROMPTS = [[(7 * i + 3 * j) % 500 + 3 for j in range(n)] for i, n in enumerate((5, 9, 12, 6, 17, 3, 8, 11))]
E2E_KINDS = [0, 1, 2, None, 2, 0, 1, None]  # adapter index of each prompt (None: the base model)
E2E_TOKENS = 4
E2E_ARGS = dict(enable_lora=True, max_loras=2, max_lora_rank=16, block_size=4, num_gpu_blocks=64,
                max_num_batched_tokens=32)


def _lora_requests():
    return [LoRARequest(name, k + 1, str(adapter_path(E2E_MODEL, name))) for k, name in enumerate(E2E_ADAPTERS)]


def _run_e2e():
    """The mixed batch through the engine: tokens by request, steps, host-cache loads."""
    engine = make_engine(E2E_MODEL, **E2E_ARGS)
    loras = _lora_requests()
    greedy = SamplingParams(max_tokens=E2E_TOKENS, temperature=0.0, ignore_eos=True)
    for i, (prompt, kind) in enumerate(zip(E2E_PROMPTS, E2E_KINDS)):
        engine.add_request(f"p{i}", prompt, greedy, lora_request=None if kind is None else loras[kind])
    tokens, steps = {}, 0
    while engine.has_unfinished_requests() and steps < 200:
        steps += 1
        for out in engine.step():
            if out.finished:
                tokens[out.request_id] = list(out.outputs[0].token_ids)
    engine.step()  # nothing left to run: its SchedulerOutput tells the runner which requests finished
    return tokens, steps, engine.runner.lora.request_lora


@functools.cache
def _reference_e2e():
    """The reference engine on the same batch (outside any plug)."""
    tokens, steps, _ = _run_e2e()
    return tokens, steps


@functools.cache
def _hf_peft_tokens():
    """Hugging Face + PEFT greedy tokens of every prompt (fp32, one prompt at a time)."""
    import peft
    import transformers

    base = transformers.AutoModelForCausalLM.from_pretrained(preset_path(E2E_MODEL), dtype=torch.float32)
    model = peft.PeftModel.from_pretrained(base, str(adapter_path(E2E_MODEL, E2E_ADAPTERS[0])),
                                           adapter_name=E2E_ADAPTERS[0]).eval()
    for name in E2E_ADAPTERS[1:]:
        model.load_adapter(str(adapter_path(E2E_MODEL, name)), adapter_name=name)
    tokens = {}
    with torch.inference_mode():
        for i, (prompt, kind) in enumerate(zip(E2E_PROMPTS, E2E_KINDS)):
            ids = torch.tensor([prompt])
            kwargs = dict(attention_mask=torch.ones_like(ids), max_new_tokens=E2E_TOKENS, min_new_tokens=E2E_TOKENS,
                          do_sample=False, pad_token_id=0)
            if kind is None:
                with model.disable_adapter():
                    out = model.generate(ids, **kwargs)
            else:
                model.set_adapter(E2E_ADAPTERS[kind])
                out = model.generate(ids, **kwargs)
            tokens[f"p{i}"] = out[0, len(prompt):].tolist()
    assert tokens == _reference_e2e()[0], "the reference engine must agree with HF + PEFT on this batch (a test bug)"
    return tokens


@pytest.mark.points(3)
@pytest.mark.task("end_to_end")
@pytest.mark.end_to_end
def test_engine_three_adapters_in_one_batch(student):
    """tiny-llama with your add_lora, slot pool and slot rule: 8 requests mixing 3 adapters (rank 8 on
    attention, rank 16 on every projection, rank 4 on the MLP) and the base model, max_loras=2 (an
    adapter waits for a slot and slots are reloaded), chunked prefill next to decodes: every request's
    greedy tokens equal Hugging Face + PEFT's and the reference engine's, in as many steps, and no slot
    stays pinned after the run."""
    with plug(student, LAB) as plugged:
        tokens, steps, pinned = _run_e2e()
    setup = (f"{E2E_MODEL}, max_loras=2, budget 32, 8 prompts of lengths {[len(p) for p in E2E_PROMPTS]} with adapters "
             f"{[None if k is None else E2E_ADAPTERS[k] for k in E2E_KINDS]}, {E2E_TOKENS} greedy tokens each")
    expect_equal(plugged.uncalled(), [], f"{setup}: your functions the engine never called")
    expect_equal(tokens, _hf_peft_tokens(), f"{setup}: each request's tokens (Hugging Face + PEFT generate)")
    expect_equal(steps, _reference_e2e()[1], f"{setup}: engine steps to finish (the reference engine's)")
    expect_equal(pinned, {}, f"{setup}: requests still pinning an adapter slot after the run")
