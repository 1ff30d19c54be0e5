"""Official tests of lab 06_paged_attention_kernel: `online_softmax_step` and a Triton paged
decode-attention kernel behind `paged_attention_decode`.

Expected values come from a float64 oracle written here (each sequence's K/V read token by token
through its block table, plain softmax), never from the solution. Without CUDA the kernels run
under the Triton interpreter, which must be chosen before any kernel is decorated: this module
sets TRITON_INTERPRET=1 at import (it is imported before the notebook's cells run). Shapes stay
small because the interpreter is slow. The kernel tests and the end-to-end test run inside
`plug(student, LAB)` (grader/plug.py): the learner's launcher is the engine's decode seam,
`kernels.triton.decode_attention.paged_attention_decode`, and the engine's own decode kernels
(Triton and PyTorch) raise while it is plugged. Every graded check is an `expect_*`
observation: the float64 oracle is a spec helper (`_expected`, cached per case) evaluated only in
expected arguments, the reference engine's tokens a `functools.cache` run after the plug.
"""
import functools
import os

import pytest
import torch

from grader.harness import CountLaunches, make_paged_batch, run_engine, shape_of
from grader.observe import expect_close, expect_equal, expect_prediction
from grader.plug import plug

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

LAB = "06_paged_attention_kernel"
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
SCALE = 0.3


# ---- paged KV batches and the float64 oracle ---------------------------------------------------

