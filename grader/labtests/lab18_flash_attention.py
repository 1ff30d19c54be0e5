"""Official tests of lab 18_flash_attention: predictions on the memory hierarchy (HBM bytes, the largest tile
in shared memory, causal FLOPs, the roofline), `tiled_attention` in PyTorch, the causal early exit
`causal_kv_tiles` (contract only), a Triton FlashAttention-2 forward behind `paged_attention` (varlen
`cu_seqlens`, GQA, K/V read from the paged cache) and the FlashAttention 1 -> 2 -> 3 questions.

The seams (grader/seams.py): `kernels.tiled_attention.tiled_attention` (no engine path calls it: graded on
its own), `kernels.tiled_attention.causal_kv_tiles`, and the Triton backend's prefill attention,
`kernels.triton.prefill_attention.paged_attention`, which the engine calls for every prefill chunk.
Expected values come from float64 oracles written here (SDPA in float64 for one sequence; attention key by
key through the block table for the paged batches), from the early exit's contract written out
(`_spec_tiles`), from hand arithmetic in the docstrings, or from the reference engine run in a
`functools.cache` helper after the plug block. Without CUDA the learner's kernel runs under the Triton
interpreter, chosen here at import (before the notebook's cells decorate a kernel); shapes stay tiny because
the interpreter is slow. Every graded check is an `expect_*` observation.
"""
import functools
import os

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from grader.harness import GPUS, CountLaunches, make_paged_kv, run_engine, shape_of
from grader.observe import expect_close, expect_equal, expect_prediction
from grader.plug import plug

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

LAB = "18_flash_attention"
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
TILE = 16  # the notebook's BLOCK_M and BLOCK_N under the interpreter (only the CPU-only load count uses it)
SCALE = 0.3


# ---- task 1: predictions -------------------------------------------------------------------------------

@pytest.mark.points(2)
@pytest.mark.task("attention_hbm_bytes")
def test_predicted_hbm_bytes(student):
    """One head, d = 128, bf16. Naive: Q, K read and S written; S read and P written; P, V read and O written:
    (4 N d + 4 N^2) x 2 bytes = 138,412,032 at 4,096 tokens and 8,623,489,024 at 32,768. Fused: Q, K, V read
    and O written once: 4 N d x 2 = 4,194,304 and 33,554,432 (33x and 257x fewer). Within 0.1 %: counting S
    once or forgetting O is outside."""
    for n in (4096, 32768):
        expect_prediction(student.attention_hbm_bytes(n, False), (4 * n * 128 + 4 * n * n) * 2,
                     f"attention_hbm_bytes({n}, fused=False): HBM bytes of naive attention, one head, d 128, bf16",
                     rtol=1e-3)
        expect_prediction(student.attention_hbm_bytes(n, True), 4 * n * 128 * 2,
                     f"attention_hbm_bytes({n}, fused=True): HBM bytes of fused attention, one head, d 128, bf16",
                     rtol=1e-3)


def _spec_square_tile(head_dim, dtype_bytes, stages, smem_bytes=227 * 1024):
    """The largest power of two B with dtype_bytes x head_dim x B x (1 + 2 stages) <= smem_bytes (Q, and
    `stages` copies of K and V)."""
    tile = 1
    while dtype_bytes * head_dim * 2 * tile * (1 + 2 * stages) <= smem_bytes:
        tile *= 2
    return tile


@pytest.mark.points(2)
@pytest.mark.task("largest_square_tile")
def test_predicted_largest_tile_h100(student):
    """head_dim 128, bf16, 232,448 bytes per block on an H100: one stage needs 2 x 128 x 3B = 768 B bytes, so
    B <= 302 -> 256 (196,608 bytes; 512 would need 393,216); two stages need 1,280 B, B <= 181 -> 128 (163,840;
    256 would need 327,680)."""
    expect_prediction([student.largest_square_tile(128, 2, 1), student.largest_square_tile(128, 2, 2)],
                 [_spec_square_tile(128, 2, 1), _spec_square_tile(128, 2, 2)],
                 "[largest_square_tile(128, 2, stages=1), largest_square_tile(128, 2, stages=2)]: the largest "
                 "power-of-two Br = Bc whose Q, K, V tiles fit in an H100's 227 KB per block")


