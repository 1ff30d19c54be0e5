"""The integer fp8 conversions of the Triton kernels (GPUs without fp8 instructions: T4, A100, A10G; the
interpreter) are torch's float8 casts bit for bit: all 256 codes of each format decoded, and fp32 encoded at
every rounding case (binade edges, ties to even, subnormals, saturation, NaN, signed zero). Under the
interpreter on CPU; compiled on a GPU (where the native conversion is checked against the same oracle)."""
from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from kernels.fp8 import fp8_conversion, native_fp8
from kernels.triton._common import f32_to_fp8_bits, fp8_bits_to_f32

FORMATS = [torch.float8_e4m3fn, torch.float8_e5m2]


@triton.jit
def _decode(b_ptr, out_ptr, n, E5M2: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(out_ptr + i, fp8_bits_to_f32(tl.load(b_ptr + i, mask=i < n), E5M2), mask=i < n)


@triton.jit
def _encode(x_ptr, out_ptr, n, E5M2: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(out_ptr + i, f32_to_fp8_bits(tl.load(x_ptr + i, mask=i < n), E5M2), mask=i < n)


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.int32)


@pytest.mark.parametrize("fmt", FORMATS, ids=str)
def test_every_code_decodes_to_torchs_value(device: torch.device, fmt: torch.dtype) -> None:
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).to(device)
    out = torch.empty(256, device=device)
    _decode[(2,)](codes, out, 256, fmt == torch.float8_e5m2, BLOCK=128)
    want = codes.view(fmt).float()
    same = (_bits(out) == _bits(want)) | (out.isnan() & want.isnan())  # bits: -0.0 must stay -0.0
    bad = (~same).nonzero().flatten().tolist()
    assert not bad, f"{fmt}: codes {[hex(c) for c in bad[:8]]} decode to {out[bad[:8]].tolist()}, torch says " \
                    f"{want[bad[:8]].tolist()}"


def _encoding_cases(fmt: torch.dtype) -> torch.Tensor:
    """Every finite code's value and both signs; each midpoint between neighbours (a tie: rounds to the even
    code) and the floats just above and below it; binade edges of fp32 and of the format; subnormals; past
    the largest value; infinities, NaN, +-0, fp32 subnormals; and random values over the whole range."""
    values = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(fmt).float()
    finite = values[values.isfinite()].unique()
    mids = (finite[1:].double() + finite[:-1].double()).div(2).float()  # exact in fp32 (one more bit)
    up, down = torch.full_like(mids, float("inf")), torch.full_like(mids, -float("inf"))
    big = torch.finfo(fmt).max
    edges = torch.tensor([2.0 ** e for e in range(-30, 20)])
    gen = torch.Generator().manual_seed(0)
    special = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan"), -float("nan"), 1e-45, -1e-40,
                            big, big * 1.03, big * 1.07, big * 2, 1e30, -1e30, 464.0, 480.0, 61440.0, 65536.0])
    return torch.cat([finite, mids, mids.nextafter(up), mids.nextafter(down), edges, -edges, edges.nextafter(-edges),
                      torch.randn(2048, generator=gen) * big / 4, torch.randn(1024, generator=gen) * 2.0 ** -8,
                      special])


@pytest.mark.parametrize("fmt", FORMATS, ids=str)
def test_fp32_encodes_to_torchs_saturated_code(device: torch.device, fmt: torch.dtype) -> None:
    """What the cache write stores: torch's cast of x clamped to +-max (NaN stays NaN, with its sign)."""
    x = _encoding_cases(fmt).to(device)
    out = torch.empty(x.numel(), dtype=torch.uint8, device=device)
    _encode[(triton.cdiv(x.numel(), 1024),)](x, out, x.numel(), fmt == torch.float8_e5m2, BLOCK=1024)
    big = torch.finfo(fmt).max
    want = x.clamp(-big, big).to(fmt).view(torch.uint8)
    bad = (out != want).nonzero().flatten()[:8].tolist()
    assert not bad, (f"{fmt}: {x[bad].tolist()} encode to {[hex(c) for c in out[bad].tolist()]}, torch says "
                     f"{[hex(c) for c in want[bad].tolist()]}")
    assert want.view(fmt).float().isfinite().sum() > x.numel() - 10  # only the NaN inputs give NaN codes


def test_native_conversion_from_ada_on() -> None:
    """sm_89 (Ada) and sm_90 (Hopper) convert fp8 in hardware; the T4, A100 and A10G do not; CPU tensors
    (the interpreter) take the integer path."""
    assert [native_fp8(c) for c in ((7, 5), (8, 0), (8, 6), (8, 9), (9, 0), (12, 0))] == [False] * 3 + [True] * 3
    assert fp8_conversion(torch.device("cpu")) == "integer"
