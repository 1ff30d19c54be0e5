"""kernels.cpu.fp8_gemm: weight-only fp8 (W8A16) in C, and its dequantize.

Oracles: torch's own float8_e4m3fn -> fp32 conversion for every one of the 256 codes, bit for bit (NaN codes
included); for the GEMM the float64 product of x and the exactly decoded weight times its fp32 scale. A correct
kernel's only error is its fp32 arithmetic: each product x * (q 2^-8) and the sum, at most (k + 2) u sum |x w|
(u = 2^-24, any summation order), the epilogue's multiply and bias add (2 u of |y| + |bias|), and for bf16
output one rounding (2^-8 relative covers it). Planted bugs (a decode that flushes subnormals, a dropped k tail,
a scale off by the 2^8 of the decode, a row of x read for another) are checked to miss that bound, so the bound
catches them. The fused residual is the separate add bit for bit, the thread count changes no bit, and the
builds without AVX-512 (the portable decode) meet the same bound.

The packed kernel (`fp8_w8a16_packed_gemm`, bf16 x on vdpbf16ps against `fp8_pack`'s layout): every finite code
decodes to its exact value (x the identity, scale 1: the output is the code's value, which bf16 holds), through
its row groups of 8 and their remainders, and the two NaN codes to NaN. Its bound is the one above: each e4m3 x
bf16 product is exact in fp32 (8 x 8 significant bits), each lane adds its k products one at a time in fp32
(k u sum |x w|), then acc * scale + bias in one fused multiply-add and one rounding to bf16. Planted
bugs of its own (subnormals off by a factor 2, the sign dropped, an odd k's last pair or the n tail's rows in a
half block dropped, the scale of the wrong block) miss that bound, and the same bugs planted in its C source (and
the two halves of a k pair swapped) fail these tests. NaN codes never occur in the layers' weights (saturating
quantization) nor in the tests' random ones.
"""
from __future__ import annotations

import ctypes
import re

import pytest
import torch

from kernels.cpu import load, load_error
from kernels.cpu.build import build
from kernels.cpu.fp8_gemm import (fp8_dequantize, fp8_pack, fp8_unpack, fp8_w8a16_applies,
                                  fp8_w8a16_gemm, fp8_w8a16_packed_gemm)
from kernels.cpu.interface import declare
from kernels.cpu.packed_gemm import packed_gemm_native
from planted_c import assert_each_bug_caught

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


# (m, n, k) for the packed kernel: rows across its groups of 8 and their remainders, n across its 16-lane halves
# and 32-row blocks, k odd and even
PACKED_SHAPES = [(1, 1, 1), (1, 7, 5), (2, 13, 31), (3, 33, 32), (8, 17, 100), (9, 48, 129), (13, 24, 70),
                 (17, 65, 33), (1, 300, 576), (32, 64, 200)]
FINITE = CODES[(CODES & 0x7F) != 0x7F]


def _packed_libs() -> list[ctypes.CDLL | None]:
    return [None, _libs()[1]]


@pytest.mark.parametrize("lib", _packed_libs(), ids=["native", "portable"])
def test_packed_every_finite_code_decodes_exactly(lib) -> None:
    """x the identity: row r of the output is code r's value (q [3, 254]: three blocks' lanes read the codes)."""
    q = torch.stack([FINITE, FINITE.flip(0), FINITE.roll(7)]).view(FP8)
    want = (q.float().T + 0.0).bfloat16()  # exact: e4m3 values are bf16 values (-0 sums to +0 from a +0 start)
    eye = torch.eye(len(FINITE)).bfloat16()
    packed = fp8_pack(q)
    assert torch.equal(fp8_w8a16_packed_gemm(eye, packed, torch.ones(3), lib=lib).view(torch.int16),
                       want.view(torch.int16))  # 254 rows: 31 groups of 8 and one of 6
    for r0 in range(0, len(FINITE), 8):  # one group at a time
        got = fp8_w8a16_packed_gemm(eye[r0:r0 + 8], packed, torch.ones(3), lib=lib)
        assert torch.equal(got.view(torch.int16), want[r0:r0 + 8].view(torch.int16)), r0
    nan = torch.tensor([[0x7F, 0x38], [0x38, 0xFF]], dtype=torch.uint8).view(FP8)  # NaN codes beside 1.0
    got = fp8_w8a16_packed_gemm(torch.ones(1, 2).bfloat16(), fp8_pack(nan), torch.ones(2), lib=lib)
    assert bool(got.isnan().all())


