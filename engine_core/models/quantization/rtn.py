"""W4A16 round-to-nearest (`quantization="rtn"`, vLLM's name for online RTN): group-wise asymmetric
integer weights with zero points, activations left in the model dtype.

Each row's K inputs fall into groups of `group_size`; a group g of row n keeps a scale s and an integer
zero z (GPTQ's choice: the range is widened to include 0, so 0 is exact):

    s = (max(w, 0) - min(w, 0)) / (2^bits - 1),  z = round(-min(w, 0) / s),
    q = clamp(round(w / s) + z, 0, 2^bits - 1),  w ~= (q - z) * s      (|error| <= s / 2)

Storage is GPTQ's layout: `qweight` int32 `[K * bits / 32, N]` with 32 / bits consecutive K values per
int32 (value i at bits [i * bits, (i + 1) * bits)), `scales` `[K / group_size, N]`. Zeros are kept unpacked
(uint8 `[K / group_size, N]`): GPTQ's checkpoints pack them along N and store z - 1, which only a
checkpoint loader needs.

The reference GEMM dequantizes to the model dtype on every call and runs `F.linear` (fp32 models, GPU and 8
bits: slow, correct; a faster path is the CPU-speed work). On CPU with 4 bits and bf16/fp16 activations (W4A16
proper) the layer holds torch's int4 kernel layout instead
(`_convert_weight_to_int4pack_for_cpu`) and multiplies with `_weight_int4pack_mm_for_cpu`, which
dequantizes as (q - 8) * scale + zero: that is (q - z) * s with a float zero of (8 - z) * s. Where the kernel
backend is Triton (CUDA tensors), 4-bit bf16/fp16 layers keep GPTQ's layout and run the Triton W4A16
dequant-in-GEMM (`kernels.w4a16_gemm`).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import kernels
from engine_core.models.quantization.base import LinearMethodBase, add_bias_residual, triton_kernels_apply

# fp32 is accepted by the kernel but takes a scalar path, far slower than the dense fp32 GEMM
# (docs/weight_quantization.md)
_INT4PACK_DTYPES = (torch.bfloat16, torch.float16)


# seam: lab 13 (grader/seams.py)
def pack_along_k(q: torch.Tensor, bits: int) -> torch.Tensor:
    """Unsigned values `[N, K]` (each < 2^bits) -> GPTQ's int32 `[K * bits / 32, N]`."""
    per = 32 // bits
    n, k = q.shape
    shifts = torch.arange(per, device=q.device, dtype=torch.int64) * bits
    words = (q.t().reshape(k // per, per, n).to(torch.int64) << shifts[None, :, None]).sum(dim=1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)  # the same 32 bits, signed


# seam: lab 13 (grader/seams.py)
def unpack_along_k(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """GPTQ's int32 `[K * bits / 32, N]` -> the unsigned values `[N, K]` (int32), exactly."""
    per = 32 // bits
    shifts = torch.arange(per, device=packed.device, dtype=torch.int32) * bits
    values = (packed[:, None, :] >> shifts[None, :, None]) & (2**bits - 1)  # >> sign-extends; the mask drops it
    return values.reshape(-1, packed.shape[1]).t().contiguous()


# seam: lab 13 (grader/seams.py)
def quantize_groupwise(w: torch.Tensor, bits: int, group_size: int
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w `[N, K]` -> (q int32 `[N, K]`, scales fp32 `[K / g, N]`, zeros int32 `[K / g, N]`)."""
    n, k = w.shape
    maxq = 2**bits - 1
    groups = w.float().reshape(n, k // group_size, group_size)
    lo, hi = groups.amin(dim=-1).clamp(max=0), groups.amax(dim=-1).clamp(min=0)
    scale = (hi - lo) / maxq
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # an all-zero group: any scale is exact
    zero = torch.round(-lo / scale)
    q = torch.clamp(torch.round(groups / scale[..., None]) + zero[..., None], 0, maxq)
    return q.reshape(n, k).to(torch.int32), scale.t().contiguous(), zero.t().to(torch.int32).contiguous()


# seam: lab 13 (grader/seams.py)
def dequantize_groupwise(q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int,
                         dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """(q `[N, K]`, scales `[K / g, N]`, zeros `[K / g, N]`) -> (q - z) * s `[N, K]`, computed in fp32."""
    s = scales.t().float().repeat_interleave(group_size, dim=1)
    z = zeros.t().float().repeat_interleave(group_size, dim=1)
    return ((q.float() - z) * s).to(dtype)


def int4pack_applies(device: torch.device, dtype: torch.dtype, bits: int, n: int) -> bool:
    """torch's CPU int4 kernel: 4 bits, bf16/fp16 activations, N a multiple of 16 (its packing
    refuses other N; K is a multiple of the group size, so even)."""
    return device.type == "cpu" and bits == 4 and dtype in _INT4PACK_DTYPES and n % 16 == 0


def w4a16_kernel_applies(device: torch.device, dtype: torch.dtype, bits: int, group_size: int) -> bool:
    """The Triton W4A16 kernel: 4 bits, bf16/fp16 activations, a group size it tiles (a multiple of 16), where
    the kernel backend for `device` is Triton (CUDA; CPU tensors only with KERNELS_BACKEND=triton, under the
    interpreter)."""
    return bits == 4 and dtype in _INT4PACK_DTYPES and group_size % 16 == 0 and triton_kernels_apply(device)


def run_w4a16_kernel(layer: nn.Module, x: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                     group_size: int, perm: torch.Tensor | None = None) -> torch.Tensor:
    """x `[..., K]` through the Triton kernel on the layer's `qweight` (`perm`: act-order's stored K order),
    in x's dtype."""
    rows = x.reshape(-1, x.shape[-1]).to(layer.dtype)
    y = kernels.w4a16_gemm(rows, layer.qweight, scales, zeros, group_size, perm, backend="triton")
    return y.to(x.dtype).reshape(*x.shape[:-1], layer.output_size)


class RTNLinearMethod(LinearMethodBase):
    """The layer holds `qweight`, `scales`, `zeros` (GPTQ's layout), or on CPU with 4 bits only the kernel's
    copy (`weight_int4pack`, `scales_and_zeros`) for bf16/fp16 models; the dense weight is freed. On Triton
    (CUDA) 4-bit bf16/fp16 layers run `kernels.w4a16_gemm` on GPTQ's layout. `cpu_kernel=False` keeps the
    reference path everywhere (tests compare the two)."""

    def __init__(self, bits: int, group_size: int, cpu_kernel: bool = True) -> None:
        self.bits, self.group_size, self.cpu_kernel = bits, group_size, cpu_kernel

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        w = layer.weight.detach()
        if w.shape[1] % self.group_size:
            raise ValueError(f"quantization_config['group_size'] must divide every linear's input size, got "
                             f"{self.group_size} for an input of {w.shape[1]}")
        q, scales, zeros = quantize_groupwise(w, self.bits, self.group_size)
        del layer.weight
        self.store(layer, q, scales, zeros, w.dtype)

    def store(self, layer: nn.Module, q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
              dtype: torch.dtype) -> None:
        """Hang (q `[N, K]`, scales fp32 `[K / g, N]`, zeros `[K / g, N]`) on `layer` in GPTQ's layout or the
        CPU kernel's (a GPTQ/AWQ checkpoint's loader, packed.py, arrives here with its unpacked tensors)."""
        layer.dtype, layer.perm = dtype, None
        layer.qweight = layer.scales = layer.zeros = layer.weight_int4pack = layer.scales_and_zeros = None
        layer.w4a16_kernel = self.cpu_kernel and w4a16_kernel_applies(q.device, dtype, self.bits, self.group_size)
        if not layer.w4a16_kernel and self.cpu_kernel and int4pack_applies(q.device, dtype, self.bits, q.shape[0]):
            layer.weight_int4pack = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
            float_zero = (8 - zeros.float()) * scales  # (q - 8) * s + (8 - z) * s = (q - z) * s
            layer.scales_and_zeros = torch.stack([scales, float_zero], dim=-1).to(dtype).contiguous()
        else:
            layer.qweight, layer.scales, layer.zeros = pack_along_k(q, self.bits), scales.to(dtype), \
                zeros.to(torch.uint8)

    def dequantized_weight(self, layer: nn.Module) -> torch.Tensor:
        """(q - z) * s `[N, K]` in the model dtype, from GPTQ's layout: the reference path."""
        return dequantize_groupwise(unpack_along_k(layer.qweight, self.bits), layer.scales, layer.zeros,
                                    self.group_size, layer.dtype)

    def apply(self, layer: nn.Module, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        if layer.w4a16_kernel:
            y = run_w4a16_kernel(layer, x, layer.scales, layer.zeros, self.group_size, layer.perm)
        elif layer.weight_int4pack is None:
            y = F.linear(x, self.dequantized_weight(layer).to(x.dtype))
        elif x.numel() == 0:
            y = x.new_zeros(*x.shape[:-1], layer.output_size)
        else:  # the kernel takes 2-D rows in the weight's dtype; act-order reads x's columns in the stored K order
            rows = x.reshape(-1, x.shape[-1]).to(layer.dtype)
            rows = rows if layer.perm is None else rows.index_select(1, layer.perm)
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(rows, layer.weight_int4pack, self.group_size,
                                                             layer.scales_and_zeros)
            y = y.to(x.dtype).reshape(*x.shape[:-1], layer.output_size)
        return add_bias_residual(y, layer.bias, residual)

    def weight_bytes(self, layer: nn.Module) -> int:
        held = [layer.qweight, layer.scales, layer.zeros, layer.weight_int4pack, layer.scales_and_zeros]
        return sum(t.nbytes for t in held if t is not None)