@pytest.mark.points(1)
@pytest.mark.task("largest_square_tile")
def test_predicted_largest_tile_other_cases(student):
    """head_dim 64 (512 and 256), fp32 at 128 (128 and 64), 3 stages at 128 in bf16 (1,792 B <= 232,448: 128),
    and an A100's 163 KB per block (166,912 bytes; bf16, 128, 2 stages: 128)."""
    cases = [(64, 2, 1), (64, 2, 2), (128, 4, 1), (128, 4, 2), (128, 2, 3), (128, 2, 2, 163 * 1024)]
    expect_prediction([student.largest_square_tile(*case) for case in cases],
                 [_spec_square_tile(*case) for case in cases],
                 "largest_square_tile(head_dim, dtype_bytes, stages[, smem_bytes]) for (64, 2, 1), (64, 2, 2), "
                 "(128, 4, 1), (128, 4, 2), (128, 2, 3) and (128, 2, 2, 166912)")


@pytest.mark.points(1)
@pytest.mark.task("prefill_flops_and_roofline")
def test_predicted_causal_prefill_flops(student):
    """n (n + 1) / 2 pairs per head, 4 d FLOPs each: 1 token, 1 head of 128: 512; 7 tokens: 28 pairs; Llama-3-8B's
    32 heads of 128 at 32,768 tokens: 2 x 128 x 32 x 32,768 x 32,769 = 8,796,361,457,664 (8.8 TFLOP per layer).
    Exact: n^2 / 2 pairs (the diagonal left out) is off by one pair per query."""
    cases = [(1, 128, 1), (7, 16, 2), (4096, 128, 1), (32768, 128, 32)]
    expect_prediction([student.causal_prefill_flops(*case) for case in cases],
                 [2 * d * h * n * (n + 1) for n, d, h in cases],
                 "causal_prefill_flops(n, head_dim, num_heads) for (1, 128, 1), (7, 16, 2), (4096, 128, 1), "
                 "(32768, 128, 32)")


# The datasheet figures of lab 01 (engine_core.capacity_planner.GPUS): A100 SXM 80 GB 312 TFLOP/s bf16 dense, 2.039 TB/s;
# H100 SXM 989 TFLOP/s, 3.35 TB/s. Ridge points 153 and 295 FLOPs per byte.
PEAKS = {"A100-80GB": (312e12, 2.039e12), "H100-80GB": (989e12, 3.35e12)}


def _spec_roofline(n, gpu_name, fused):
    flops, peak_bytes = 4 * n * n * 128, (4 * n * 128 if fused else 4 * n * 128 + 4 * n * n) * 2
    peak_flops, bandwidth = PEAKS[gpu_name]
    compute_s, memory_s = flops / peak_flops, peak_bytes / bandwidth
    return [flops / peak_bytes, max(compute_s, memory_s), "memory" if memory_s > compute_s else "compute"]


@pytest.mark.points(3)
@pytest.mark.task("prefill_flops_and_roofline")
def test_predicted_roofline(student):
    """Non-causal, one head, d 128, bf16: 4 N^2 d FLOPs. Naive: 62.1 FLOPs/byte at 4K and 63.8 at 32K, below both
    ridge points: memory-bound, 67.9 us (A100) and 41.3 us (H100) at 4K, 4.23 ms and 2.57 ms at 32K. Fused: N / 2
    = 2,048 and 16,384 FLOPs/byte: compute-bound, 27.5 us / 8.69 us at 4K, 1.76 ms / 556 us at 32K. Within 0.1 %."""
    for gpu_name in PEAKS:
        for n in (4096, 32768):
            for fused in (False, True):
                got = student.attention_roofline(n, GPUS[gpu_name], fused)
                expect_prediction(list(got[:2]), _spec_roofline(n, gpu_name, fused)[:2],
                             f"attention_roofline({n}, GPUS[{gpu_name!r}], fused={fused})[:2]: (FLOPs per HBM byte, "
                             f"time bound in seconds)", rtol=1e-3)
                expect_prediction(got[2], _spec_roofline(n, gpu_name, fused)[2],
                             f"attention_roofline({n}, GPUS[{gpu_name!r}], fused={fused})[2]: what bounds it")


# ---- task 2: tiled attention in PyTorch ----------------------------------------------------------------

