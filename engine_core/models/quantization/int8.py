"""W8A8 int8 (`quantization="int8"`): per-output-channel symmetric int8 weights, dynamic per-token symmetric
int8 activations, int32 accumulation.

    y[m, n] = sx[m] * sw[n] * sum_k qx[m, k] * qw[n, k]

The int32 sum is exact (|sum| <= K * 127^2 < 2^31 for K < 133,000), so the only errors are the two
roundings to int8 and the fp32 epilogue. `torch._int_mm` computes it on CPU (exact there); on CUDA it
needs M > 16 and K, N multiples of 8, so other shapes take float64, exact too (|sum| < 2^53).

A fused q|k|v or gate|up weight is quantized per output row, so each of its modules keeps its own
scales: the per-tensor scales vLLM expands to per channel for fused checkpoints never arise here.
"""
from __future__ import annotations

import torch
from torch import nn

from engine_core.models.quantization.base import LinearMethodBase, add_bias_residual

QMAX = 127  # symmetric: -128 is never used, so -q is always representable


# seam: lab 13 (grader/seams.py)
def quantize_per_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w `[out, in]` -> (int8 `[out, in]`, fp32 scale `[out]`): w ~= q * scale[:, None]."""
    scale = w.float().abs().amax(dim=1).clamp(min=torch.finfo(torch.float32).tiny) / QMAX
    return torch.round(w.float() / scale[:, None]).clamp(-QMAX, QMAX).to(torch.int8), scale


# seam: lab 13 (grader/seams.py)
def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x `[rows, in]` -> (int8 `[rows, in]`, fp32 scale `[rows, 1]`), one scale per row from its absmax."""
    scale = x.float().abs().amax(dim=1, keepdim=True).clamp(min=torch.finfo(torch.float32).tiny) / QMAX
    return torch.round(x.float() / scale).clamp(-QMAX, QMAX).to(torch.int8), scale


def int_mm_applies(m: int, k: int, n: int, device: torch.device) -> bool:
    """Whether `torch._int_mm` takes these shapes (its CUDA kernel: M > 16, K and N multiples of 8)."""
    if m == 0:
        return False
    if device.type == "cuda":
        return m > 16 and k % 8 == 0 and n % 8 == 0
    return device.type == "cpu"


# seam: lab 13 (grader/seams.py)
def int8_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """int8 `[M, K]` @ int8 `[K, N]` -> the exact int32 `[M, N]`."""
    (m, k), n = a.shape, b.shape[1]
    if int_mm_applies(m, k, n, a.device):
        return torch._int_mm(a, b)
    return int8_mm_float64(a, b)


def int8_mm_float64(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """The same product through float64, exact while K * 127^2 < 2^53: where `torch._int_mm` does not apply."""
    return (a.double() @ b.double()).to(torch.int32)


# seam: lab 13 (grader/seams.py)
def convert_to_channelwise(weight_scale: torch.Tensor, logical_widths: list[int]) -> torch.Tensor:
    """A fused checkpoint's per-tensor scales (one per module of q|k|v or gate|up, `[len(logical_widths)]`)
    -> one fp32 scale per output row `[sum(logical_widths)]` (vLLM's name, w8a8_utils.py): the int8 codes
    stay as they are, the epilogue reads a per-channel vector whatever the checkpoint stored."""
    if weight_scale.dim() != 1 or weight_scale.numel() != len(logical_widths):
        raise ValueError(f"weight_scale must hold one scale per fused module ({len(logical_widths)} for "
                         f"logical_widths {logical_widths}), got shape {list(weight_scale.shape)}")
    widths = torch.tensor(logical_widths, dtype=torch.int64, device=weight_scale.device)
    return weight_scale.float().repeat_interleave(widths)


class Int8LinearMethod(LinearMethodBase):
    """The layer holds `weight_q` (int8 `[out, in]`) and `weight_scale` (fp32 `[out]`); the dense weight is freed."""

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        q, scale = quantize_per_channel(layer.weight.detach())
        del layer.weight
        layer.register_buffer("weight_q", q)
        layer.register_buffer("weight_scale", scale)

    # seam: lab 13 (grader/seams.py)
    def apply(self, layer: nn.Module, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        qx, sx = quantize_per_token(x)
        acc = int8_mm(qx, layer.weight_q.t())
        y = (acc.float() * sx * layer.weight_scale).to(x.dtype)
        return add_bias_residual(y, layer.bias, residual)

    def weight_bytes(self, layer: nn.Module) -> int:
        return layer.weight_q.nbytes + layer.weight_scale.nbytes
