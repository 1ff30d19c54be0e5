"""`quantization="fp8"` on CPU is weight-only (W8A16): the C kernel (kernels.cpu.fp8_gemm) up to FP8_KERNEL_MAX_ROWS
rows, the weight dequantized to x's dtype and x's own GEMM above, never `torch._scaled_mm` (224 ms a call on
SmolLM2, issue 46). Both sides of the crossover against the float64 product of x and the fp8 weight: the kernel's
error is its fp32 arithmetic ((k + 4) u sum |x w|); the dequantized path adds one rounding of each weight to x's
dtype (u in fp32, 2^-9 in bf16: 2^-9 sum |x w|) and, in bf16, the output's rounding (2^-8 |y|)."""
from __future__ import annotations

import pytest
import torch
from engine_helpers import one_torch_thread
from torch import nn

from engine_core.models.linear import Linear
from engine_core.models.quantization import Fp8LinearMethod, fp8
from engine_core.models.quantization.fp8 import FP8_KERNEL_MAX_ROWS

U = 2.0**-24
pytestmark = pytest.mark.usefixtures(one_torch_thread.__name__)


def _layer(dtype: torch.dtype, n: int = 40, k: int = 96) -> Linear:
    g = torch.Generator().manual_seed(0)
    w, b = torch.randn(n, k, generator=g).to(dtype), torch.randn(n, generator=g).to(dtype)
    return Linear(nn.Parameter(w, requires_grad=False), nn.Parameter(b, requires_grad=False),
                  Fp8LinearMethod([16, n - 16], "channel", "token"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, FP8_KERNEL_MAX_ROWS, FP8_KERNEL_MAX_ROWS + 1, 3 * FP8_KERNEL_MAX_ROWS])
def test_both_sides_of_the_crossover_match_the_float64_weight_only_product(monkeypatch, dtype, rows) -> None:
    calls = {"kernel": 0, "dequantize": 0}
    for name in ("fp8_w8a16_gemm", "fp8_dequantize"):
        real = getattr(fp8, name)

        def counted(*a, _real=real, _key="kernel" if name == "fp8_w8a16_gemm" else "dequantize", **kw):
            calls[_key] += 1
            return _real(*a, **kw)

        monkeypatch.setattr(fp8, name, counted)
    monkeypatch.setattr(torch, "_scaled_mm", lambda *a, **kw: pytest.fail("_scaled_mm called on CPU"))
    layer = _layer(dtype)
    x = torch.randn(rows, 96, generator=torch.Generator().manual_seed(rows)).to(dtype)
    res = torch.randn(rows, 40).to(dtype)
    got = layer(x, res)
    assert calls == ({"kernel": 1, "dequantize": 0} if rows <= FP8_KERNEL_MAX_ROWS else {"kernel": 0, "dequantize": 1})
    w = layer.quant_method.dequantized_weight(layer).double()  # q * scale, exactly
    y = x.double() @ w.T + layer.bias.double()
    mags = x.double().abs() @ w.abs().T
    tol = (96 + 4) * U * mags + 2 * U * layer.bias.double().abs()
    if rows > FP8_KERNEL_MAX_ROWS:
        tol = tol + (2.0**-9 if dtype == torch.bfloat16 else U) * mags
    if dtype == torch.bfloat16:  # the output rounded after the bias, the residual added and rounded again
        tol = tol + 2.0**-8 * y.abs() + 2.0**-8 * (y + res.double()).abs()
    err = (got.double() - (y + res.double())).abs()
    assert got.dtype == dtype and bool((err <= tol).all()), float((err - tol).max())


def test_3d_rows_and_no_rows() -> None:
    layer = _layer(torch.bfloat16)
    x = torch.randn(2, 3, 96).bfloat16()
    assert torch.equal(layer(x), layer(x.reshape(6, 96)).reshape(2, 3, 40))
    assert layer(torch.zeros(0, 96).bfloat16()).shape == (0, 40)
