"""Official tests of lab 06_paged_attention_kernel: `online_softmax_step` and a Triton paged
decode-attention kernel behind `paged_attention_decode`.

Expected values come from a float64 oracle written here (each sequence's K/V read token by token
through its block table, plain softmax), never from the solution. Without CUDA the kernels run
under the Triton interpreter, which must be chosen before any kernel is decorated: this module
sets TRITON_INTERPRET=1 at import (it is imported before the notebook's cells run). Shapes stay
small because the interpreter is slow. The kernel tests and the end-to-end test run inside
`plug(student, LAB)` (grader/plug.py): the learner's launcher is the engine's decode seam,
`kernels.triton.decode_attention.paged_attention_decode`, and the engine's own decode kernels
(Triton and PyTorch) raise while it is plugged.
"""
import functools
import os

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from grader.harness import run_engine
from grader.plug import plug

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

LAB = "06_paged_attention_kernel"
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
SCALE = 0.3
UNUSED = 1e4  # V in cache rows no sequence owns (their K is 0, a score of 0): reading one wrecks the output


# ---- paged KV batches and the float64 oracle ---------------------------------------------------

def make_batch(seq_lens, num_heads, num_kv_heads, head_dim, block_size, dtype=torch.float32, seed=0):
    """Query and caches for `seq_lens`. Physical blocks are handed out shuffled (reading block
    `t // block_size` without the table reads another sequence's K/V), rows no sequence owns hold
    K = 0 and V = 1e4 (any weight on one shows), and the table has a spare column padded with 0 as
    the engine pads it."""
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + 2
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    key = torch.randn(shape, generator=gen, dtype=torch.float64)
    value = torch.randn(shape, generator=gen, dtype=torch.float64)
    owned = torch.zeros(num_blocks * block_size, dtype=torch.bool)
    tables = torch.zeros(len(seq_lens), max(blocks_per_seq) + 1, dtype=torch.int32)
    perm = torch.randperm(num_blocks, generator=gen)
    taken = 0
    for i, (n, nb) in enumerate(zip(seq_lens, blocks_per_seq)):
        tables[i, :nb] = perm[taken:taken + nb].to(torch.int32)
        taken += nb
        slots = tables[i, :nb].long()[:, None] * block_size + torch.arange(block_size)
        owned[slots.flatten()[:n]] = True
    key.view(-1, num_kv_heads, head_dim)[~owned] = 0.0
    value.view(-1, num_kv_heads, head_dim)[~owned] = UNUSED
    query = torch.randn(len(seq_lens), num_heads, head_dim, generator=gen, dtype=torch.float64)
    return dict(query=query.to(dtype).to(DEVICE), key_cache=key.to(dtype).to(DEVICE),
                value_cache=value.to(dtype).to(DEVICE), block_tables=tables.to(DEVICE),
                seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE))


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


class CountLaunches:
    """Stands in for the learner's kernel inside their launcher: counts `kernel[grid](...)` launches."""

    def __init__(self, kernel):
        self.kernel, self.launches = kernel, 0

    def __getitem__(self, grid):
        self.launches += 1
        return self.kernel[grid]

    def __getattr__(self, name):
        return getattr(self.kernel, name)


def run_decode(student, batch, scale=SCALE):
    """The learner's launcher on `batch`; it must launch their Triton kernel `paged_decode_kernel`."""
    launcher, kernel = student.paged_attention_decode, student.paged_decode_kernel
    counter = CountLaunches(kernel)
    launcher.__globals__["paged_decode_kernel"] = counter  # the name the launcher resolves at call time
    try:
        with plug(student, LAB):
            out = launcher(batch["query"], batch["key_cache"], batch["value_cache"], batch["block_tables"],
                           batch["seq_lens"], scale)
    finally:
        launcher.__globals__["paged_decode_kernel"] = kernel
    assert counter.launches, ("paged_attention_decode returned without launching paged_decode_kernel: the task is "
                              "the Triton kernel, not a PyTorch fallback")
    assert isinstance(out, torch.Tensor), f"paged_attention_decode returned {type(out).__name__}, expected a tensor"
    q = batch["query"]
    assert out.shape == q.shape and out.dtype == q.dtype, (
        f"paged_attention_decode returned shape {tuple(out.shape)} {out.dtype}, expected the query's "
        f"{tuple(q.shape)} {q.dtype}; on {describe(batch)}")
    return out


