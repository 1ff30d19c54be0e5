"""kernels.cpu.packed_gemm: the bf16 GEMM on AVX512-BF16 dot products against a weight packed in 32-row blocks.

Oracle: the float64 product. A correct kernel's only error is its fp32 arithmetic: each bf16 x bf16 product is
exact in fp32 (8 x 8 significant bits) and each lane adds its k products one at a time (k u sum |x w|, u = 2^-24),
then + bias in fp32 (u of |y| + |bias|) and one rounding to bf16 (2^-8 relative covers it). The residual is
`residual + y` bit for bit (rounded, added, rounded again), the thread count changes no bit, and the portable build
(no AVX-512: the scalar reference over the same layout) meets the same bound. Shapes cross the kernel's row groups
of 8 and their remainders, an odd k's last pair and n's tails inside a 32-row block and its second 16-row half.
Planted bugs, modelled in float64 and compiled into csrc/packed_gemm.c, miss the bound.
"""
from __future__ import annotations

import ctypes
import re

import pytest
import torch

from kernels.cpu import load
from kernels.cpu.build import build
from kernels.cpu.interface import declare
from planted_c import assert_each_bug_caught
from kernels.cpu.packed_gemm import PACK_BLOCK, bf16_pack, bf16_packed_gemm, packed_gemm_native

U = 2.0**-24
# (m, n, k): rows across the group of 8 and its remainders, n across 16 / 32, k odd and even
SHAPES = [(1, 1, 1), (1, 7, 5), (2, 13, 31), (3, 33, 32), (5, 17, 100), (8, 48, 129), (9, 24, 70), (13, 65, 33),
          (17, 300, 64), (32, 64, 200), (33, 40, 11)]


def _libs() -> list[ctypes.CDLL | None]:
    portable = ctypes.CDLL(str(build(("-mno-avx512f",))))
    declare(portable)
    return [None, portable]  # None: the default (native) build


def _inputs(m: int, n: int, k: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).bfloat16()
    w = (torch.randn(n, k, generator=g) * torch.logspace(-3, 1, k)).bfloat16()  # magnitudes over 4 decades
    return x, w, torch.randn(n, generator=g).bfloat16(), torch.randn(m, n, generator=g).bfloat16()