def test_pack_is_a_permutation_of_the_codes() -> None:
    q = _weight(37, 45, torch.Generator().manual_seed(2))
    packed = fp8_pack(q)
    assert packed.shape == (2, 23, 64) and packed.dtype == FP8
    j, i = torch.meshgrid(torch.arange(37), torch.arange(45), indexing="ij")
    logical = 2 * (j % 32) + i % 2  # row j's code for k = i, in the byte order of the C kernel's `slot`
    where = torch.where(logical < 32, 16 * (logical // 8) + logical % 8, 16 * ((logical - 32) // 8) + 8 + logical % 8)
    assert sorted(where[:32, :2].flatten().tolist()) == list(range(64))
    assert torch.equal(packed.view(torch.uint8)[j // 32, i // 2, where], q.view(torch.uint8))
    assert int(packed.view(torch.uint8).sum()) == int(q.view(torch.uint8).sum())  # the padding holds zero codes
    assert torch.equal(fp8_unpack(packed, 37, 45).view(torch.uint8), q.view(torch.uint8))


@pytest.mark.parametrize("lib", _packed_libs(), ids=["native", "portable"])
def test_packed_matches_the_float64_product(lib) -> None:
    for m, n, k in PACKED_SHAPES:
        x, q, scale, b, _ = _inputs(m, n, k, torch.bfloat16, seed=m * n + k)
        w, packed = _w64(q, scale), fp8_pack(q)
        assert _excess(fp8_w8a16_packed_gemm(x, packed, scale, b, lib=lib), x, w, b) <= 0, (m, n, k)
        got = fp8_w8a16_packed_gemm(x, packed, scale, lib=lib)
        assert got.dtype == torch.bfloat16 and got.shape == (m, n) and _excess(got, x, w, None) <= 0, (m, n, k)


def test_packed_planted_bugs_miss_the_bound() -> None:
    """Outputs of plausible wrong packed kernels (computed in float64) fall outside the bound the tests use."""
    x, q, scale, _, _ = _inputs(9, 56, 131, torch.bfloat16, seed=4)
    g = torch.Generator().manual_seed(5)  # rows 0-7 of zeros and subnormals only (a per-row scale makes them count)
    q[:8] = (torch.randint(0, 8, (8, 131), generator=g) | torch.randint(0, 2, (8, 131), generator=g) * 0x80
             ).to(torch.uint8).view(FP8)
    w = _w64(q, scale)
    codes = q.view(torch.uint8).long()
    sub = ((codes & 0x7F) < 8) & ((codes & 0x7F) > 0)
    assert int(sub.sum()) > 0
    planted = {
        "subnormals off by a factor 2": x.double() @ torch.where(sub, 2 * w, w).T,
        "sign dropped": x.double() @ w.abs().T,
        "odd k's last pair dropped": x.double()[:, :130] @ w[:, :130].T,
        "the n tail (8 rows in a half block) dropped": x.double() @ torch.cat([w[:48], 0 * w[48:]]).T,
        "scale of the wrong block": x.double() @ (q.double() * scale.roll(32).double()[:, None]).T,
    }
    for name, wrong in planted.items():  # no bias: it would hide the small subnormal rows under its rounding
        assert _excess(wrong.bfloat16(), x, w, None) > 0, name
    assert _excess((x.double() @ w.T).bfloat16(), x, w, None) <= 0


# bugs planted in the C source of the AVX512-BF16 path: (what, the line's text, its planted form)
PLANTED_C = [("subnormals off by a factor 2", "(float)mant / 512.0f", "(float)mant / 256.0f"),
             ("sign dropped", "_mm512_set1_epi8((char)0x80), 0xF8)", "_mm512_set1_epi8(0), 0xF8)"),
             ("the halves of a k pair swapped", "*w0 = _mm512_unpacklo_epi8(lo, hi);",
              "*w0 = _mm512_unpackhi_epi8(lo, hi);"),
             ("odd k's last pair dropped", "if (k & 1) pair_step", "if (0) pair_step"),
             ("n tail in a second half dropped", "if (c >= n) break;", "if (c >= n || (h && n - c < 16)) break;"),
             ("one scale for both halves", "(mask, a->scale + c)", "(mask, a->scale + n0)")]


@pytest.mark.skipif(not packed_gemm_native(), reason="the planted lines are in the AVX512-BF16 path")
def test_packed_planted_bugs_in_the_c_source_fail_these_tests(tmp_path) -> None:
    """Each bug compiled into packed_gemm.c alone (its one export) fails the exact decode or the float64 bound;
    the same file compiled as it is passes both."""
    assert_each_bug_caught(tmp_path, "packed_gemm.c", ["fp8_gemm_w8a16_packed"], PLANTED_C,
                           [test_packed_every_finite_code_decodes_exactly, test_packed_matches_the_float64_product])


def test_packed_fused_residual_strided_rows_and_the_thread_count() -> None:
    for m, n, k in PACKED_SHAPES:
        x, q, scale, b, res = _inputs(m, n, k, torch.bfloat16, seed=k)
        packed = fp8_pack(q)
        assert torch.equal(fp8_w8a16_packed_gemm(x, packed, scale, b, res),
                           res + fp8_w8a16_packed_gemm(x, packed, scale, b)), (m, n, k)
    x, q, scale, b, res = _inputs(12, 200, 301, torch.bfloat16)
    packed = fp8_pack(q)
    wide = torch.full((12, 360), float("nan")).bfloat16()  # NaN past the odd k: the tail must not read it
    wide[:, 20:321] = x
    assert torch.equal(fp8_w8a16_packed_gemm(wide[:, 20:321], packed, scale, b),
                       fp8_w8a16_packed_gemm(x, packed, scale, b))
    assert torch.equal(fp8_w8a16_packed_gemm(wide[:3, 20:321], packed, scale, b),
                       fp8_w8a16_packed_gemm(x[:3], packed, scale, b))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = [fp8_w8a16_packed_gemm(x[:r], packed, scale, b, res[:r]) for r in (3, 12)]
        torch.set_num_threads(2)
        two = [fp8_w8a16_packed_gemm(x[:r], packed, scale, b, res[:r]) for r in (3, 12)]
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(a, c) for a, c in zip(one, two))


def test_packed_bad_inputs_are_refused_with_the_parameter_named() -> None:
    x, q, s, b, res = _inputs(2, 8, 16, torch.bfloat16)
    p = fp8_pack(q)
    for args, named in [((x.float(), p, s), "x must be bf16"), ((x, q, s), "packed must be fp8_pack's"),
                        ((x[:, :14], p, s), "packed must be fp8_pack's"),
                        ((x, p, torch.ones(33)), "packed must be fp8_pack's"),
                        ((x, p, s.double()), "scale must be fp32 [8]"),
                        ((x, p, s, b[:7]), "bias must be [8]"), ((x, p, s, b, res[:1]), "residual must be [2, 8]")]:
        with pytest.raises(ValueError, match=re.escape(f"fp8_w8a16_packed_gemm: {named}")):
            fp8_w8a16_packed_gemm(*args)
    with pytest.raises(ValueError, match="fp8_pack: q must be float8_e4m3fn"):
        fp8_pack(q.float())
    assert not _libs()[1].packed_gemm_native(1) and not load().packed_gemm_native(0)