def assert_matches_oracle(got, batch, atol, what=""):
    """Names the worst (sequence, head): its length, KV head, expected and returned values."""
    want = oracle(batch)
    err = (got.cpu().double() - want).abs().nan_to_num(float("inf"))
    if err.max() <= atol:
        return
    seq, head = divmod(int(err.amax(dim=2).argmax()), want.shape[1])
    group = want.shape[1] // batch["key_cache"].shape[2]
    raise AssertionError(
        f"{what}wrong output for sequence {seq} (seq_len {batch['seq_lens'][seq].item()}), query head {head} "
        f"(reads KV head {head // group}): expected {[round(x, 4) for x in want[seq, head, :4].tolist()]}..., "
        f"got {[round(x, 4) for x in got[seq, head, :4].cpu().double().tolist()]}... "
        f"(max abs error {err.max().item():.3g}, allowed {atol:.1g}); on {describe(batch)}")


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


def assert_fold_matches(student, s, v, tile, what):
    m, l, acc = fold(student, s, v, tile)
    want_m = s.max(dim=1).values
    want_l = torch.exp(s - want_m[:, None]).sum(dim=1)
    want_out = torch.softmax(s, dim=1) @ v
    got_out = acc / l[:, None]
    for name, got, want in (("m", m, want_m), ("l", l, want_l), ("acc / l", got_out, want_out)):
        assert torch.allclose(got, want, rtol=1e-12, atol=1e-12), (
            f"{what}: after folding {s.shape[1]} logits in tiles of {tile}, {name} is {got.tolist()}, "
            f"expected {want.tolist()}")


@pytest.mark.points(2)
@pytest.mark.task("online_softmax_step")
def test_online_softmax_matches_softmax(student):
    """Folding tiles one by one gives the max, the sum of exponentials and softmax(s) @ v."""
    s = torch.tensor([[0.5, 2.0, -1.0, 3.0, 0.0, 1.0], [4.0, -2.0, 0.0, 1.0, 2.5, -0.5]], dtype=torch.float64)
    v = torch.arange(12, dtype=torch.float64).view(6, 2) / 4
    assert_fold_matches(student, s, v, tile=6, what="one tile")
    assert_fold_matches(student, s, v, tile=2, what="three tiles (the max grows in tile 2)")
    gen = torch.Generator().manual_seed(1)
    s = torch.randn(3, 37, generator=gen, dtype=torch.float64) * 4
    v = torch.randn(37, 5, generator=gen, dtype=torch.float64)
    assert_fold_matches(student, s, v, tile=8, what="random logits, a partial last tile")


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
    assert not (torch.isnan(l).any() or torch.isnan(acc).any()), (
        f"a first tile whose logits are all -inf gave l={l.tolist()}, acc={acc.tolist()}: expected l=0 and "
        f"acc=0 (exp(-inf - (-inf)) is NaN: shift by 0 while the running max is still -inf)")
    assert torch.equal(l, torch.zeros(2, dtype=torch.float64)) and not acc.any(), (
        f"a first tile of only -inf logits gave l={l.tolist()}, acc={acc.tolist()}, expected zeros")
    s = torch.tensor([[1000.0, float("-inf"), 999.0, 1001.0]], dtype=torch.float64)
    v = torch.tensor([[1.0], [50.0], [2.0], [3.0]], dtype=torch.float64)
    assert_fold_matches(student, s, v, tile=2, what="logits near 1000 with one masked")


@pytest.mark.points(1)
@pytest.mark.task("online_softmax_step")
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(rows=st.integers(1, 3), length=st.integers(1, 20), tile=st.integers(1, 8), seed=st.integers(0, 2**16),
       masked=st.floats(0.0, 0.6))
def test_online_softmax_any_tiling(student, rows, length, tile, seed, masked):
    """Any tile size, any length, any pattern of masked scores: the fold equals the softmax of the
    unmasked scores (rows with no unmasked score end with l = 0 and acc = 0)."""
    gen = torch.Generator().manual_seed(seed)
    s = torch.randn(rows, length, generator=gen, dtype=torch.float64) * 5
    s[torch.rand(rows, length, generator=gen) < masked] = float("-inf")
    v = torch.randn(length, 3, generator=gen, dtype=torch.float64)
    m, l, acc = fold(student, s, v, tile)
    for r in range(rows):
        row = f"row {s[r].tolist()} in tiles of {tile}"
        if torch.isinf(s[r]).all():
            assert l[r] == 0 and not acc[r].any(), (
                f"{row}: every score masked, got l={l[r].item()}, acc={acc[r].tolist()}, expected 0 and zeros")
            continue
        want = torch.softmax(s[r], dim=0) @ v
        got = acc[r] / l[r]
        assert torch.allclose(got, want, rtol=1e-10, atol=1e-12), (
            f"{row}: acc / l = {got.tolist()}, expected {want.tolist()}")


# ---- task 2: the Triton kernel -------------------------------------------------------------------