def _excess(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> float:
    """How far past the bound the output lies (<= 0: within)."""
    exact = x.double() @ w.double().T + (0 if b is None else b.double())
    bias = 0 if b is None else b.double().abs()
    bound = ((x.shape[1] + 2) * U * (x.double().abs() @ w.double().abs().T) + 2 * U * (exact.abs() + bias)
             + 2.0**-8 * exact.abs())
    return float(((got.double() - exact).abs() - bound).max()) if exact.numel() else 0.0


def test_pack_places_each_weight_in_its_block_pair_and_lane() -> None:
    w = torch.randn(37, 45, generator=torch.Generator().manual_seed(3)).bfloat16()
    packed = bf16_pack(w)
    assert packed.shape == (2, 23, PACK_BLOCK, 2) and packed.dtype == torch.bfloat16 and packed.is_contiguous()
    j, i = torch.meshgrid(torch.arange(37), torch.arange(45), indexing="ij")
    assert torch.equal(packed[j // 32, i // 2, j % 32, i % 2], w)
    assert int((packed != 0).sum()) == int((w != 0).sum())  # the padding holds zeros


@pytest.mark.parametrize("lib", _libs(), ids=["native", "portable"])
def test_matches_the_float64_product(lib) -> None:
    for m, n, k in SHAPES:
        x, w, b, _ = _inputs(m, n, k, seed=m + n + k)
        packed = bf16_pack(w)
        assert _excess(bf16_packed_gemm(x, packed, n, lib=lib), x, w, None) <= 0, (m, n, k)
        assert _excess(bf16_packed_gemm(x, packed, n, b, lib=lib), x, w, b) <= 0, (m, n, k, "bias")


@pytest.mark.parametrize("lib", _libs(), ids=["native", "portable"])
def test_each_output_is_its_own_row_and_column(lib) -> None:
    """x one-hot rows pick weight columns exactly (one product, no rounding): every output lands in its (row, n)
    place, every weight is read from its place in the packed layout, rows of all group sizes."""
    n, k = 70, 45
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(5)).bfloat16()
    packed = bf16_pack(w)
    for m in (1, 7, 8, 9, 45):
        cols = torch.arange(m) * 7 % k
        x = torch.nn.functional.one_hot(cols, k).bfloat16()
        assert torch.equal(bf16_packed_gemm(x, packed, n, lib=lib), w[:, cols].T.contiguous()), m


def test_fused_residual_strided_rows_and_the_thread_count() -> None:
    for m, n, k in SHAPES:
        x, w, b, res = _inputs(m, n, k, seed=k)
        packed = bf16_pack(w)
        assert torch.equal(bf16_packed_gemm(x, packed, n, b, res), res + bf16_packed_gemm(x, packed, n, b)), (m, n, k)
    x, w, b, res = _inputs(12, 200, 301)
    packed = bf16_pack(w)
    wide = torch.full((12, 360), float("nan")).bfloat16()  # NaN past the odd k: the tail must not read it
    wide[:, 20:321] = x
    assert torch.equal(bf16_packed_gemm(wide[:, 20:321], packed, 200, b), bf16_packed_gemm(x, packed, 200, b))
    res_wide = torch.randn(12, 230).bfloat16()
    assert torch.equal(bf16_packed_gemm(x, packed, 200, b, res_wide[:, 30:]),
                       res_wide[:, 30:] + bf16_packed_gemm(x, packed, 200, b))
    threads = torch.get_num_threads()
    big = _inputs(40, 512, 1536)  # past the kernel's threading threshold
    big_packed = bf16_pack(big[1])
    try:
        torch.set_num_threads(1)
        one = [bf16_packed_gemm(x[:r], packed, 200, b, res[:r]) for r in (3, 12)]
        one.append(bf16_packed_gemm(big[0], big_packed, 512, big[2], big[3]))
        torch.set_num_threads(2)
        two = [bf16_packed_gemm(x[:r], packed, 200, b, res[:r]) for r in (3, 12)]
        two.append(bf16_packed_gemm(big[0], big_packed, 512, big[2], big[3]))
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(a, c) for a, c in zip(one, two))


def test_bad_inputs_are_refused_with_the_parameter_named() -> None:
    x, w, b, res = _inputs(2, 8, 16)
    p = bf16_pack(w)
    for args, named in [((x.float(), p, 8), "x must be bf16 [m, k]"), ((x[0], p, 8), "x must be bf16 [m, k]"),
                        ((x, w, 8), "packed must be bf16_pack's bf16 [1, 8, 32, 2]"),
                        ((x[:, :14], p, 8), "packed must be bf16_pack's"), ((x, p, 33), "packed must be bf16_pack's"),
                        ((x, p.float(), 8), "packed must be bf16_pack's"),
                        ((x.t().contiguous().t(), p, 8), "x must be [m, k] with its last dimension contiguous"),
                        ((x, p, 8, b[:7]), "bias must be [8]"), ((x, p, 8, b, res[:1]), "residual must be [2, 8]"),
                        ((x, p, 8, b.float()), "bias must be x's dtype")]:
        with pytest.raises(ValueError, match=re.escape(f"bf16_packed_gemm: {named}")):
            bf16_packed_gemm(*args)
    with pytest.raises(ValueError, match=re.escape("bf16_pack: w must be bf16 [n, k]")):
        bf16_pack(w.float())
    assert packed_gemm_native() == (load() is not None and bool(load().packed_gemm_native(1)))


def test_planted_bugs_miss_the_bound() -> None:
    """The bound is tight enough to catch each bug, modelled in float64 (no kernel involved)."""
    x, w, b, _ = _inputs(13, 65, 33, seed=4)
    xd, wd, bd = x.double(), w.double(), b.double()
    no_tail, no_half = wd.clone(), wd.clone()
    no_tail[:, -1] = 0
    no_half[48:] = 0
    pairs_swapped = [i ^ 1 for i in range(32)] + [32]  # k = 33: 16 pairs and the odd k alone
    halves_swapped = [(r + 16) % 32 + 32 * (r // 32) if r < 64 else r for r in range(65)]
    planted = {
        "odd k's last pair dropped": xd @ no_tail.T + bd,
        "n tail in a second half dropped": xd @ no_half.T + bd,
        "a row of x read for another": xd.roll(1, 0) @ wd.T + bd,
        "the two weights of a k pair swapped": xd[:, pairs_swapped] @ wd.T + bd,
        "the two halves of a block swapped": xd @ wd[halves_swapped].T + bd,
        "bias dropped": xd @ wd.T,
    }
    for name, wrong in planted.items():
        assert _excess(wrong.bfloat16(), x, w, b) > 0, name
    assert _excess((xd @ wd.T + bd).bfloat16(), x, w, b) <= 0


# bugs planted in the C source: (what, the line's text, its planted form)
PLANTED_C = [("odd k's last pair dropped", "if (k & 1) pair_step", "if (0) pair_step"),
             ("n tail in a second half dropped", "if (c >= n) break;", "if (c >= n || (h && n - c < 16)) break;"),
             ("the two halves of a block swapped", "w1 = _mm512_loadu_si512((const bf16_t *)w + p * 64 + 32);",
              "w1 = _mm512_loadu_si512((const bf16_t *)w + p * 64);"),
             ("bias dropped", ": _mm512_add_ps(acc[r][h], b)", ": acc[r][h]"),
             ("a remainder group's last row dropped", "const int rows = m - r0 < ROWS ? (int)(m - r0) : ROWS;",
              "const int rows = m - r0 < ROWS ? (int)(m - r0) - (m - r0 > 1) : ROWS;"),
             ("the next block read from the fp8 offset", "const int64_t block_bytes = pairs * 64 * (fp8 ? 1 : 2);",
              "const int64_t block_bytes = pairs * 64;")]


@pytest.mark.skipif(not packed_gemm_native(), reason="the planted lines are in the AVX512-BF16 path")
def test_planted_bugs_in_the_c_source_fail_these_tests(tmp_path) -> None:
    """Each bug compiled into packed_gemm.c alone (its exports) fails the float64 bound or the placement test;
    the same file compiled as it is passes both."""
    assert_each_bug_caught(tmp_path, "packed_gemm.c", ["bf16_gemm_packed"], PLANTED_C,
                           [test_matches_the_float64_product, test_each_output_is_its_own_row_and_column])
