"""Which GEMM a 4-bit layer runs, and that each gives the checkpoint's product: act-order GPTQ stored with K
permuted (the CPU int4 kernel instead of the per-column reference path), and the Triton W4A16 kernel that
GPTQ, AWQ and GGUF layers take where the kernel backend is Triton (CUDA, where `make gpu-check` runs this
file; on CPU forced with KERNELS_BACKEND=triton, under the interpreter that tests/conftest.py turns on).

The expected product is float64 from the checkpoint's own weight (test_packed_checkpoints' packers and
`quantized`, which dequantize through g_idx column by column), not from the layer's code."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from engine_core.config import QuantizationConfig
from engine_core.models.linear import Linear
from engine_core.models.quantization import PackedLinearMethod, fused_tensors
from engine_core.models.quantization.gguf_q4_1 import Q4_1LinearMethod
from tests.models.test_packed_checkpoints import awq_tensors, gptq_tensors

ACT_ORDER = QuantizationConfig("gptq", 4, 32, desc_act=True, zeros_minus_one=True)


def _layer(tensors: dict, quant: QuantizationConfig, dtype: torch.dtype, cpu_kernel: bool = True) -> Linear:
    loaded = fused_tensors(tensors.__getitem__, tensors.__contains__, ["p"], quant)
    return Linear(None, None, PackedLinearMethod(quant, loaded, dtype, cpu_kernel))


def _bound(x: torch.Tensor, w: torch.Tensor, unit: float) -> torch.Tensor:
    """|err| allowed against the float64 product for the Triton kernel: fp32 inside (the interpreter; on CUDA
    the dequantized tile is rounded to fp16 once), the output rounded to `unit` (fp16: 2^-11) once, so
    3 * unit * sum|terms| covers it with room."""
    return 3 * unit * (x.double().abs() @ w.double().abs().t())


def test_act_order_runs_the_cpu_int4_kernel_through_the_permutation() -> None:
    """torch's int4 kernel rounds the scale and the float zero (8 - z) * s to bf16 and accumulates in its own
    order: as test_packed_checkpoints' contiguous-group check, 4 bf16 ulps of the output's scale; a wrong K
    order (the stored permutation dropped) is off by the output's own size."""
    w = torch.randn(48, 128, generator=torch.Generator().manual_seed(11))
    tensors, expected = gptq_tensors("p", w, 4, 32, True, True, seed=2)
    layer = _layer(tensors, ACT_ORDER, torch.bfloat16)
    assert layer.perm is not None and layer.g_idx is None and layer.weight_int4pack is not None
    x = torch.randn(7, 128, generator=torch.Generator().manual_seed(12)).bfloat16()
    y64 = x.double() @ expected.double().t()
    tol = 4 * 2**-8 * float(y64.abs().max())
    assert float((layer(x).double() - y64).abs().max()) <= tol
    layer.perm = None
    assert float((layer(x).double() - y64).abs().max()) > tol


def test_a_g_idx_with_uneven_groups_keeps_the_per_column_reference_path() -> None:
    """No K order makes groups of 20 and 12 columns contiguous groups of 16: the layer keeps g_idx."""
    g_idx = torch.tensor([0] * 20 + [1] * 12, dtype=torch.int32)[torch.randperm(32, generator=torch.Generator()
                                                                                   .manual_seed(0))]
    q = torch.randint(0, 16, (16, 32), generator=torch.Generator().manual_seed(1), dtype=torch.int32)
    scales = (torch.rand(2, 16) + 0.1).bfloat16().float()  # exact in bf16: only the product is rounded (2^-9)
    zeros = torch.randint(1, 15, (2, 16), dtype=torch.int32)
    quant = QuantizationConfig("gptq", 4, 16, desc_act=True)
    layer = Linear(None, None, PackedLinearMethod(quant, (q, scales, zeros, g_idx), torch.bfloat16))
    assert layer.perm is None and layer.g_idx is not None and layer.weight_int4pack is None
    expected = (q.double() - zeros.double()[g_idx.long()].t()) * scales.double()[g_idx.long()].t()
    assert torch.allclose(layer.quant_method.dequantized_weight(layer).double(), expected, rtol=2**-8, atol=0)


def _triton_device(monkeypatch: pytest.MonkeyPatch) -> torch.device:
    """CUDA where there is one (`make gpu-check` runs this file: the compiled kernel), else CPU tensors with the
    backend forced to Triton (the interpreter)."""
    if torch.cuda.is_available():
        return torch.device("cuda")
    monkeypatch.setenv("KERNELS_BACKEND", "triton")
    return torch.device("cpu")


@pytest.mark.parametrize("method", ["gptq-act-order", "awq"])
def test_packed_layers_take_the_triton_kernel_where_the_backend_is_triton(monkeypatch, method: str) -> None:
    device = _triton_device(monkeypatch)
    w = torch.randn(40, 64, generator=torch.Generator().manual_seed(13))
    if method == "awq":
        tensors, expected = awq_tensors("p", w, 32)
        quant = QuantizationConfig("awq", 4, 32)
    else:
        tensors, expected = gptq_tensors("p", w, 4, 32, True, True, seed=3)
        quant = ACT_ORDER
    layer = _layer({name: t.to(device) for name, t in tensors.items()}, quant, torch.float16)
    assert layer.w4a16_kernel and layer.weight_int4pack is None
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(14)).half()
    err = (layer(x.to(device)).cpu().double() - x.double() @ expected.double().t()).abs()
    assert bool((err <= _bound(x, expected, 2**-11)).all()), f"max |err| {err.max():.3g}"


def test_a_gguf_q4_1_layer_takes_the_triton_kernel_with_float_zeros(monkeypatch) -> None:
    device = _triton_device(monkeypatch)
    n, k = 24, 64
    rng = np.random.default_rng(5)
    blocks = np.zeros((n * k // 32, 20), dtype=np.uint8)
    blocks[:, 0:2] = np.frombuffer(np.float16(rng.uniform(0.005, 0.02, len(blocks))).tobytes(), np.uint8).reshape(-1, 2)
    blocks[:, 2:4] = np.frombuffer(np.float16(rng.uniform(-0.1, 0.0, len(blocks))).tobytes(), np.uint8).reshape(-1, 2)
    blocks[:, 4:] = rng.integers(0, 256, (len(blocks), 16), dtype=np.uint8)
    raw = torch.from_numpy(blocks.reshape(-1))
    kernel = Linear(None, None, Q4_1LinearMethod(raw.to(device), n, k, torch.float16))
    assert kernel.w4a16_kernel and kernel.weight_int4pack is None
    reference = Linear(None, None, Q4_1LinearMethod(raw, n, k, torch.float32))
    expected = reference.quant_method.dequantized_weight(reference)  # q * d + m exactly, in fp32
    x = torch.randn(5, k, generator=torch.Generator().manual_seed(15)).half()
    err = (kernel(x.to(device)).cpu().double() - x.double() @ expected.double().t()).abs()
    assert bool((err <= _bound(x, expected, 2**-11)).all()), f"max |err| {err.max():.3g}"
