"""The dense `Linear`'s CPU fast path (oneDNN with a prepacked weight) at fp32 and bf16, against float64.

bf16 takes the packed path only where oneDNN runs bf16 natively (AVX512-BF16, AMX); elsewhere these tests
check `F.linear`, the fallback. Tolerance: the product is accumulated in fp32 (gamma_K ~ K u32 of
sum |x| |w|, Higham 3.1) and rounded once to the output dtype (u_out of |y|, u_bf16 = 2^-8)."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from engine_core.models.linear import Linear
from engine_core.models.quantization.unquantized import onednn_bf16_available

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
def test_residual(dtype: torch.dtype) -> None:
    """bf16 adds the residual after the GEMM's rounding (Hugging Face's two roundings): exactly residual + y.
    fp32 fuses it into the GEMM (one rounding of y + residual instead of two): within u32 of that sum."""
    gen = torch.Generator().manual_seed(1)
    lin = _layer(64, 96, dtype, False, gen)
    x, residual = torch.randn(3, 96, generator=gen).to(dtype), torch.randn(3, 64, generator=gen).to(dtype)
    fused, plain = lin(x, residual), residual + lin(x)
    if dtype == torch.bfloat16:
        assert torch.equal(fused, plain)
    else:
        assert ((fused - plain).abs() <= 2 * U32 * plain.abs()).all()


def test_bf16_takes_the_packed_path_where_onednn_has_bf16() -> None:
    lin = _layer(32, 64, torch.bfloat16, False, torch.Generator().manual_seed(0))
    lin(torch.randn(2, 64).bfloat16())
    assert (lin._packed is not None) == onednn_bf16_available()


def test_a_weight_changed_in_place_is_repacked() -> None:
    """A merged LoRA adapter changes the weight in place: the packed copy must follow (Tensor._version).
    Doubling the weight doubles every product and sum exactly, so the output doubles exactly."""
    lin = _layer(32, 64, torch.bfloat16, False, torch.Generator().manual_seed(0))
    x = torch.randn(2, 64, generator=torch.Generator().manual_seed(1)).bfloat16()
    before = lin(x)
    lin.weight.mul_(2)
    assert torch.equal(lin(x), 2 * before)
