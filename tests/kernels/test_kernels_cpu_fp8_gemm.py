"""kernels.cpu.fp8_gemm: weight-only fp8 (W8A16) in C, and its dequantize.

Oracles: torch's own float8_e4m3fn -> fp32 conversion for every one of the 256 codes, bit for bit (NaN codes
included); for the GEMM the float64 product of x and the exactly decoded weight times its fp32 scale. A correct
kernel's only error is its fp32 arithmetic: each product x * (q 2^-8) and the sum, at most (k + 2) u sum |x w|
(u = 2^-24, any summation order), the epilogue's multiply and bias add (2 u of |y| + |bias|), and for bf16
output one rounding (2^-8 relative covers it). Planted bugs (a decode that flushes subnormals, a dropped k tail,
a scale off by the 2^8 of the decode, a row of x read for another) are checked to miss that bound, so the bound
catches them. The fused residual is the separate add bit for bit, the thread count changes no bit, and the
builds without AVX-512 (the portable decode) meet the same bound.
"""
from __future__ import annotations

import ctypes
import re

import pytest
import torch

from kernels.cpu import load, load_error
from kernels.cpu.build import build
from kernels.cpu.fp8_gemm import fp8_dequantize, fp8_w8a16_applies, fp8_w8a16_gemm
from kernels.cpu.interface import declare

U = 2.0**-24
FP8 = torch.float8_e4m3fn
# (m, n, k): rows across the kernel's group of 8 and its remainders, k across the 32-code step and the masked tail
SHAPES = [(1, 1, 1), (1, 7, 5), (2, 13, 31), (3, 9, 32), (5, 17, 100), (8, 33, 48), (9, 5, 129), (13, 24, 70),
          (1, 300, 576), (4, 64, 200)]
CODES = torch.arange(256, dtype=torch.int32).to(torch.uint8)


def _libs() -> list[ctypes.CDLL | None]:
    portable = ctypes.CDLL(str(build(("-mno-avx512f",))))
    declare(portable)
    return [None, portable]  # None: the default (native) build


def _weight(n: int, k: int, g: torch.Generator) -> torch.Tensor:
    """Random finite codes over e4m3's whole range: subnormals, zeros of both signs, 448."""
    codes = torch.randint(0, 256, (n, k), generator=g, dtype=torch.int32)
    codes = torch.where((codes & 0x7F) == 0x7F, codes - 1, codes)  # no NaN codes
    return codes.to(torch.uint8).view(FP8)


