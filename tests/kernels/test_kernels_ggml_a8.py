"""kernels.cpu.ggml_a8: GGUF Q4_1 / Q8_0 matrices times int8-quantized activations, in C.

Against `kernels.quant_reference` (the same quantized activations, summed in float64): the kernel's only
error is fp32 summation, so 1e-5 relative in norm (measured 1e-7). The reference against the exact product
bounds what rounding activations to int8 per block costs (measured 0.5% in norm on Gaussian rows). The
portable C path (a build without AVX512-VNNI) is held to the same reference, and so is every tail: N not a
multiple of the 16-row tile, row counts 1 .. 64 around the 8-row register block (each a different unrolled
variant of the kernel), one block of K. A row's fp32 operations do not depend on its batch, so each row of a
batch is bit-for-bit the row alone; plausible blocking bugs (modelled in float64) miss the 1e-5 bound.
"""
from __future__ import annotations

import ctypes

import pytest
import torch

from kernels.cpu import load, load_error
from kernels.cpu.build import build
from kernels.cpu.interface import declare
from kernels.cpu.ggml_a8 import ggml_mul_mat_a8, pack_q4_1, pack_q8_0
from kernels.quant_reference import ggml_a8_gemm, quantize_q8_1

SHAPES = [(1, 16, 32), (3, 17, 64), (5, 40, 96), (9, 33, 576), (2, 576, 1536)]  # (M, N, K)
# the register block is 8 rows: full blocks, a tail of 1 (33), fewer rows than a block (3), several blocks (64)
ROWS = [1, 3, 8, 16, 33, 64]


def _q4_1(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k), generator=g)
    d = (torch.rand(n, k // 32, generator=g) * 0.02 + 1e-3).half()
    return q, d, (-torch.rand(n, k // 32, generator=g) * 0.15).half()


def _q8_0(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8), (torch.rand(n, k // 32, generator=g) * 0.01).half()


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want).norm() / want.norm()).item()


def _cases(m: int, n: int, k: int, seed: int):
    """(weight, the reference's q, dw, mw) for both formats."""
    q, d, mw = _q4_1(n, k, seed)
    q8, d8 = _q8_0(n, k, seed)
    return [(pack_q4_1(q, d, mw), q, d, mw), (pack_q8_0(q8, d8), q8.to(torch.int16) + 128, d8, -128 * d8.float())]


def test_the_library_builds() -> None:
    assert load() is not None, f"the C kernels did not build: {load_error()}"


@pytest.mark.parametrize("m,n,k", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_the_reference_sums(m, n, k, dtype) -> None:
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m * k), dtype=torch.float32).to(dtype)
    for w, q, dw, mw in _cases(m, n, k, seed=n):
        want = ggml_a8_gemm(x, q, dw, mw)
        got = ggml_mul_mat_a8(x, w)
        assert got.dtype == dtype and got.shape == (m, n)
        # bf16 output: its rounding (2^-9 relative) on top of fp32 summation
        assert _rel(got, want) < (2**-8 if dtype == torch.bfloat16 else 1e-5), (w.bits, m, n, k)


@pytest.mark.parametrize("m", ROWS)
def test_every_row_count_matches_the_reference(m) -> None:
    """N = 40: two full 16-row tiles and a tail of 8; K = 96 (3 blocks) and SmolLM2's 576."""
    for n, k in ((40, 96), (40, 576)):
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m + k)).bfloat16()
        for w, q, dw, mw in _cases(m, n, k, seed=m):
            assert _rel(ggml_mul_mat_a8(x, w), ggml_a8_gemm(x, q, dw, mw)) < 2**-8, (w.bits, m, n, k)
            assert _rel(ggml_mul_mat_a8(x.float(), w), ggml_a8_gemm(x.float(), q, dw, mw)) < 1e-5, (w.bits, m, n, k)


def test_a_row_is_the_same_alone_or_anywhere_in_a_batch() -> None:
    """Bit for bit: rows of a 33-row call (register blocks of 8, then a tail of 1) against each row alone (the
    1-row variant, whose integer dot runs in 4 chains): the fp32 operations are the same at every row count."""
    x = torch.randn(33, 96, generator=torch.Generator().manual_seed(5))
    for w, *_ in _cases(33, 40, 96, seed=6):
        batch = ggml_mul_mat_a8(x, w)
        for i in (0, 5, 7, 8, 31, 32):
            assert torch.equal(batch[i:i + 1], ggml_mul_mat_a8(x[i:i + 1], w)), (w.bits, i)
        assert torch.equal(batch[3:11], ggml_mul_mat_a8(x[3:11], w)), w.bits


def test_planted_blocking_bugs_miss_the_bound() -> None:
    """Outputs of plausible wrong kernels (the reference on altered inputs, float64) miss the 1e-5 bound the tests
    hold the kernel to: each would fail them."""
    m, n, k = 33, 40, 96
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(7))
    q, d, mw = _q4_1(n, k, seed=8)
    want = ggml_a8_gemm(x, q, d, mw)
    high = q.reshape(n, -1, 2, 16)
    planted = {
        "row 32 (the tail after four 8-row blocks) reads row 0": ggml_a8_gemm(torch.cat([x[:32], x[:1]]), q, d, mw),
        "the high nibbles read as the low ones": ggml_a8_gemm(x, high[:, :, :1].expand_as(high).reshape(n, k), d, mw),
        "the block minimum's term dropped": ggml_a8_gemm(x, q, d, torch.zeros_like(mw)),
        "each block scaled by the previous block's dw": ggml_a8_gemm(x, q, d.roll(1, dims=1), mw),
        "the last 8-row tile's scales from the tile before": ggml_a8_gemm(x, q, torch.cat([d[:32], d[16:24]]), mw),
        "a token's integer dot loses its last slice (k 28..31)":
            ggml_a8_gemm(x, q.reshape(n, -1, 32).index_fill(2, torch.arange(28, 32), 0).reshape(n, k), d, mw),
    }
    for name, wrong in planted.items():
        assert _rel(wrong, want) > 1e-5, name
    assert _rel(ggml_mul_mat_a8(x, pack_q4_1(q, d, mw)), want) < 1e-5


