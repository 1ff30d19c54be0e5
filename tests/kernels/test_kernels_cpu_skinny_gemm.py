"""kernels.cpu.skinny_gemm: x @ w.T (+ bias) (+ residual) for a few rows, w unpacked, in C.

The oracle is the float64 product of the same (fp32 or bf16) inputs. A correct kernel's only error is its fp32
summation, at most (k + 2) u sum|x w| per output (u = 2^-24, the textbook bound for any summation order), and
for bf16 output one rounding (2^-8 relative) on top: bounds no correct kernel can miss and a wrong row, a
dropped partial sum or a skipped tail misses by far. The fused residual must be the two separate ops bit for
bit (fp32: y + residual; bf16: rounded, added, rounded again), and the thread count must change no bit. The
same holds for the builds without AVX512-BF16 (bf16 on 8-float vectors) and without AVX-512 at all.
"""
from __future__ import annotations

import ctypes
import re

import pytest
import torch
import torch.nn.functional as F

from kernels.cpu import load, load_error
from kernels.cpu.build import build
from kernels.cpu.interface import declare
from kernels.cpu.skinny_gemm import SKINNY_MAX_ROWS, skinny_gemm, skinny_gemm_applies

U = 2.0**-24
# (m, n, k): rows past the kernel's group of 4, n not a multiple of anything, k across the 64 (fp32) and 128
# (bf16) element steps of the unrolled loop and its masked tail
SHAPES = [(1, 1, 1), (1, 7, 5), (2, 13, 31), (3, 9, 32), (4, 33, 40), (5, 17, 100), (9, 5, 129), (1, 576, 576),
          (2, 96, 1536), (4, 64, 200)]


def _inputs(m: int, n: int, k: int, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x, w = torch.randn(m, k, generator=g).to(dtype), torch.randn(n, k, generator=g).to(dtype)
    return x, w, torch.randn(n, generator=g).to(dtype), torch.randn(m, n, generator=g).to(dtype)


def _check_against_float64(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> None:
    exact = x.double() @ w.double().T + (0 if b is None else b.double())
    bound = (x.shape[1] + 2) * U * (x.double().abs() @ w.double().abs().T + (0 if b is None else b.double().abs()))
    if got.dtype == torch.bfloat16:
        bound = bound + 2.0**-8 * exact.abs()  # the output's one rounding to bf16 (half an ulp: 2^-9 relative)
    err = (got.double() - exact).abs()
    assert got.shape == exact.shape and got.dtype == x.dtype
    assert bool((err <= bound + 1e-300).all()), f"worst error {float((err - bound).max()):.3g} past the bound"


def test_the_library_builds() -> None:
    assert load() is not None, f"the C kernels did not build: {load_error()}"


@pytest.mark.parametrize("m,n,k", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_the_float64_product(m, n, k, dtype) -> None:
    x, w, b, _ = _inputs(m, n, k, dtype, seed=m * n + k)
    _check_against_float64(skinny_gemm(x, w, b), x, w, b)
    _check_against_float64(skinny_gemm(x, w), x, w, None)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_fused_residual_is_the_separate_add_bit_for_bit(dtype) -> None:
    for m, n, k in SHAPES:
        x, w, b, res = _inputs(m, n, k, dtype, seed=k)
        assert torch.equal(skinny_gemm(x, w, b, res), res + skinny_gemm(x, w, b)), (m, n, k)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_strided_rows_and_strided_residual(dtype) -> None:
    x, w, b, _ = _inputs(3, 40, 300, dtype)  # k past the unrolled loop's step and its tail
    wide = torch.randn(3, 360).to(dtype)
    wide[:, 20:320] = x
    res_wide = torch.randn(3, 64).to(dtype)
    got = skinny_gemm(wide[:, 20:320], w, b, res_wide[:, :40])
    assert torch.equal(got, res_wide[:, :40] + skinny_gemm(x, w, b))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_thread_count_changes_no_bit(dtype) -> None:
    x, w, b, res = _inputs(2, 576, 1536, dtype)  # past the size where a second thread joins
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = skinny_gemm(x, w, b, res)
        torch.set_num_threads(2)
        two = skinny_gemm(x, w, b, res)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)


@pytest.mark.parametrize("flags", [("-mno-avx512bf16",), ("-mno-avx512f",)], ids=["no-avx512bf16", "no-avx512"])
def test_the_portable_paths_match_too(flags) -> None:
    lib = ctypes.CDLL(str(build(flags)))
    declare(lib)
    for dtype in (torch.float32, torch.bfloat16):
        for m, n, k in SHAPES:
            x, w, b, res = _inputs(m, n, k, dtype, seed=n)
            _check_against_float64(skinny_gemm(x, w, b, lib=lib), x, w, b)
            assert torch.equal(skinny_gemm(x, w, b, res, lib=lib), res + skinny_gemm(x, w, b, lib=lib))


def test_it_agrees_with_f_linear() -> None:
    """Against PyTorch's own op at the tolerance of two fp32 summation orders (fp32) and of one bf16 ulp where the
    two sums round to neighbours (bf16)."""
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2.0**-7)):
        x, w, b, _ = _inputs(2, 300, 576, dtype)
        want = F.linear(x, w, b).double()
        assert ((skinny_gemm(x, w, b).double() - want).abs() <= tol * (want.abs() + 1)).all()


