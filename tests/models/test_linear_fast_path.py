"""The dense `Linear`'s CPU fast paths at fp32 and bf16, against float64: oneDNN with a prepacked weight, and
for a few rows (up to `SKINNY_MAX_ROWS`) `kernels.cpu.skinny_gemm` on the unpacked weight.

bf16 takes the packed path only where oneDNN runs bf16 natively (AVX512-BF16, AMX); elsewhere these tests
check `F.linear`, the fallback. On AVX512-BF16 without AMX the packed copy is `bf16_pack`'s and the rows run
`kernels.cpu.packed_gemm` instead of oneDNN, under the same bounds. Tolerance: the product is accumulated in fp32 (gamma_K ~ K u32 of
sum |x| |w|, Higham 3.1) and rounded once to the output dtype (u_out of |y|, u_bf16 = 2^-8)."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from engine_core.models.linear import Linear
from engine_core.models.quantization.unquantized import bf16_packed_applies, onednn_bf16_available
from kernels.cpu.packed_gemm import bf16_pack, bf16_packed_gemm
from kernels.cpu.skinny_gemm import SKINNY_MAX_ROWS

U32, U_BF16 = 2.0 ** -24, 2.0 ** -8


def _layer(n: int, k: int, dtype: torch.dtype, bias: bool, gen: torch.Generator) -> Linear:
    w = nn.Parameter((torch.randn(n, k, generator=gen) / k**0.5).to(dtype), requires_grad=False)
    b = nn.Parameter(torch.randn(n, generator=gen).to(dtype), requires_grad=False) if bias else None
    return Linear(w, b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 7, 64])
def test_linear_matches_float64(dtype: torch.dtype, rows: int) -> None:
    gen = torch.Generator().manual_seed(rows)
    n, k = 96, 160
    lin = _layer(n, k, dtype, True, gen)
    x = torch.randn(rows, k, generator=gen).to(dtype)
    y = lin(x)
    assert y.dtype == dtype and y.shape == (rows, n)
    ref = x.double() @ lin.weight.double().t() + lin.bias.double()
    u_out = U32 if dtype == torch.float32 else U_BF16
    tol = u_out * ref.abs() + (1 + u_out) * (k + 2) * U32 * (x.double().abs() @ lin.weight.double().abs().t()
                                                             + lin.bias.double().abs())
    err = (y.double() - ref).abs()
    assert (err <= tol).all(), f"max err {err.max():.3g}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [2, 8])
def test_residual(dtype: torch.dtype, rows: int) -> None:
    """bf16 adds the residual after the GEMM's rounding (Hugging Face's two roundings): exactly residual + y.
    fp32 fuses it into the GEMM (one rounding of y + residual instead of two): within u32 of that sum."""
    gen = torch.Generator().manual_seed(1)
    lin = _layer(64, 96, dtype, False, gen)
    x, residual = torch.randn(rows, 96, generator=gen).to(dtype), torch.randn(rows, 64, generator=gen).to(dtype)
    fused, plain = lin(x, residual), residual + lin(x)
    if dtype == torch.bfloat16:
        assert torch.equal(fused, plain)
    else:
        assert ((fused - plain).abs() <= 2 * U32 * plain.abs()).all()


def test_bf16_takes_the_packed_path_where_onednn_has_bf16() -> None:
    lin = _layer(32, 64, torch.bfloat16, False, torch.Generator().manual_seed(0))
    lin(torch.randn(SKINNY_MAX_ROWS[torch.bfloat16] + 1, 64).bfloat16())
    assert (lin._packed is not None) == onednn_bf16_available()


def test_bf16_runs_the_packed_kernel_on_avx512_bf16_without_amx() -> None:
    """There the copy is bf16_pack's (oneDNN's is never made) and the output is the kernel's, bias and residual
    included; elsewhere the copy is oneDNN's."""
    gen = torch.Generator().manual_seed(2)
    lin = _layer(40, 67, torch.bfloat16, True, gen)
    x, residual = torch.randn(13, 67, generator=gen).bfloat16(), torch.randn(13, 40, generator=gen).bfloat16()
    y = lin(x, residual)
    if bf16_packed_applies():
        assert lin._packed.shape == (2, 34, 32, 2) and torch.equal(lin._packed, bf16_pack(lin.weight))
        assert torch.equal(y, bf16_packed_gemm(x, bf16_pack(lin.weight), 40, lin.bias, residual))
    else:
        assert lin._packed is None or lin._packed.shape != (2, 34, 32, 2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_few_rows_read_the_unpacked_weight(dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    """Up to SKINNY_MAX_ROWS rows go to the skinny kernel (no packed copy is made); one row more to oneDNN."""
    import engine_core.models.quantization.unquantized as unquantized
    calls = []
    monkeypatch.setattr(unquantized, "skinny_gemm", lambda *a, **kw: calls.append(a[0].shape[0]) or a[0] @ a[1].T)
    lin = _layer(32, 64, dtype, False, torch.Generator().manual_seed(0))
    lin(torch.randn(SKINNY_MAX_ROWS[dtype], 64).to(dtype))
    assert calls == [SKINNY_MAX_ROWS[dtype]] and lin._packed is None
    lin(torch.randn(SKINNY_MAX_ROWS[dtype] + 1, 64).to(dtype))
    assert calls == [SKINNY_MAX_ROWS[dtype]]


@pytest.mark.parametrize("rows", [2, 8])
def test_a_weight_changed_in_place_is_repacked(rows: int) -> None:
    """A merged LoRA adapter changes the weight in place: the packed copy must follow (Tensor._version), and the
    skinny path reads the weight itself. Doubling the weight doubles every product and sum exactly, so the
    output doubles exactly."""
    lin = _layer(32, 64, torch.bfloat16, False, torch.Generator().manual_seed(0))
    x = torch.randn(rows, 64, generator=torch.Generator().manual_seed(1)).bfloat16()
    before = lin(x)
    lin.weight.mul_(2)
    assert torch.equal(lin(x), 2 * before)
