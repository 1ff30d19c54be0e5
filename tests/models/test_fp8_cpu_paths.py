"""`quantization="fp8"` on CPU is weight-only (W8A16), never `torch._scaled_mm` (224 ms a call on SmolLM2, issue 46).
bf16 layers on AVX512-BF16 hold the weight packed (`fp8_pack`) and every batch runs the packed kernel; elsewhere
(fp32 layers, or packing switched off as on CPUs without AVX512-BF16) the fp32 C kernel up to FP8_KERNEL_MAX_ROWS
rows, the weight dequantized to x's dtype and x's own GEMM above. Every path against the float64 product of x and
the fp8 weight: the kernels' error is their fp32 arithmetic ((k + 4) u sum |x w|: e4m3 x bf16 products are exact
in fp32 on vdpbf16ps too); the dequantized path adds one rounding of each weight to x's dtype (u in fp32, 2^-9 in
bf16: 2^-9 sum |x w|) and, in bf16, the output's rounding (2^-8 |y|)."""
from __future__ import annotations

import pytest
import torch
from engine_helpers import one_torch_thread
from torch import nn

from engine_core.models.linear import Linear
from engine_core.models.quantization import Fp8LinearMethod, fp8
from engine_core.models.quantization.fp8 import FP8_KERNEL_MAX_ROWS
from kernels.cpu.packed_gemm import packed_gemm_native

U = 2.0**-24
pytestmark = pytest.mark.usefixtures(one_torch_thread.__name__)


def _layer(dtype: torch.dtype, n: int = 40, k: int = 96, use_kernel: bool = True) -> Linear:
    g = torch.Generator().manual_seed(0)
    w, b = torch.randn(n, k, generator=g).to(dtype), torch.randn(n, generator=g).to(dtype)
    return Linear(nn.Parameter(w, requires_grad=False), nn.Parameter(b, requires_grad=False),
                  Fp8LinearMethod([16, n - 16], "channel", "token", use_kernel))


PATHS = ["kernel", "dequantize", "packed"]


@pytest.mark.parametrize("dtype,packing", [(torch.float32, True), (torch.bfloat16, True), (torch.bfloat16, False)])
@pytest.mark.parametrize("rows", [1, FP8_KERNEL_MAX_ROWS, FP8_KERNEL_MAX_ROWS + 1, 3 * FP8_KERNEL_MAX_ROWS])
def test_every_path_matches_the_float64_weight_only_product(monkeypatch, dtype, packing, rows) -> None:
    calls = dict.fromkeys(PATHS, 0)
    for key, name in zip(PATHS, ("fp8_w8a16_gemm", "fp8_dequantize", "fp8_w8a16_packed_gemm")):
        real = getattr(fp8, name)

        def counted(*a, _real=real, _key=key, **kw):
            calls[_key] += 1
            return _real(*a, **kw)

        monkeypatch.setattr(fp8, name, counted)
    monkeypatch.setattr(torch, "_scaled_mm", lambda *a, **kw: pytest.fail("_scaled_mm called on CPU"))
    if not packing:  # what a CPU without AVX512-BF16 runs
        monkeypatch.setattr(fp8, "packed_gemm_native", lambda: False)
    packed = dtype == torch.bfloat16 and packing and packed_gemm_native()
    layer = _layer(dtype)
    assert layer.weight_fp8.dtype == torch.float8_e4m3fn and layer.weight_fp8.dim() == (3 if packed else 2)
    assert layer.weight_bytes() == (2 * 32 * 96 if packed else 40 * 96) + 40 * 4  # a byte a weight (packed: n to 64)
    x = torch.randn(rows, 96, generator=torch.Generator().manual_seed(rows)).to(dtype)
    res = torch.randn(rows, 40).to(dtype)
    got = layer(x, res)
    path = "packed" if packed else "kernel" if rows <= FP8_KERNEL_MAX_ROWS else "dequantize"
    assert calls == {key: int(key == path) for key in PATHS}
    w = layer.quant_method.dequantized_weight(layer).double()  # q * scale, exactly
    y = x.double() @ w.T + layer.bias.double()
    mags = x.double().abs() @ w.abs().T
    tol = (96 + 4) * U * mags + 2 * U * layer.bias.double().abs()
    if path == "dequantize":
        tol = tol + (2.0**-9 if dtype == torch.bfloat16 else U) * mags
    if dtype == torch.bfloat16:  # the output rounded after the bias, the residual added and rounded again
        tol = tol + 2.0**-8 * y.abs() + 2.0**-8 * (y + res.double()).abs()
    err = (got.double() - (y + res.double())).abs()
    assert got.dtype == dtype and bool((err <= tol).all()), float((err - tol).max())


def test_packing_keeps_the_codes_and_the_reference_path() -> None:
    """The packed layer's codes are the row-major layer's, and the W8A8 reference (use_kernel=False) reads them."""
    packed, plain = _layer(torch.bfloat16), _layer(torch.bfloat16, use_kernel=False)
    assert plain.weight_fp8.dim() == 2
    assert torch.equal(packed.quant_method.dequantized_weight(packed), plain.quant_method.dequantized_weight(plain))
    x = torch.randn(3, 96).bfloat16()
    packed.quant_method.use_kernel = False
    assert torch.equal(packed(x), plain(x))


def test_3d_rows_and_no_rows() -> None:
    layer = _layer(torch.bfloat16)
    x = torch.randn(2, 3, 96).bfloat16()
    assert torch.equal(layer(x), layer(x.reshape(6, 96)).reshape(2, 3, 40))
    assert layer(torch.zeros(0, 96).bfloat16()).shape == (0, 40)