def _sdpa64(query, key, value, scale):
    """float64 SDPA of one sequence: query [q_len, H, D] as the last q_len positions over key/value
    [seq_len, H_kv, D], causal aligned bottom-right, GQA by torch's enable_gqa (head h reads h // group)."""
    q_len, seq_len = query.shape[0], key.shape[0]
    mask = torch.arange(seq_len)[None, :] <= torch.arange(seq_len - q_len, seq_len)[:, None]
    out = F.scaled_dot_product_attention(query.double().transpose(0, 1), key.double().transpose(0, 1),
                                         value.double().transpose(0, 1), attn_mask=mask, scale=scale, enable_gqa=True)
    return out.transpose(0, 1)


def _sequence(q_len, seq_len, num_heads, num_kv_heads, head_dim, seed, dtype=torch.float64, offset=0.0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(q_len, num_heads, head_dim, generator=gen, dtype=torch.float64) + offset
    k = torch.randn(seq_len, num_kv_heads, head_dim, generator=gen, dtype=torch.float64) + offset
    v = torch.randn(seq_len, num_kv_heads, head_dim, generator=gen, dtype=torch.float64)
    return q.to(dtype), k.to(dtype), v.to(dtype)


# (q_len, seq_len, H, H_kv, D, block_m, block_n): lengths that are no multiple of the tiles, a cached prefix
# (q_len < seq_len), a single decode-like row, GQA 3:1 and 4:2, block_m != block_n
TILED_CASES = [(37, 37, 2, 2, 8, 16, 8), (20, 53, 6, 2, 8, 8, 16), (1, 29, 4, 1, 8, 4, 8), (45, 45, 4, 2, 16, 32, 16)]


@pytest.mark.points(3)
@pytest.mark.task("tiled_attention")
def test_tiled_matches_sdpa_float64(student):
    """float64 inputs: the online softmax over tiles equals SDPA to 1e-10 (both exact up to float64 rounding of a
    few hundred terms)."""
    for i, (q_len, seq_len, heads, kv_heads, d, bm, bn) in enumerate(TILED_CASES):
        q, k, v = _sequence(q_len, seq_len, heads, kv_heads, d, seed=i)
        with plug(student, LAB, only=["tiled_attention"]):
            got = student.tiled_attention(q, k, v, SCALE, bm, bn)
        expect_equal(shape_of(got), ["Tensor", [q_len, heads, d], "float64"],
                     f"(type, shape, dtype) of tiled_attention on query [{q_len}, {heads}, {d}] float64")
        expect_close(got, _sdpa64(q, k, v, SCALE),
                     f"tiled_attention(query [{q_len}, {heads}, {d}], key/value [{seq_len}, {kv_heads}, {d}], scale "
                     f"{SCALE}, block_m {bm}, block_n {bn}), float64, against float64 SDPA (causal, the queries the "
                     f"last {q_len} positions)", rtol=1e-10, atol=1e-10)


class LargestTensor(TorchDispatchMode):
    """`with LargestTensor() as seen:` records in `seen.largest` the most elements of any tensor an operation
    creates inside the block (views included: a view of an input is never larger than the input)."""

    def __enter__(self):
        self.largest = 0
        return super().__enter__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


@pytest.mark.points(2)
@pytest.mark.task("tiled_attention")
def test_tiled_never_materialises_n_by_n(student):
    """512 queries over 512 keys, 2 heads of 16, tiles of 32: one head's scores are 262,144 numbers, a tile's
    1,024, the inputs 16,384. No tensor your function creates may hold N x N / 4 = 65,536 elements or more
    (row blocks of scores, 32 x 512 per head, are still fine). Counted with a dispatch mode, not timed."""
    q, k, v = _sequence(512, 512, 2, 2, 16, seed=7, dtype=torch.float32)
    with plug(student, LAB, only=["tiled_attention"]):
        with LargestTensor() as seen:
            got = student.tiled_attention(q, k, v, SCALE, 32, 32)
    expect_equal([f"{seen.largest} elements"] if seen.largest >= 512 * 512 // 4 else [], [],
                 "the tensors of N x N / 4 = 65,536 elements or more that tiled_attention(query [512, 2, 16], key/value "
                 "[512, 2, 16], block_m 32, block_n 32) created (the largest one)")
    expect_close(got, _sdpa64(q, k, v, SCALE), "the same call's output against float64 SDPA (fp32 inputs)",
                 rtol=1e-5, atol=1e-5)


@pytest.mark.points(2)
@pytest.mark.task("tiled_attention")
def test_tiled_fp32_fp16_and_large_logits(student):
    """fp16 inputs come back in fp16. A zero query over 1,024 fp16 keys in tiles of 16: every logit is 0 and the
    output is the mean of the values (about 0.03 in size). Accumulated in fp32 it is off by its own fp16 rounding
    (3e-5 here); an fp16 running output rounds at every tile and is off by 2.6e-4: tolerance 1e-4. Logits near
    1000 (fp32 inputs offset by 7): exp(1000) overflows, the max must be taken out."""
    q, k, v = _sequence(3, 1024, 2, 1, 16, seed=8, dtype=torch.float16)
    q = q * 0  # every key weighs the same: the output is a long fp16 sum
    with plug(student, LAB, only=["tiled_attention"]):
        got16 = student.tiled_attention(q, k, v, SCALE, 16, 16)
    expect_equal(shape_of(got16), ["Tensor", [3, 2, 16], "float16"], "(type, shape, dtype) of tiled_attention on "
                 "fp16 query [3, 2, 16], key/value [1024, 1, 16]")
    expect_close(got16.double(), _sdpa64(q, k, v, SCALE), "tiled_attention on fp16 inputs, a zero query (every "
                 "logit 0) at the last 3 of 1,024 positions, tiles of 16, against float64 SDPA of the same fp16 "
                 "numbers", atol=1e-4)
    q, k, v = _sequence(24, 40, 2, 2, 16, seed=9, dtype=torch.float32, offset=7.0)
    with plug(student, LAB, only=["tiled_attention"]):
        got = student.tiled_attention(q, k, v, 1.0, 16, 16)
    expect_close(got, _sdpa64(q, k, v, 1.0), "tiled_attention, fp32, scale 1.0, inputs offset by 7 (logits near 16 x "
                 "49 = 784 to 1000): against float64 SDPA", rtol=1e-4, atol=1e-4)


# ---- task 3: the causal early exit (contract only) ------------------------------------------------------

def _spec_tiles(first_row, q_len, context_len, block_m, block_n):
    """The contract written out: 0 without a real row; else the tiles up to the one holding the last real
    row's position, context_len + min(first_row + block_m, q_len) - 1."""
    if first_row >= q_len:
        return 0
    return (context_len + min(first_row + block_m, q_len) - 1) // block_n + 1


@pytest.mark.points(2)
@pytest.mark.task("causal_kv_tiles")
def test_causal_kv_tiles_examples(student):
    """Tiles of 16 x 16 over a 64-token prompt: 1, 2, 3, 4 tiles. A 40-row chunk after 8 cached tokens: rows 0-15
    end at position 23 (2 tiles), 16-31 at 39 (3), 32-39 at 47 (3: the tile ends with the chunk). A program past
    the chunk's end visits nothing. A 128 x 64 tile on the diagonal of a 32k prompt: rows 0-127 need 2 key tiles."""
    cases = [(0, 64, 0, 16, 16), (16, 64, 0, 16, 16), (32, 64, 0, 16, 16), (48, 64, 0, 16, 16),
             (0, 40, 8, 16, 16), (16, 40, 8, 16, 16), (32, 40, 8, 16, 16), (48, 40, 8, 16, 16), (0, 32768, 0, 128, 64)]
    with plug(student, LAB, only=["causal_kv_tiles"]):
        got = [student.causal_kv_tiles(*case) for case in cases]
    expect_equal(got, [_spec_tiles(*case) for case in cases],
                 "causal_kv_tiles(first_row, q_len, context_len, block_m, block_n) for (0|16|32|48, 64, 0, 16, 16), "
                 "(0|16|32|48, 40, 8, 16, 16) and (0, 32768, 0, 128, 64)")


@pytest.mark.points(2)
@pytest.mark.task("causal_kv_tiles")
def test_causal_kv_tiles_contract(student):
    """Over 2,000 cases (q_len 0-40, context 0-40, blocks 1-32): the visited tiles hold the last real row's
    position, no visited tile starts after it, and a program without a real row visits none."""
    cases = [(first, q_len, context, bm, bn) for q_len in (0, 1, 5, 16, 17, 33, 40) for context in (0, 1, 15, 16, 40)
             for bm in (1, 4, 16, 32) for bn in (1, 7, 16, 32) for first in range(0, 48, bm)][:2000]
    with plug(student, LAB, only=["causal_kv_tiles"]):
        got = {case: student.causal_kv_tiles(*case) for case in cases}
    last = {c: c[2] + min(c[0] + c[3], c[1]) - 1 for c in cases}  # the last real row's position
    expect_equal([[*c, n] for c, n in got.items() if c[0] < c[1] and n * c[4] <= last[c]], [],
                 "[first_row, q_len, context_len, block_m, block_n, your answer] where the visited tiles miss a key "
                 "the last real row attends")
    expect_equal([[*c, n] for c, n in got.items() if c[0] < c[1] and (n - 1) * c[4] > last[c]], [],
                 "[first_row, q_len, context_len, block_m, block_n, your answer] where the last visited tile starts "
                 "after the last real row's position (wasted work)")
    expect_equal([[*c, n] for c, n in got.items() if c[0] >= c[1] and n != 0], [],
                 "[first_row, q_len, context_len, block_m, block_n, your answer] for a program past the chunk's end "
                 "(no real row): it visits no tile")


# ---- task 4: the Triton kernel ---------------------------------------------------------------------------

def make_batch(q_lens, seq_lens, num_heads, num_kv_heads, head_dim, block_size, dtype=torch.float32, seed=0):
    """Query rows packed with cu_seqlens and a paged cache (make_paged_kv: shuffled blocks, unused rows V = 1e4)."""
    gen = torch.Generator().manual_seed(seed)
    kv = make_paged_kv(gen, list(seq_lens), num_kv_heads, head_dim, block_size, dtype, DEVICE)
    query = torch.randn(sum(q_lens), num_heads, head_dim, generator=gen, dtype=torch.float64).to(dtype).to(DEVICE)
    cu = torch.tensor([0] + torch.tensor(list(q_lens)).cumsum(0).tolist(), dtype=torch.int32, device=DEVICE)
    return dict(query=query, key_cache=kv.key_cache, value_cache=kv.value_cache, block_tables=kv.block_tables,
                seq_lens=kv.seq_lens, query_start_loc=cu)


@functools.cache
def _oracle(q_lens, seq_lens, num_heads, num_kv_heads, head_dim, block_size, dtype=torch.float32, seed=0):
    """float64 on the CPU for make_batch's batch: each row of sequence i (position seq_len - q_len + r) over the
    keys 0 .. its position, gathered one by one through the block table, query head h on KV head h // group."""
    batch = make_batch(q_lens, seq_lens, num_heads, num_kv_heads, head_dim, block_size, dtype, seed)
    q = batch["query"].cpu().double()
    kc, vc = batch["key_cache"].cpu().double(), batch["value_cache"].cpu().double()
    tables, group = batch["block_tables"].cpu(), num_heads // num_kv_heads
    out = torch.zeros_like(q)
    start = 0
    for i, (q_len, n) in enumerate(zip(q_lens, seq_lens)):
        rows = [(int(tables[i, t // block_size]), t % block_size) for t in range(n)]
        k = torch.stack([kc[b, r] for b, r in rows])
        v = torch.stack([vc[b, r] for b, r in rows])
        for r in range(q_len):
            pos = n - q_len + r
            for h in range(num_heads):
                p = torch.softmax(k[:pos + 1, h // group] @ q[start + r, h] * SCALE, dim=0)
                out[start + r, h] = p @ v[:pos + 1, h // group]
        start += q_len
    return out


def describe(case):
    q_lens, seq_lens, heads, kv_heads, d, bs = case[:6]
    dtype = case[6] if len(case) > 6 else torch.float32
    return (f"q_lens (cu_seqlens steps) {list(q_lens)}, seq_lens {list(seq_lens)}, query heads {heads}, KV heads "
            f"{kv_heads}, head_dim {d}, block_size {bs}, {str(dtype).removeprefix('torch.')}")


def run_kernel(student, batch, count=True):
    """The learner's launcher on `batch` at SCALE; with `count`, observes one launch of flash_attention_kernel."""
    launcher = student.paged_attention
    kernel = student.flash_attention_kernel if count else None
    counter = CountLaunches(kernel) if count else None
    if count:
        launcher.__globals__["flash_attention_kernel"] = counter  # the name the launcher resolves at call time
    try:
        with plug(student, LAB, only=["paged_attention"]):
            out = launcher(batch["query"], batch["key_cache"], batch["value_cache"], batch["block_tables"],
                           batch["seq_lens"], batch["query_start_loc"], SCALE)
    finally:
        if count:
            launcher.__globals__["flash_attention_kernel"] = kernel
    if count:
        expect_equal(counter.launches, 1, "launches of flash_attention_kernel in one paged_attention call: one grid "
                     "covers every (query tile, head, sequence)")
    return out


def kernel_case(student, case, atol, what="", query_layout=None, count=True):
    batch = make_batch(*case)
    if query_layout is not None:
        batch["query"] = query_layout(batch["query"])
    got = run_kernel(student, batch, count)
    q = batch["query"]
    expect_equal(shape_of(got), ["Tensor", list(q.shape), str(q.dtype).removeprefix("torch.")],
                 f"(type, shape, dtype) paged_attention returned: the query's; on {describe(case)}")
    start = 0
    for i, q_len in enumerate(case[0]):
        expect_close(got[start:start + q_len].cpu().double(), _oracle(*case)[start:start + q_len],
                     f"{what}sequence {i} (rows {start}-{start + q_len - 1} of the query, its last {q_len} of "
                     f"{case[1][i]} positions): its output [rows, heads, head_dim]; on {describe(case)}", atol=atol)
        start += q_len


# fp32: the oracle is float64, the kernel accumulates in fp32 over <= 70 keys: errors are a few fp32 ulps of
# |out| <= 3, far below 1e-4, while every planted bug is off by > 1e-2.
FP32_ATOL = 1e-4


@pytest.mark.points(2)
@pytest.mark.task("paged_attention")
@pytest.mark.triton
def test_kernel_one_sequence(student):
    """One 37-token prompt (three query tiles of 16, the last with 5 rows), 2 heads of 16, blocks of 8: causal
    attention from the paged cache, one launch."""
    kernel_case(student, ((37,), (37,), 2, 2, 16, 8), FP32_ATOL)


@pytest.mark.points(3)
@pytest.mark.task("paged_attention")
@pytest.mark.triton
def test_kernel_varlen_with_prefix(student):
    """Three sequences packed with cu_seqlens [0, 20, 25, 58]: a 20-row chunk after 12 cached tokens, a 5-row chunk
    after 30 (one partial tile, positions 30-34), a 33-row prompt without a prefix. A tile that reads rows past its
    sequence's end in cu_seqlens, or keys past seq_len (V = 1e4 there), shows."""
    kernel_case(student, ((20, 5, 33), (32, 35, 33), 2, 2, 16, 8), FP32_ATOL)


@pytest.mark.points(2)
@pytest.mark.task("paged_attention")
@pytest.mark.triton
def test_kernel_gqa(student):
    """GQA: 6 query heads on 2 KV heads (head h reads KV head h // 3, not h % 2), then 4 on 1, blocks of 16."""
    kernel_case(student, ((18, 9), (18, 25), 6, 2, 16, 8), FP32_ATOL, what="6 heads on 2: ")
    kernel_case(student, ((21,), (21,), 4, 1, 16, 16), FP32_ATOL, what="4 heads on 1: ")


@pytest.mark.points(2)
@pytest.mark.task("paged_attention")
@pytest.mark.triton
def test_kernel_fp16_and_strided_query(student):
    """fp16 query and caches (the output rounded to fp16: tolerance 4e-3 on |out| <= 3, as lab 07), GQA 4:2, and a
    head-major query (stride(0) != H x D): the kernel reads the query's strides, not its shape."""
    kernel_case(student, ((19, 12), (19, 30), 4, 2, 16, 8, torch.float16), 4e-3, what="fp16, head-major query: ",
                query_layout=lambda q: q.transpose(0, 1).contiguous().transpose(0, 1))


class CountKeyLoads:
    """Under the Triton interpreter: counts the elements of `tensor` the kernel loads with a true mask (every
    `tl.load` goes through InterpreterBuilder.create_masked_load with the addresses as a numpy array)."""

    def __init__(self, tensor):
        self.lo = tensor.data_ptr()
        self.hi = self.lo + tensor.numel() * tensor.element_size()
        self.loaded = 0

    def __enter__(self):
        from triton.runtime import interpreter

        self._builder = interpreter.InterpreterBuilder
        self._original = self._builder.create_masked_load
        counter = self

        def counting(builder, ptrs, mask, *args, **kwargs):
            addresses, on = ptrs.data, mask.data
            counter.loaded += int(((addresses >= counter.lo) & (addresses < counter.hi) & on).sum())
            return counter._original(builder, ptrs, mask, *args, **kwargs)

        self._builder.create_masked_load = counting
        return self

    def __exit__(self, *exc):
        self._builder.create_masked_load = self._original


@pytest.mark.points(1)
@pytest.mark.task("paged_attention")
@pytest.mark.skipif(torch.cuda.is_available(), reason="counts the keys loaded under the Triton interpreter (CPU)")
@pytest.mark.triton
def test_kernel_loads_no_key_past_the_last_row(student):
    """The causal early exit, counted: a 64-token prompt in tiles of 16 needs keys 0-15, 0-31, 0-47, 0-63 (160 key
    rows of 16 numbers, 2,560); without the exit every tile reads all 64 (4,096). A 40-row chunk after 8 cached
    tokens needs 24 + 40 + 48 = 112 rows; reading whole 16-key tiles (128) is fine, more is not."""
    cases = [((64,), (64,), 1, 1, 16, 8), ((40,), (48,), 1, 1, 16, 8)]
    report = []
    for case in cases:
        batch = make_batch(*case)
        with CountKeyLoads(batch["key_cache"]) as counted:
            got = run_kernel(student, batch, count=False)
        q_len, seq_len = case[0][0], case[1][0]
        ends = [seq_len - q_len + min(first + TILE, q_len) for first in range(0, q_len, TILE)]
        need, whole_tiles = sum(ends) * 16, sum(-(-e // TILE) * TILE for e in ends) * 16
        if not need <= counted.loaded <= whole_tiles:
            report.append(f"{q_len} rows after {seq_len - q_len} cached: loaded {counted.loaded} key numbers, the "
                          f"causal need {need} to {whole_tiles}")
        expect_close(got.cpu().double(), _oracle(*case), f"the output on {describe(case)}", atol=FP32_ATOL)
    expect_equal(report, [], "cases where the kernel loaded more keys than its query tiles attend (or fewer)")


# ---- the engine on the learner's kernel --------------------------------------------------------------

PROMPT_A = [3 + (7 * i) % 97 for i in range(40)]
PROMPT_B = [11 + (5 * i) % 89 for i in range(23)]
PROMPT_C = PROMPT_A[:32] + [60, 61, 62, 63, 64, 65, 66, 67, 68]  # a 2-block cached prefix (block_size 16)


def _engine_run(backend):
    """A and B (40 and 23 tokens, 4 greedy tokens each), then C, which shares A's first 32 tokens: its prefill
    is a 9-token chunk after a 32-token cached prefix."""
    run = run_engine([[("a", PROMPT_A, 4), ("b", PROMPT_B, 4)], [("c", PROMPT_C, 4)]], device=DEVICE.type,
                     dtype="float32", attention_backend=backend, enforce_eager=True, block_size=16, num_gpu_blocks=24,
                     enable_prefix_caching=True, seed=0)
    return [run.tokens["a"], run.tokens["b"], run.tokens["c"]], run.cached["c"], len(run.held)


@functools.cache
def reference_run():
    """The reference engine's tokens and C's cached tokens, on its own ops (computed once per process)."""
    tokens, cached, leaked = _engine_run("auto")
    assert leaked == 0, "the reference engine leaked blocks (a test bug)"
    assert cached == 32, "request c was not served its 32-token prefix from the cache (a test bug)"
    return tokens


@pytest.mark.points(3)
@pytest.mark.task("engine")
@pytest.mark.end_to_end
@pytest.mark.triton
def test_engine_with_your_prefill_kernel(student, monkeypatch):
    """tiny-llama (4 query heads on 2 KV heads of 16, 2 layers) with your launcher as the Triton backend's prefill
    attention: every prefill chunk (two prompts in one step, then a chunk after a 32-token cached prefix) runs your
    kernel, and the greedy tokens equal the reference engine's. Without CUDA only the prefill runs in the
    interpreter: decode and the cache writes use the reference ops, as the reference engine does."""
    from kernels import reference
    from kernels.triton import cache as cache_mod
    from kernels.triton import decode_attention as decode_mod

    if DEVICE.type == "cpu":  # not seams of this lab: the interpreter would run them too, slowly
        monkeypatch.setattr(decode_mod, "paged_attention_decode", reference.paged_attention_decode)
        monkeypatch.setattr(cache_mod, "reshape_and_cache", reference.reshape_and_cache)
    with plug(student, LAB, only=["paged_attention"]) as plugged:
        got, cached, leaked = _engine_run("triton")
    expect_equal(plugged.calls["paged_attention"] > 0, True, "the engine called your paged_attention (prefill)")
    expect_equal(got, reference_run(),
                 "tiny-llama, greedy, prompts of 40 and 23 tokens then a 41-token prompt sharing the first 32 (block_size "
                 "16, prefix caching), 4 tokens each: the tokens with your kernel as the prefill attention, against the "
                 "reference engine's")
    expect_equal([cached, leaked], [32, 0], "[prompt tokens of request c served from the prefix cache, KV blocks still "
                 "allocated after every request finished]")


# ---- on a GPU ----------------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.perf
@pytest.mark.points(2)
@pytest.mark.task("throughput")
@pytest.mark.triton
def test_reaches_30_percent_of_sdpa(student):
    """On CUDA: 4 sequences of 2,048 tokens packed with cu_seqlens, 32 query heads on 8 KV heads of 128, bf16, the
    cache in 16-token blocks laid out in order: your kernel must run at >= 0.3x the speed of torch's SDPA
    (FlashAttention-2 or cuDNN inside) on the same tokens, after both agree. 0.3, not 0.8: a per-head kernel with
    fixed 64 x 32 tiles that reads K and V through a block table is not a tuned FlashAttention (the engine's own
    kernel packs the GQA group into one tile); no early exit or one tile per program at a time falls below 0.3
    (not measured in this session: no GPU was available; the threshold is from the FLOP count, causal skipping
    halving the work)."""
    from grader.perf import assert_throughput

    seqs, n, hq, hk, d, bs = 4, 2048, 32, 8, 128, 16
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    q = torch.randn(seqs * n, hq, d, device=DEVICE, dtype=torch.bfloat16, generator=gen)
    k = torch.randn(seqs * n, hk, d, device=DEVICE, dtype=torch.bfloat16, generator=gen)
    v = torch.randn(seqs * n, hk, d, device=DEVICE, dtype=torch.bfloat16, generator=gen)
    kc, vc = k.view(-1, bs, hk, d), v.view(-1, bs, hk, d)
    tables = torch.arange(seqs * n // bs, device=DEVICE, dtype=torch.int32).view(seqs, -1)
    lens = torch.full((seqs,), n, device=DEVICE, dtype=torch.int32)
    cu = torch.arange(0, seqs * n + 1, n, device=DEVICE, dtype=torch.int32)
    qs, ks, vs = (x.view(seqs, n, -1, d).transpose(1, 2) for x in (q, k, v))

    def sdpa():
        out = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=d ** -0.5, enable_gqa=True)
        return out.transpose(1, 2).reshape(seqs * n, hq, d)

    def close(out, ref):
        # both accumulate in fp32 and round P to bf16 for the PV product, in different orders
        torch.testing.assert_close(out, ref, atol=2e-2, rtol=1.6e-2)

    with plug(student, LAB, only=["paged_attention"]):
        assert_throughput(lambda: student.paged_attention(q, kc, vc, tables, lens, cu, d ** -0.5), sdpa,
                          bytes_moved=2 * seqs * n * (hq + hk) * d * 2, min_ratio=0.3, check=close)


# ---- task 6: FlashAttention 1 -> 2 -> 3 -----------------------------------------------------------------

@pytest.mark.points(3)
@pytest.mark.task("flash_attention_answers")
def test_flash_attention_answers(student):
    """FA1's Algorithm 1 loops over K/V tiles outside and query tiles inside (b); FA2 moves the division by l out
    of the loop (c), parallelises over query tiles for occupancy without atomics (a), splits query rows across
    warps (b); FA3: TMA, WGMMA, warp specialisation, ping-pong, FP8 (a), incoherent processing is a random
    Hadamard transform of Q and K (b); decode uses flash-decoding (b)."""
    got = student.flash_attention_answers()
    keys = ["fa1_loop_order", "fa2_non_matmul", "fa2_parallelism", "fa2_warps", "fa3_hopper", "fa3_incoherent", "decode"]
    expect_prediction(sorted(got), sorted(keys), "flash_attention_answers(): the questions answered")
    expect_prediction([got.get(key) for key in keys], ["b", "c", "a", "b", "a", "b", "b"],
                 "flash_attention_answers() for " + ", ".join(keys))