def _inputs(m: int, n: int, k: int, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(dtype)
    q, scale = _weight(n, k, g), torch.rand(n, generator=g) * 1e-2 + 1e-4
    return x, q, scale, torch.randn(n, generator=g).to(dtype), torch.randn(m, n, generator=g).to(dtype)


def _excess(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> float:
    """How far past the bound the output lies (<= 0: within); w the float64 weight the kernel should use."""
    exact = x.double() @ w.T + (0 if b is None else b.double())
    bias = 0 if b is None else b.double().abs()
    bound = (x.shape[1] + 2) * U * (x.double().abs() @ w.abs().T) + 2 * U * (exact.abs() + bias)
    if got.dtype == torch.bfloat16:
        bound = bound + 2.0**-8 * exact.abs()
    return float(((got.double() - exact).abs() - bound).max()) if exact.numel() else 0.0


def _w64(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return q.double() * scale.double()[:, None]


def test_the_library_builds() -> None:
    assert load() is not None, f"the C kernels did not build: {load_error()}"


@pytest.mark.parametrize("lib", _libs(), ids=["native", "portable"])
def test_every_code_decodes_as_torch_does_bit_for_bit(lib) -> None:
    want = CODES.view(FP8).float()
    got = fp8_dequantize(CODES.reshape(1, 256), torch.ones(1), torch.float32, lib=lib)[0]
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))  # NaN codes 0x7f, 0xff: torch's NaN bits
    got16 = fp8_dequantize(CODES.reshape(1, 256), torch.ones(1), torch.bfloat16, lib=lib)[0]
    finite = (CODES & 0x7F) != 0x7F
    assert torch.equal(got16[finite].view(torch.int16), want[finite].bfloat16().view(torch.int16))  # e4m3 fits bf16
    assert bool(got16[~finite].isnan().all())


@pytest.mark.parametrize("lib", _libs(), ids=["native", "portable"])
def test_dequantize_rounds_q_times_scale_once(lib) -> None:
    g = torch.Generator().manual_seed(1)
    q, scale = _weight(37, 45, g), torch.rand(37, generator=g) + 0.1
    exact = _w64(q, scale)
    assert torch.equal(fp8_dequantize(q, scale, torch.float32, lib=lib), exact.float())
    assert torch.equal(fp8_dequantize(q, scale, torch.bfloat16, lib=lib), exact.float().bfloat16())


@pytest.mark.parametrize("lib", _libs(), ids=["native", "portable"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_the_float64_product(lib, dtype) -> None:
    for m, n, k in SHAPES:
        x, q, scale, b, _ = _inputs(m, n, k, dtype, seed=m * n + k)
        w = _w64(q, scale)
        assert _excess(fp8_w8a16_gemm(x, q, scale, b, lib=lib), x, w, b) <= 0, (m, n, k)
        got = fp8_w8a16_gemm(x, q, scale, lib=lib)
        assert got.dtype == dtype and got.shape == (m, n) and _excess(got, x, w, None) <= 0, (m, n, k)


def test_planted_bugs_miss_the_bound() -> None:
    """Outputs of plausible wrong kernels (computed in float64) fall outside the bound the tests use."""
    x, q, scale, b, _ = _inputs(9, 40, 130, torch.float32, seed=3)
    w = _w64(q, scale)
    sub = (q.float().abs() < 2.0**-6) & (q.float() != 0)
    assert int(sub.sum()) > 0
    planted = {
        "subnormals flushed": x.double() @ torch.where(sub, 0.0, w).T,
        "k tail dropped": x.double()[:, :128] @ w[:, :128].T,
        "scale missing the decode's 2^8": x.double() @ (w / 256).T,
        "row 8 reads row 0": torch.cat([x.double()[:8], x.double()[:1]]) @ w.T,
    }
    for name, wrong in planted.items():
        assert _excess(wrong + b.double(), x, w, b) > 0, name
    assert _excess(x.double() @ w.T + b.double(), x, w, b) <= 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_fused_residual_is_the_separate_add_bit_for_bit(dtype) -> None:
    for m, n, k in SHAPES:
        x, q, scale, b, res = _inputs(m, n, k, dtype, seed=k)
        assert torch.equal(fp8_w8a16_gemm(x, q, scale, b, res), res + fp8_w8a16_gemm(x, q, scale, b)), (m, n, k)


def test_strided_rows_and_the_thread_count() -> None:
    x, q, scale, b, res = _inputs(3, 200, 300, torch.bfloat16)
    wide = torch.randn(3, 360).bfloat16()
    wide[:, 20:320] = x
    assert torch.equal(fp8_w8a16_gemm(wide[:, 20:320], q, scale, b), fp8_w8a16_gemm(x, q, scale, b))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = fp8_w8a16_gemm(x, q, scale, b, res)
        torch.set_num_threads(2)
        two = fp8_w8a16_gemm(x, q, scale, b, res)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)


def test_no_rows_give_an_empty_output() -> None:
    x, q, scale, b, _ = _inputs(1, 8, 16, torch.float32)
    assert fp8_w8a16_gemm(x[:0], q, scale, b).shape == (0, 8)


def test_bad_inputs_are_refused_with_the_parameter_named() -> None:
    x, q, s, b, res = _inputs(2, 8, 16, torch.float32)
    for args, named in [((x, q[:, :15], s), "weight must be [n, 16]"),
                        ((x, q.float(), s), "weight must be float8_e4m3fn"),
                        ((x.double(), q, s), "x must be fp32 or bf16"),
                        ((x, q, s[:7]), "scale must be fp32 [8]"), ((x, q, s.double()), "scale must be fp32 [8]"),
                        ((x, q, s, b[:7]), "bias must be [8]"), ((x, q, s, b, res[:1]), "residual must be [2, 8]"),
                        ((x, q, s, b.bfloat16()), "bias must be x's dtype"), ((x[0], q, s), "x must be [m, k]")]:
        with pytest.raises(ValueError, match=re.escape(f"fp8_w8a16_gemm: {named}")):
            fp8_w8a16_gemm(*args)
    with pytest.raises(ValueError, match=r"fp8_dequantize: q must be float8_e4m3fn"):
        fp8_dequantize(q.float(), s, torch.float32)
    assert fp8_w8a16_applies(x, q) and not fp8_w8a16_applies(x.half(), q) and not fp8_w8a16_applies(x, q.float())