def oracle(batch, scale=SCALE):
    """float64 decode attention: query head h of sequence i over the first seq_lens[i] tokens of
    KV head h // group, gathered one token at a time through block_tables[i]."""
    q = batch["query"].cpu().double()
    kc, vc = batch["key_cache"].cpu().double(), batch["value_cache"].cpu().double()
    tables, lens = batch["block_tables"].cpu(), batch["seq_lens"].tolist()
    block_size, num_kv_heads = kc.shape[1], kc.shape[2]
    group = q.shape[1] // num_kv_heads
    out = torch.empty_like(q)
    for i, n in enumerate(lens):
        if n == 0:  # an empty row (CUDA-graph padding): zeros, as kernels.reference gives
            out[i] = 0.0
            continue
        rows = [(int(tables[i, t // block_size]), t % block_size) for t in range(n)]
        k = torch.stack([kc[b, r] for b, r in rows])  # [n, H_kv, D]
        v = torch.stack([vc[b, r] for b, r in rows])
        for h in range(q.shape[1]):
            p = torch.softmax(k[:, h // group] @ q[i, h] * scale, dim=0)
            out[i, h] = p @ v[:, h // group]
    return out


def describe(batch):
    kc = batch["key_cache"]
    return (f"seq_lens={batch['seq_lens'].tolist()}, block_size={kc.shape[1]}, "
            f"query heads={batch['query'].shape[1]}, KV heads={kc.shape[2]}, head_dim={kc.shape[3]}, "
            f"dtype={str(kc.dtype).removeprefix('torch.')}, block_tables={batch['block_tables'].tolist()}")


@functools.cache
def _expected(seq_lens, num_heads, num_kv_heads, head_dim, block_size, dtype=torch.float32, seed=0):
    """The oracle's output (float64, on the CPU) for the batch `make_paged_batch` builds from these arguments."""
    return oracle(make_paged_batch(list(seq_lens), num_heads, num_kv_heads, head_dim, block_size, dtype, seed))


def run_decode(student, batch, scale=SCALE):
    """The learner's launcher on `batch`; it must launch their Triton kernel `paged_decode_kernel`.
    Observes that it did, and the returned tensor's shape and dtype (those of the query)."""
    launcher, kernel = student.paged_attention_decode, student.paged_decode_kernel
    counter = CountLaunches(kernel)
    launcher.__globals__["paged_decode_kernel"] = counter  # the name the launcher resolves at call time
    try:
        with plug(student, LAB):
            out = launcher(batch["query"], batch["key_cache"], batch["value_cache"], batch["block_tables"],
                           batch["seq_lens"], scale)
    finally:
        launcher.__globals__["paged_decode_kernel"] = kernel
    expect_equal(counter.launches > 0, True,
                 "did paged_attention_decode launch paged_decode_kernel? The task is the Triton kernel, not a "
                 "PyTorch fallback")
    q = batch["query"]
    expect_equal(shape_of(out), ["Tensor", list(q.shape), str(q.dtype).removeprefix("torch.")],
                 f"(type, shape, dtype) paged_attention_decode returned: the query's; on {describe(batch)}")
    return out


def expect_matches_oracle(got, batch, case, atol, what=""):
    """One observation per sequence: its [H, D] output against the float64 oracle's (`_expected(*case)`)."""
    group = batch["query"].shape[1] // batch["key_cache"].shape[2]
    for i, n in enumerate(batch["seq_lens"].tolist()):
        expect_close(got[i].cpu().double(), _expected(*case)[i],
                     f"{what}sequence {i} (seq_len {n}, block table {batch['block_tables'][i].tolist()}): its output "
                     f"[query heads, head_dim], query head h reading KV head h // {group}; on {describe(batch)}",
                     atol=atol)


def decode_case(student, *case, atol, what="", query_layout=None):
    """Builds the batch of `case` (make_paged_batch's arguments), runs the learner's launcher, observes."""
    batch = make_paged_batch(list(case[0]), *case[1:])
    if query_layout is not None:
        batch["query"] = query_layout(batch["query"])
    expect_matches_oracle(run_decode(student, batch), batch, case, atol, what)


# fp32 everywhere: the oracle is float64, the kernel accumulates in fp32 over <= 80 tokens; errors
# are a few fp32 ulps of |out| <= 3, far below 1e-4, while every planted bug is off by > 1e-2.
FP32_ATOL = 1e-4


# ---- task 1: online_softmax_step ---------------------------------------------------------------

def fold(student, s, v, tile):
    """Runs `online_softmax_step` over s [G, N] / v [N, D] in tiles of `tile` columns."""
    g, d = s.shape[0], v.shape[1]
    m = torch.full((g,), float("-inf"), dtype=torch.float64)
    l = torch.zeros(g, dtype=torch.float64)
    acc = torch.zeros(g, d, dtype=torch.float64)
    for a in range(0, s.shape[1], tile):
        m, l, acc = student.online_softmax_step(m, l, acc, s[:, a:a + tile], v[a:a + tile])
    return m, l, acc


def expect_fold_matches(student, s, v, tile, what):
    """The fold's (m, l, acc / l) against max, sum of exp(s - max) and softmax(s) @ v, to 1e-12 (float64
    throughout: a correct fold differs by a few ulps)."""
    m, l, acc = fold(student, s, v, tile)
    where = f"{what}: s = {s.tolist()} folded in tiles of {tile}"
    expect_close(m, s.max(dim=1).values, f"{where}: m, the running max", rtol=1e-12, atol=1e-12)
    expect_close(l, torch.exp(s - s.max(dim=1).values[:, None]).sum(dim=1), f"{where}: l, the sum of exp(s - m)",
                 rtol=1e-12, atol=1e-12)
    expect_close(acc / l[:, None], torch.softmax(s, dim=1) @ v, f"{where}: acc / l, the softmax-weighted values",
                 rtol=1e-12, atol=1e-12)


@pytest.mark.points(2)
@pytest.mark.task("online_softmax_step")
def test_online_softmax_matches_softmax(student):
    """Folding tiles one by one gives the max, the sum of exponentials and softmax(s) @ v."""
    s = torch.tensor([[0.5, 2.0, -1.0, 3.0, 0.0, 1.0], [4.0, -2.0, 0.0, 1.0, 2.5, -0.5]], dtype=torch.float64)
    v = torch.arange(12, dtype=torch.float64).view(6, 2) / 4
    expect_fold_matches(student, s, v, tile=6, what="one tile")
    expect_fold_matches(student, s, v, tile=2, what="three tiles (the max grows in tile 2)")
    gen = torch.Generator().manual_seed(1)
    s = torch.randn(3, 37, generator=gen, dtype=torch.float64) * 4
    v = torch.randn(37, 5, generator=gen, dtype=torch.float64)
    expect_fold_matches(student, s, v, tile=8, what="random logits, a partial last tile")


@pytest.mark.points(1)
@pytest.mark.task("online_softmax_step")
def test_online_softmax_masked_and_huge_logits(student):
    """A tile of only masked (-inf) logits leaves a fresh state untouched (no NaN); logits near
    1000 do not overflow."""
    masked = torch.full((2, 3), float("-inf"), dtype=torch.float64)
    m0 = torch.full((2,), float("-inf"), dtype=torch.float64)
    m, l, acc = student.online_softmax_step(m0, torch.zeros(2, dtype=torch.float64),
                                            torch.zeros(2, 4, dtype=torch.float64), masked,
                                            torch.ones(3, 4, dtype=torch.float64))
    expect_equal([l.tolist(), acc.tolist()], [[0.0, 0.0], [[0.0] * 4] * 2],
                 "[l, acc] after folding a first tile whose 3 logits are all -inf into a fresh state (m = -inf, l = 0, "
                 "acc = 0): exp(-inf - (-inf)) is NaN, so shift by 0 while the running max is still -inf")
    s = torch.tensor([[1000.0, float("-inf"), 999.0, 1001.0]], dtype=torch.float64)
    v = torch.tensor([[1.0], [50.0], [2.0], [3.0]], dtype=torch.float64)
    expect_fold_matches(student, s, v, tile=2, what="logits near 1000 with one masked")


@pytest.mark.points(1)
@pytest.mark.task("online_softmax_step")
def test_online_softmax_any_tiling(student):
    """Any tile size, any length, any pattern of masked scores (25 cases drawn from a seeded generator,
    the same in every run): the fold equals the softmax of the unmasked scores (rows with no unmasked
    score end with l = 0 and acc = 0)."""
    gen = torch.Generator().manual_seed(6)
    for case in range(25):
        rows, length, tile = (int(torch.randint(lo, hi + 1, (), generator=gen)) for lo, hi in ((1, 3), (1, 20), (1, 8)))
        masked = float(torch.rand((), generator=gen)) * 0.6 if case % 5 else 1.0  # every 5th case: all masked
        s = torch.randn(rows, length, generator=gen, dtype=torch.float64) * 5
        s[torch.rand(rows, length, generator=gen) < masked] = float("-inf")
        v = torch.randn(length, 3, generator=gen, dtype=torch.float64)
        m, l, acc = fold(student, s, v, tile)
        for r in range(rows):
            row = f"case {case}: row {s[r].tolist()} in tiles of {tile}"
            if torch.isinf(s[r]).all():
                expect_equal([l[r].item(), acc[r].tolist()], [0.0, [0.0] * 3], f"{row}: every score masked: [l, acc]")
                continue
            expect_close(acc[r] / l[r], torch.softmax(s[r], dim=0) @ v, f"{row}: acc / l", rtol=1e-10, atol=1e-12)


# ---- the prediction -----------------------------------------------------------------------------

@pytest.mark.points(2)
@pytest.mark.task("predicted_last_step_kv_bytes")
def test_predicted_last_step_kv_bytes(student):
    """The notebook's experiment: tiny-llama (2 KV heads x head_dim 16, fp32 cache), prompts of 9, 23, 30
    and 41 tokens, 12 greedy tokens each. The last of the 11 decode steps feeds token 11 and attends over
    prompt + 11 tokens: seq_lens 20, 34, 41, 52, so one call reads 2 x 147 x 2 x 16 x 4 = 37,632 bytes.
    Tolerance 1%: a count, exact when right; one token too few per sequence (2.7%), K without V (50%) or
    whole 8-token blocks (10%) are outside."""
    expect_prediction(student.predicted_last_step_kv_bytes(), 2 * (20 + 34 + 41 + 52) * 2 * 16 * 4,
                 "predicted_last_step_kv_bytes(): K and V bytes of one kernel call (one layer) in the last decode "
                 "step of the experiment", rtol=0.01)


# ---- task 2: the Triton kernel -------------------------------------------------------------------

@pytest.mark.points(2)
@pytest.mark.task("paged_attention_decode")
@pytest.mark.triton
def test_decode_one_block(student):
    """The smallest case: one sequence of 5 tokens in one block, one head."""
    decode_case(student, (5,), 1, 1, 16, 8, atol=FP32_ATOL)


@pytest.mark.points(2)
@pytest.mark.task("paged_attention_decode")
@pytest.mark.triton
def test_decode_block_table_gather(student):
    """Several sequences over shuffled physical blocks, lengths ending mid-block and on a block
    boundary, contexts of more than one K/V tile."""
    decode_case(student, (19, 3, 8, 17), 2, 2, 16, 8, torch.float32, 2, atol=FP32_ATOL)


@pytest.mark.points(2)
@pytest.mark.task("paged_attention_decode")
@pytest.mark.triton
def test_decode_gqa(student):
    """Query head h reads KV head h // (num_heads // num_kv_heads): groups of 2, 3 and 8."""
    for num_heads, num_kv_heads in ((4, 2), (6, 2), (8, 1)):
        decode_case(student, (11, 6), num_heads, num_kv_heads, 16, 4, torch.float32, num_heads, atol=FP32_ATOL,
                    what=f"GQA {num_heads} query heads : {num_kv_heads} KV heads: ")


@pytest.mark.points(2)
@pytest.mark.task("paged_attention_decode")
@pytest.mark.triton
def test_decode_lengths_and_block_sizes(student):
    """Block sizes 1, 16 and 32; lengths 1, a block, a block + 1, several tiles, and 0 (an empty row,
    as a padded CUDA-graph batch has: zeros, not NaN); head_dim 32."""
    for block_size, lens in ((1, (1, 7)), (16, (16, 0, 17)), (32, (70, 33))):
        decode_case(student, lens, 2, 1, 32, block_size, torch.float32, block_size, atol=FP32_ATOL,
                    what=f"block_size {block_size}: ")


@pytest.mark.points(2)
@pytest.mark.task("paged_attention_decode")
@pytest.mark.triton
def test_decode_fp16_and_strided_query(student):
    """fp16 caches and a head-major query (`[H, num_seqs, D]` memory viewed as `[num_seqs, H, D]`): index
    the query and the output with their own strides, not with offsets computed from the shape.
    Tolerance 4e-3: fp16 inputs are exact in the oracle, the output is rounded once to fp16 (2^-11
    relative, |out| <= 3); a wrong stride or mapping is off by > 1e-1."""
    # stride(0) = 16 < the output's 4 * 16, so a kernel that mixes the two strides stays in bounds
    decode_case(student, (13, 4), 4, 2, 16, 8, torch.float16, 5, atol=4e-3, what="fp16, head-major query: ",
                query_layout=lambda q: q.transpose(0, 1).contiguous().transpose(0, 1))


@functools.cache
def reference_tokens(device):
    """The reference engine's tokens (computed once per process: they do not depend on the learner)."""
    tokens, leaked = greedy_tokens(device, "auto")  # reference ops on CPU, reference Triton kernels on CUDA
    assert leaked == 0, "the reference engine leaked blocks (a test bug)"
    return tokens


def greedy_tokens(device, backend):
    """Two requests whose contexts cross block boundaries while decoding; every step after the
    first is decode-only, so the decode op runs 2 layers x 4 steps."""
    prompts = [[5, 17, 2, 99, 41, 7], [300, 12, 8, 64, 1, 250, 33, 90, 18, 6, 77, 3, 150, 21]]
    run = run_engine([[("r0", prompts[0], 5), ("r1", prompts[1], 5)]], device=device, dtype="float32",
                     attention_backend=backend, block_size=8, num_gpu_blocks=16, seed=0)
    return [run.tokens["r0"], run.tokens["r1"]], len(run.held)


@pytest.mark.points(3)
@pytest.mark.task("engine")
@pytest.mark.end_to_end
@pytest.mark.triton
def test_engine_generates_reference_tokens(student, monkeypatch):
    """The engine with the learner's launcher as its decode op gives the reference engine's greedy
    tokens and frees every block. Without CUDA only the decode op runs in the interpreter: the
    prefill and cache-write ops are set to the reference ones, which the reference engine also uses."""
    from kernels import reference
    from kernels.triton import cache as cache_mod
    from kernels.triton import prefill_attention as prefill_mod

    device = DEVICE.type
    if device == "cpu":  # not seams of this lab: the interpreter would run them too, slowly
        monkeypatch.setattr(prefill_mod, "paged_attention", reference.paged_attention)
        monkeypatch.setattr(cache_mod, "reshape_and_cache", reference.reshape_and_cache)
    with plug(student, LAB) as plugged:
        got, leaked = greedy_tokens(device, "triton")
    expect_equal(plugged.calls["paged_attention_decode"] > 0, True,
                 "did the engine call your paged_attention_decode (its decode op: the seam "
                 "kernels.triton.decode_attention.paged_attention_decode)?")
    expect_equal(got, reference_tokens(device),
                 "tiny-llama, greedy, 2 prompts of 6 and 14 tokens, block_size 8: the tokens with your kernel as the "
                 "decode op, against the reference engine's")
    expect_equal(leaked, 0, "KV blocks still allocated after every request finished")


@pytest.mark.gpu
@pytest.mark.perf
@pytest.mark.points(2)
@pytest.mark.task("throughput")
@pytest.mark.triton
def test_decode_throughput_vs_reference(student):
    """On a CUDA device: correct first, then at least 0.8x the reference Triton kernel's throughput
    (medians of alternating timings, num_splits=1 for both) on a batch that fills the GPU, and the
    achieved GB/s against the device's copy bandwidth measured in the same run."""
    from grader.perf import assert_throughput
    from kernels.triton.decode_attention import paged_attention_decode as reference_decode

    num_seqs, num_heads, num_kv_heads, head_dim, block_size, context = 64, 32, 8, 128, 16, 2048
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    num_blocks = num_seqs * context // block_size
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    key_cache = torch.randn(shape, generator=gen, device=DEVICE, dtype=torch.bfloat16)
    value_cache = torch.randn(shape, generator=gen, device=DEVICE, dtype=torch.bfloat16)
    query = torch.randn(num_seqs, num_heads, head_dim, generator=gen, device=DEVICE, dtype=torch.bfloat16)
    tables = torch.randperm(num_blocks, generator=gen, device=DEVICE).view(num_seqs, -1).to(torch.int32)
    seq_lens = torch.full((num_seqs,), context, dtype=torch.int32, device=DEVICE)
    args = (query, key_cache, value_cache, tables, seq_lens, head_dim ** -0.5)
    kv_bytes = 2 * num_seqs * context * num_kv_heads * head_dim * key_cache.element_size()

    def close(out, ref):
        # |out| ~ 0.04 (a softmax average of ~2k N(0,1) values); both kernels accumulate in fp32 and round
        # p to bf16 (2^-8 relative) for the PV product, so they differ by ~1e-4; a wrong kernel by ~1e-2
        torch.testing.assert_close(out, ref, atol=1e-3, rtol=1.6e-2)

    plugged = plug(student, LAB)

    def reference():  # the engine's own kernel, timed in turn with the learner's (which stays tripwired)
        with plugged.suspended():
            return reference_decode(*args, num_splits=1)

    with plugged:
        assert_throughput(lambda: student.paged_attention_decode(*args), reference,
                          bytes_moved=kv_bytes + 2 * query.numel() * query.element_size(), min_ratio=0.8, check=close)
