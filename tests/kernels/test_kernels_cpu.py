"""kernels.cpu (the C kernels for CPU tensors) against the float64 oracle and the reference ops.

Decode attention is checked with the same random paged batches and error bound as the Triton
kernels (shuffled blocks, poisoned unused rows, tables padded with 0 as the engine pads them), across GQA groups, block
sizes, and the work splits the kernel picks (whole sequences, or a sequence's KV heads cut into
uneven runs when there are few sequences). The cache write is a copy, so it must match the
reference exactly. Cases the C code does not cover must come back from the reference op.
"""
from __future__ import annotations

import ctypes
import os
import subprocess
import sys

import pytest
import torch
from kernel_cases import assert_attention_close, awkward_lengths, max_abs_value, oracle_attention

from grader.harness import make_paged_kv
from kernels import cpu, reference
from kernels.cpu.interface import declare
from kernels.cpu.build import build as build_library

CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def c_kernels() -> None:
    assert cpu.load() is not None, f"the C kernels did not build: {cpu.load_error()}"


@pytest.mark.parametrize("num_seqs", [1, 3, 12])
@pytest.mark.parametrize("block_size", [1, 8, 16])
@pytest.mark.parametrize("group", [1, 2, 4])
def test_decode_matches_oracle(seed: int, num_seqs: int, block_size: int, group: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    num_kv_heads, head_dim = 4, 32
    lens = awkward_lengths(gen, num_seqs, max(block_size, 2), max_len=70) if num_seqs > 1 else [67]
    kv = make_paged_kv(gen, lens, num_kv_heads, head_dim, block_size, torch.float32, CPU)
    query = torch.randn(num_seqs, num_kv_heads * group, head_dim, generator=gen)
    out = cpu.paged_attention_decode(query, kv.key_cache, kv.value_cache, kv.block_tables, kv.seq_lens,
                                     head_dim**-0.5)
    assert out.shape == query.shape and out.dtype == torch.float32
    assert_attention_close(out, oracle_attention(query, kv, [1] * num_seqs, head_dim**-0.5), torch.float32, seed,
                           f"cpu decode group={group} block_size={block_size} seq_lens={lens}", max_abs_value(kv))


def test_decode_reads_a_strided_query(seed: int) -> None:
    """The query is usually a view into the fused QKV output: rows further apart than heads * head_dim."""
    gen = torch.Generator().manual_seed(seed)
    kv = make_paged_kv(gen, [5, 40], 2, 16, 8, torch.float32, CPU)
    qkv = torch.randn(2, 8, 16, generator=gen)
    query = qkv[:, :4]
    out = cpu.paged_attention_decode(query, kv.key_cache, kv.value_cache, kv.block_tables, kv.seq_lens, 0.25)
    assert_attention_close(out, oracle_attention(query, kv, [1, 1], 0.25), torch.float32, seed, "strided query",
                           max_abs_value(kv))


@pytest.mark.parametrize("num_seqs", [1, 5])
@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("group", [1, 3])
def test_decode_reads_a_bf16_cache(seed: int, num_seqs: int, block_size: int, group: int) -> None:
    """bf16 query and caches, fp32 inside, the output rounded once to bf16: within bf16's rounding of the
    float64 oracle (computed from the same bf16 values), and against the reference op (which gathers, attends
    in fp32 and casts) at most one bf16 rounding apart."""
    _check_bf16_decode(seed, num_seqs, block_size, group, head_dim=64)


# head_dim 64 and 128 run 16-wide on AVX512-BF16 (paged_attention_decode_zmm.h): query heads go over V in
# passes of 4 at 64 and of 2 at 128, so groups 4 and 5 (4 + 1) and 2 and 3 (2 + 1) cover every pass length
BF16_HEADS = [(64, 4), (64, 5), (128, 2), (128, 3), (32, 2), (24, 2)]


@pytest.mark.parametrize("head_dim,group", BF16_HEADS)
def test_decode_bf16_at_every_head_size_and_group(seed: int, head_dim: int, group: int) -> None:
    _check_bf16_decode(seed, 5, 16, group, head_dim)


@pytest.mark.parametrize("head_dim,group", [(64, 3)] + BF16_HEADS)
def test_decode_bf16_without_avx512bf16(seed: int, head_dim: int, group: int,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """The 8-wide bf16 kernel, which CPUs without AVX512-BF16 run, built and checked here too."""
    lib = ctypes.CDLL(str(build_library(("-mno-avx512bf16",))))
    declare(lib)
    monkeypatch.setattr(cpu, "load", lambda: lib)
    _check_bf16_decode(seed, 5, 16, group, head_dim)


def _check_bf16_decode(seed: int, num_seqs: int, block_size: int, group: int, head_dim: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    num_kv_heads = 2
    lens = awkward_lengths(gen, num_seqs, max(block_size, 2), max_len=70) if num_seqs > 1 else [67]
    kv = make_paged_kv(gen, lens, num_kv_heads, head_dim, block_size, torch.bfloat16, CPU)
    query = torch.randn(num_seqs, num_kv_heads * group, head_dim, generator=gen).bfloat16()
    args = (query, kv.key_cache, kv.value_cache, kv.block_tables, kv.seq_lens, head_dim**-0.5)
    out = cpu.paged_attention_decode(*args)
    assert out.shape == query.shape and out.dtype == torch.bfloat16
    assert_attention_close(out, oracle_attention(query, kv, [1] * num_seqs, head_dim**-0.5), torch.bfloat16, seed,
                           f"cpu bf16 decode group={group} block_size={block_size} seq_lens={lens}", max_abs_value(kv))
    ref = reference.paged_attention_decode(*args).double()
    assert ((out.double() - ref).abs() <= 2.0**-7 * ref.abs() + 1e-5 * max_abs_value(kv)).all()


def test_cache_write_in_bf16_is_a_copy() -> None:
    gen = torch.Generator().manual_seed(0)
    qkv = torch.randn(20, 6, 16, generator=gen).bfloat16()
    key, value = qkv[:, :2], qkv[:, 4:]
    slots = torch.randperm(10 * 4, generator=gen)[:20]
    slots[::5] = -1
    caches = [torch.randn(10, 4, 2, 16, generator=gen).bfloat16() for _ in range(2)]
    got, want = [c.clone() for c in caches], [c.clone() for c in caches]
    cpu.reshape_and_cache(key, value, *got, slots)
    reference.reshape_and_cache(key, value, *want, slots)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.parametrize("op", ["paged_attention_decode", "paged_attention"])  # decode, and prefill (2 + 5 rows)
@pytest.mark.parametrize("case", ["float16", "fp8", "head_dim 12"])
def test_uncovered_cases_run_the_reference(case: str, op: str) -> None:
    gen = torch.Generator().manual_seed(0)
    head_dim = 12 if case == "head_dim 12" else 16
    dtype = torch.float16 if case == "float16" else torch.float32
    kv = make_paged_kv(gen, [3, 20], 2, head_dim, 8, dtype, CPU, fp8=case == "fp8")
    prefill = op == "paged_attention"
    query = torch.randn(7 if prefill else 2, 4, head_dim, generator=gen).to(dtype)
    rows = (torch.tensor([0, 2, 7]),) if prefill else ()
    args = (query, kv.key_cache, kv.value_cache, kv.block_tables, kv.seq_lens, *rows, 0.3, kv.k_scale, kv.v_scale)
    assert torch.equal(getattr(cpu, op)(*args), getattr(reference, op)(*args))


def test_decode_rejects_a_block_outside_the_cache() -> None:
    kv = make_paged_kv(torch.Generator().manual_seed(0), [20], 2, 16, 8, torch.float32, CPU)
    tables = kv.block_tables.clone()
    tables[0, 1] = kv.key_cache.shape[0]
    with pytest.raises(IndexError, match="outside the cache"):
        cpu.paged_attention_decode(torch.randn(1, 2, 16), kv.key_cache, kv.value_cache, tables, kv.seq_lens, 1.0)
    with pytest.raises(IndexError, match="more blocks than its block table row"):
        past_the_row = torch.full_like(kv.seq_lens, kv.block_tables.shape[1] * 8 + 1)  # one token past its last column
        cpu.paged_attention_decode(torch.randn(1, 2, 16), kv.key_cache, kv.value_cache, kv.block_tables,
                                   past_the_row, 1.0)


def test_cache_write_matches_the_reference_and_skips_minus_one() -> None:
    gen = torch.Generator().manual_seed(0)
    num_tokens, num_kv_heads, head_dim = 300, 2, 16  # >= 256 tokens: the threaded loop
    qkv = torch.randn(num_tokens, 3 * num_kv_heads, head_dim, generator=gen)
    key, value = qkv[:, :num_kv_heads], qkv[:, 2 * num_kv_heads:]  # strided views, as in the model
    slots = torch.randperm(40 * 8, generator=gen)[:num_tokens]
    slots[::7] = -1
    caches = [torch.randn(40, 8, num_kv_heads, head_dim, generator=gen) for _ in range(2)]
    got, want = [c.clone() for c in caches], [c.clone() for c in caches]
    cpu.reshape_and_cache(key, value, *got, slots)
    reference.reshape_and_cache(key, value, *want, slots)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert torch.equal(got[0].view(-1, num_kv_heads, head_dim)[slots[1:7]], key[1:7])


def test_cache_write_rejects_a_slot_past_the_cache() -> None:
    caches = [torch.zeros(2, 4, 1, 8) for _ in range(2)]
    kv = torch.ones(2, 1, 8)
    with pytest.raises(IndexError, match="past the cache's end"):
        cpu.reshape_and_cache(kv, kv, *caches, torch.tensor([0, 8]))
    assert caches[0].view(-1, 8)[0].eq(1).all(), "the valid slot is still written"


def test_the_library_is_cached() -> None:
    path = build_library()
    mtime = path.stat().st_mtime_ns
    assert build_library() == path and path.stat().st_mtime_ns == mtime


def test_without_a_compiler_it_warns_and_uses_the_reference(tmp_path) -> None:
    code = ("import warnings, torch, kernels\n"
            "with warnings.catch_warnings(record=True) as w:\n"
            "    warnings.simplefilter('always')\n"
            "    backend = kernels.resolve_backend('auto', torch.device('cpu'))\n"
            "print(backend, '|', w[0].message)\n")
    env = dict(os.environ, CC="no-such-cc", INFERENCE_LABS_CACHE=str(tmp_path))
    env.pop("KERNELS_BACKEND", None)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert out.startswith("torch |") and "slower PyTorch reference" in out and "no-such-cc" in out, out


# The fused elementwise ops against the model's PyTorch formulas, evaluated in float64: the C ops
# round differently (vectorised sums, their own exp), so the bound is a few fp32 ulps of the result.
FP32_ULPS = 4 * 2.0**-24


def _close(got: torch.Tensor, want64: torch.Tensor, what: str) -> None:
    err = (got.double() - want64).abs()
    bound = FP32_ULPS * (want64.abs() + want64.abs().amax(-1, keepdim=True))
    assert (err <= bound).all(), f"{what}: max |err| {err.max().item():.3g}, bound there {bound.flatten()[err.argmax()]:.3g}"


@pytest.mark.parametrize("width", [64, 67])  # 67: a tail past the 8-wide vectors
@pytest.mark.parametrize("rows", [3, 1100])  # 1100 x 64 >= RMS_NORM_PARALLEL_MIN elements: the threaded loop
def test_rms_norm_matches_the_formula(rows: int, width: int) -> None:
    from engine_core.models.llama import RMSNorm

    gen = torch.Generator().manual_seed(rows + width)
    x = torch.randn(rows, 2 * width, generator=gen)[:, :width] * 3  # strided rows
    norm = RMSNorm(torch.randn(width, generator=gen), 1e-6)
    want = RMSNorm(norm.weight.double(), 1e-6)(x.double())
    _close(cpu.rms_norm(x, norm.weight, 1e-6), want, f"rms_norm {rows}x{width}")
    _close(norm(x, cpu.rms_norm), want, "RMSNorm(x, op=cpu.rms_norm)")


@pytest.mark.parametrize("shape", [(5, 12), (300, 256)])  # a tail; the threaded loop
def test_silu_and_mul_matches_the_formula(shape: tuple[int, int]) -> None:
    rows, d = shape
    x = torch.randn(rows, 2 * d, generator=torch.Generator().manual_seed(0)) * 6
    x[0, :4] = torch.tensor([-100.0, -87.5, 0.0, 90.0])  # past exp's cut-offs both ways
    x64 = x.double()
    want = torch.nn.functional.silu(x64[:, :d]) * x64[:, d:]
    _close(cpu.silu_and_mul(x), want, f"silu_and_mul {shape}")


@pytest.mark.parametrize("head_dim", [16, 20])  # 20: half 10, a tail past the 8-wide vectors
def test_rotary_embedding_rotates_in_place_like_the_formula(head_dim: int) -> None:
    from engine_core.models.llama import Rope

    gen = torch.Generator().manual_seed(head_dim)
    tokens, heads = 7, 3
    cos, sin = torch.randn(50, head_dim // 2, generator=gen), torch.randn(50, head_dim // 2, generator=gen)
    positions = torch.randint(0, 50, (tokens,), generator=gen)
    qkv = torch.randn(tokens, heads + 2, head_dim, generator=gen)
    x = qkv[:, :heads]  # a strided view, as in the model
    want = Rope(cos.double(), sin.double(), positions, None)(x.double())
    untouched = qkv[:, heads:].clone()
    assert Rope(cos, sin, positions, cpu.rotary_embedding)(x) is x
    _close(x, want, f"rotary_embedding head_dim={head_dim}")
    assert torch.equal(qkv[:, heads:], untouched)
    with pytest.raises(IndexError, match="outside the RoPE tables"):
        cpu.rotary_embedding(x, positions + 50, cos, sin)


# bf16: the C ops round where the PyTorch formula in bf16 rounds. RoPE's products and sums of bf16 values
# are the same fp32 operations, so it must match bit for bit. RMSNorm's sum of squares and SiLU's exp are
# computed in another order / with another exp: an fp32 difference of a few ulps can move a result across
# a bf16 rounding boundary, so those may differ by one bf16 ulp (<= 2^-7 relative), and rarely do.
BF16_ULP = 2.0**-7


def _within_one_bf16_ulp(got: torch.Tensor, want: torch.Tensor, what: str, atol: float = 0.0) -> None:
    assert got.dtype == want.dtype == torch.bfloat16
    err = (got.double() - want.double()).abs()
    assert (err <= BF16_ULP * want.double().abs() + atol).all(), f"{what}: max |err| {err.max().item():.3g}"
    assert (got == want).double().mean() > 0.99, f"{what}: more than 1% of the values differ from PyTorch's"


@pytest.mark.parametrize("rows", [3, 1100])
def test_bf16_rms_norm_rounds_as_the_formula(rows: int) -> None:
    from engine_core.models.llama import RMSNorm

    gen = torch.Generator().manual_seed(rows)
    x = (torch.randn(rows, 2 * 67, generator=gen)[:, :67] * 3).bfloat16()
    norm = RMSNorm(torch.randn(67, generator=gen).bfloat16(), 1e-6)
    _within_one_bf16_ulp(cpu.rms_norm(x, norm.weight, 1e-6), norm(x), f"bf16 rms_norm {rows}x67")


def test_bf16_silu_and_mul_rounds_as_the_formula() -> None:
    x = (torch.randn(300, 2 * 259, generator=torch.Generator().manual_seed(0)) * 6).bfloat16()
    x[0, :4] = torch.tensor([-100.0, -87.5, 0.0, 90.0])
    gate, up = x.chunk(2, dim=-1)
    # exp8 gives 0 below -87.3 (vec8.h), where |silu(g)| < 88 e^-87.3 < 1e-36: PyTorch keeps those tiny values
    _within_one_bf16_ulp(cpu.silu_and_mul(x), torch.nn.functional.silu(gate) * up, "bf16 silu_and_mul",
                         atol=1e-36 * float(up.abs().max()))


@pytest.mark.parametrize("head_dim", [64, 20])
def test_bf16_rotary_embedding_matches_the_formula_bit_for_bit(head_dim: int) -> None:
    from engine_core.models.llama import Rope

    gen = torch.Generator().manual_seed(head_dim)
    cos, sin = (torch.randn(50, head_dim // 2, generator=gen).bfloat16() for _ in range(2))
    positions = torch.randint(0, 50, (7,), generator=gen)
    qkv = torch.randn(7, 5, head_dim, generator=gen).bfloat16()
    x = qkv[:, :3]
    want = Rope(cos, sin, positions, None)(x.clone())
    Rope(cos, sin, positions, cpu.rotary_embedding)(x)
    assert torch.equal(x, want)


def test_elementwise_ops_refuse_other_dtypes() -> None:
    with pytest.raises(ValueError, match="fp32 or bf16 CPU tensors"):
        cpu.silu_and_mul(torch.randn(2, 8, dtype=torch.float64))
    with pytest.raises(ValueError, match="of one dtype"):
        cpu.rms_norm(torch.randn(2, 8), torch.randn(8).bfloat16(), 1e-6)