def test_the_portable_c_path_matches_too() -> None:
    """The same sums without vpdpbusd: a build with -mno-avx512vnni (the scalar loops other CPUs run)."""
    lib = ctypes.CDLL(str(build(("-mno-avx512vnni",))))
    declare(lib)
    for m, n, k in [*SHAPES[:4], (33, 40, 96)]:
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(k))
        for w, q, dw, mw in _cases(m, n, k, seed=k):
            assert _rel(ggml_mul_mat_a8(x, w, lib=lib), ggml_a8_gemm(x, q, dw, mw)) < 1e-5, (w.bits, m, n, k)
            xb = x.bfloat16()  # bf16 rows widened inside the quantization, bf16 out
            assert _rel(ggml_mul_mat_a8(xb, w, lib=lib), ggml_a8_gemm(xb, q, dw, mw)) < 2**-8, (w.bits, m, n, k)


def test_activation_rounding_is_what_int8_blocks_cost() -> None:
    """Each activation is within half a step (its block's max / 254) of its int8 value, so against the exact
    product the error is about 0.5% in norm here; a kernel that dropped the m-term (Q4_1's block minimum)
    or a block's scale would be off by tens of percent."""
    x = torch.randn(6, 576, generator=torch.Generator().manual_seed(1))
    xq, dx, sx = quantize_q8_1(x)
    blocks = x.reshape(6, -1, 32)
    assert xq.abs().max() <= 127 and ((blocks - xq.float().reshape(6, -1, 32) * dx[..., None]).abs()
                                      <= dx[..., None] / 2 + 1e-7).all()
    assert torch.allclose(sx, dx * xq.float().reshape(6, -1, 32).sum(-1))
    q, d, mw = _q4_1(200, 576, 2)
    exact = x.double() @ (q.double() * d.double().repeat_interleave(32, 1) + mw.double().repeat_interleave(32, 1)).t()
    err = _rel(ggml_mul_mat_a8(x, pack_q4_1(q, d, mw)), exact)
    assert 1e-4 < err < 0.01, err


def test_strided_rows_and_leading_dims() -> None:
    q, d, mw = _q4_1(48, 64, 3)
    w = pack_q4_1(q, d, mw)
    wide = torch.randn(2, 3, 128)
    x = wide[..., :64]  # rows 128 apart
    got = ggml_mul_mat_a8(x, w)
    assert got.shape == (2, 3, 48)
    assert torch.equal(got, ggml_mul_mat_a8(x.contiguous(), w))
    assert ggml_mul_mat_a8(torch.zeros(0, 64), w).shape == (0, 48)


def test_bad_inputs_are_refused_with_the_parameter_named() -> None:
    q, d, mw = _q4_1(16, 64, 4)
    with pytest.raises(ValueError, match="q must hold integers in 0..15"):
        pack_q4_1(q + 1, d, mw)
    with pytest.raises(ValueError, match="K a multiple of 32"):
        pack_q4_1(q[:, :40], d, mw)
    with pytest.raises(ValueError, match="must be fp16"):
        pack_q4_1(q, d.float(), mw)
    with pytest.raises(ValueError, match="m must be like d"):
        pack_q4_1(q, d, mw[:, :1])
    with pytest.raises(ValueError, match="q must be int8"):
        pack_q8_0(q, d)
    w = pack_q4_1(q, d, mw)
    with pytest.raises(ValueError, match="with 64 columns"):
        ggml_mul_mat_a8(torch.randn(2, 32), w)
    with pytest.raises(ValueError, match="fp32 or bf16"):
        ggml_mul_mat_a8(torch.randn(2, 64).half(), w)