@pytest.mark.points(2)
@pytest.mark.task("paged_attention_decode")
def test_decode_one_block(student):
    """The smallest case: one sequence of 5 tokens in one block, one head."""
    batch = make_batch([5], num_heads=1, num_kv_heads=1, head_dim=16, block_size=8)
    assert_matches_oracle(run_decode(student, batch), batch, FP32_ATOL)


@pytest.mark.points(2)
@pytest.mark.task("paged_attention_decode")
def test_decode_block_table_gather(student):
    """Several sequences over shuffled physical blocks, lengths ending mid-block and on a block
    boundary, contexts of more than one K/V tile."""
    batch = make_batch([19, 3, 8, 17], num_heads=2, num_kv_heads=2, head_dim=16, block_size=8, seed=2)
    assert_matches_oracle(run_decode(student, batch), batch, FP32_ATOL)


@pytest.mark.points(2)
@pytest.mark.task("paged_attention_decode")
def test_decode_gqa(student):
    """Query head h reads KV head h // (num_heads // num_kv_heads): groups of 2, 3 and 8."""
    for num_heads, num_kv_heads in ((4, 2), (6, 2), (8, 1)):
        batch = make_batch([11, 6], num_heads, num_kv_heads, head_dim=16, block_size=4, seed=num_heads)
        assert_matches_oracle(run_decode(student, batch), batch, FP32_ATOL,
                              what=f"GQA {num_heads} query heads : {num_kv_heads} KV heads: ")


@pytest.mark.points(2)
@pytest.mark.task("paged_attention_decode")
def test_decode_lengths_and_block_sizes(student):
    """Block sizes 1, 16 and 32; lengths 1, a block, a block + 1, several tiles, and 0 (an empty row,
    as a padded CUDA-graph batch has: zeros, not NaN); head_dim 32."""
    for block_size, lens in ((1, [1, 7]), (16, [16, 0, 17]), (32, [70, 33])):
        batch = make_batch(lens, num_heads=2, num_kv_heads=1, head_dim=32, block_size=block_size, seed=block_size)
        assert_matches_oracle(run_decode(student, batch), batch, FP32_ATOL, what=f"block_size {block_size}: ")


@pytest.mark.points(2)
@pytest.mark.task("paged_attention_decode")
def test_decode_fp16_and_strided_query(student):
    """fp16 caches and a head-major query (`[H, num_seqs, D]` memory viewed as `[num_seqs, H, D]`): index
    the query and the output with their own strides, not with offsets computed from the shape."""
    batch = make_batch([13, 4], num_heads=4, num_kv_heads=2, head_dim=16, block_size=8, dtype=torch.float16, seed=5)
    # stride(0) = 16 < the output's 4 * 16, so a kernel that mixes the two strides stays in bounds
    batch["query"] = batch["query"].transpose(0, 1).contiguous().transpose(0, 1)
    out = run_decode(student, batch)
    # fp16 inputs are exact in the oracle; the output is rounded once to fp16 (2^-11 relative, |out| <= 3)
    assert_matches_oracle(out, batch, atol=4e-3, what="fp16, head-major query: ")


@functools.cache
def reference_tokens(device):
    """The reference engine's tokens (computed once per process: they do not depend on the learner)."""
    tokens, leaked = greedy_tokens(device, "auto")  # reference ops on CPU, reference Triton kernels on CUDA
    assert leaked == 0, f"the reference engine leaked {leaked} blocks"
    return tokens


def greedy_tokens(device, backend):
    """Two requests whose contexts cross block boundaries while decoding; every step after the
    first is decode-only, so the decode op runs 2 layers x 4 steps."""
    prompts = [[5, 17, 2, 99, 41, 7], [300, 12, 8, 64, 1, 250, 33, 90, 18, 6, 77, 3, 150, 21]]
    run = run_engine([[("r0", prompts[0], 5), ("r1", prompts[1], 5)]], device=device, dtype="float32",
                     attention_backend=backend, block_size=8, num_gpu_blocks=16, seed=0)
    return [run.tokens["r0"], run.tokens["r1"]], len(run.held)


@pytest.mark.points(3)
@pytest.mark.task("paged_attention_decode")
@pytest.mark.end_to_end
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
    calls = plugged.calls["paged_attention_decode"]
    want = reference_tokens(device)
    assert calls, "the engine never called the decode op: the seam kernels.triton.decode_attention is not in use"
    assert got == want, (
        f"tiny-llama, greedy, 2 prompts of 6 and 14 tokens, block_size 8: your kernel as the decode op "
        f"({calls} calls) generated {got}, the reference engine {want}")
    assert leaked == 0, f"{leaked} KV blocks still allocated after every request finished"


@pytest.mark.gpu
@pytest.mark.perf
@pytest.mark.points(2)
@pytest.mark.task("paged_attention_decode")
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