def test_no_rows_give_an_empty_output() -> None:
    x, w, b, _ = _inputs(1, 8, 16, torch.float32)
    assert skinny_gemm(x[:0], w, b).shape == (0, 8)


def test_bad_inputs_are_refused_with_the_parameter_named() -> None:
    x, w, b, res = _inputs(2, 8, 16, torch.float32)
    for args, named in [((x, w[:, :15]), "weight must be [n, 16]"),
                        ((x.double(), w.double()), "x must be fp32 or bf16"),
                        ((x, w.bfloat16()), "weight must be x's dtype"), ((x, w.T.contiguous().T), "weight must be"),
                        ((x, w, b[:7]), "bias must be [8]"), ((x, w, b, res[:1]), "residual must be [2, 8]"),
                        ((x, w, b.bfloat16()), "bias must be x's dtype"),
                        ((x.T.contiguous().T, w), "x must be [m, k] with its last dimension contiguous"),
                        ((x[0], w), "x must be [m, k]")]:
        with pytest.raises(ValueError, match=re.escape(f"skinny_gemm: {named}")):
            skinny_gemm(*args)


def test_the_engine_sends_only_few_rows_here() -> None:
    """`UnquantizedLinearMethod` asks `skinny_gemm_applies` per call: up to SKINNY_MAX_ROWS rows of a dtype the
    kernel computes in, a contiguous weight of the same dtype, on CPU."""
    for dtype, rows in SKINNY_MAX_ROWS.items():
        w = torch.randn(8, 16).to(dtype)
        assert skinny_gemm_applies(torch.randn(rows, 16).to(dtype), w)
        assert not skinny_gemm_applies(torch.randn(rows + 1, 16).to(dtype), w)
        assert not skinny_gemm_applies(torch.randn(0, 16).to(dtype), w)
        assert not skinny_gemm_applies(torch.randn(1, 16).to(dtype), torch.randn(16, 8).to(dtype).T)
        x = torch.randn(1, 16).to(dtype)
        assert skinny_gemm_applies(x, w, torch.zeros(8).to(dtype), torch.zeros(1, 8).to(dtype))
        assert not skinny_gemm_applies(x, w, torch.zeros(7).to(dtype))
        assert not skinny_gemm_applies(x, w, None, torch.zeros(2, 8).to(dtype))
        assert not skinny_gemm_applies(x, w, torch.zeros(8).half())
        assert not skinny_gemm_applies(x, torch.randn(8, 15).to(dtype))
    assert not skinny_gemm_applies(torch.randn(1, 16).half(), torch.randn(8, 16).half())
    assert not skinny_gemm_applies(torch.randn(1, 16), torch.randn(8, 16).bfloat16())
