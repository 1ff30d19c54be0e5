"""Pieces every Triton kernel here shares: interpreter detection, fp8 scale arguments, the dot.

Triton decides at `@triton.jit` time whether a kernel is compiled or interpreted, so
`INTERPRET` is read once, when these modules are first imported (lazily, by the dispatch).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton import knobs

from kernels.fp8 import is_fp8

INTERPRET: bool = bool(knobs.runtime.interpret)


def check_device(*tensors: torch.Tensor) -> None:
    """CPU tensors only work under the interpreter; everything must sit on one device."""
    devices = {t.device for t in tensors}
    if len(devices) != 1:
        raise ValueError(f"all tensors must be on one device, got {sorted(str(d) for d in devices)}")
    if next(iter(devices)).type != "cuda" and not INTERPRET:
        raise RuntimeError("the Triton kernels got CPU tensors but were imported without TRITON_INTERPRET=1; "
                           "set TRITON_INTERPRET=1 in the environment before triton is first imported, "
                           "or use backend='torch'")


def scale_arg(scale: float | torch.Tensor, num_kv_heads: int) -> tuple[float | torch.Tensor, bool, int]:
    """An fp8 scale as kernel arguments (value, IS_PTR, STRIDE): a float stays a scalar; a tensor stays
    on the device (read inside the kernel: no host sync, CUDA-graph safe), one value for every head
    (STRIDE 0) or one per KV head (`[num_kv_heads]`, STRIDE 1)."""
    if not isinstance(scale, torch.Tensor):
        return float(scale), False, 0
    if scale.dim() == 0 or scale.shape == (1,):
        return scale.reshape(1).float(), True, 0
    if scale.shape == (num_kv_heads,):
        return scale.float().contiguous(), True, 1
    raise ValueError(f"an fp8 scale must be a float, a 0-dim tensor or one value per KV head [{num_kv_heads}], "
                     f"got shape {tuple(scale.shape)}")


def fp8_args(key_cache: torch.Tensor, k_scale: float | torch.Tensor,
             v_scale: float | torch.Tensor) -> tuple[float | torch.Tensor, float | torch.Tensor, dict]:
    """(k_scale, v_scale, flags) as the attention kernels take them for `key_cache` `[.., .., H_kv, D]`."""
    ks, ks_ptr, ks_stride = scale_arg(k_scale, key_cache.shape[2])
    vs, vs_ptr, vs_stride = scale_arg(v_scale, key_cache.shape[2])
    return ks, vs, dict(IS_FP8=is_fp8(key_cache.dtype), K_SCALE_IS_PTR=ks_ptr, V_SCALE_IS_PTR=vs_ptr,
                        K_SCALE_STRIDE=ks_stride, V_SCALE_STRIDE=vs_stride)


def upcast_dot(dtype: torch.dtype) -> bool:
    """fp32 `tl.dot` (exact IEEE, no TF32) for fp32 inputs and under the interpreter (which gets bf16
    dots wrong); on a GPU fp16/bf16 operands go straight to the tensor cores with fp32 accumulation."""
    return INTERPRET or dtype == torch.float32


@triton.jit
def load_scale(scale, head, IS_PTR: tl.constexpr, STRIDE: tl.constexpr):
    """KV head `head`'s scale (an index or a tensor of them), whether it came as a float or as a
    pointer to a device scalar (STRIDE 0) or to one value per KV head (STRIDE 1)."""
    if IS_PTR:
        return tl.load(scale + head * STRIDE).to(tl.float32)
    else:
        return scale


@triton.jit
def load_kv(ptrs, mask, scale, IS_FP8: tl.constexpr, UPCAST: tl.constexpr, DTYPE: tl.constexpr):
    """Load a K or V tile for `dot`: fp8 is dequantized in fp32 (value * scale) first; on the
    tensor-core path the tile is then cast to the query's dtype, on the upcast path kept as is."""
    x = tl.load(ptrs, mask=mask, other=0.0)
    if IS_FP8:
        x = x.to(tl.float32) * scale
    if not UPCAST:
        x = x.to(DTYPE)
    return x


@triton.jit
def dot(a, b, UPCAST: tl.constexpr):
    """a @ b with fp32 accumulation."""
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a, b, out_dtype=tl.float32)
