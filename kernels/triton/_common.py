"""Pieces every Triton kernel here shares: interpreter detection, fp8 scale arguments and fp8 storage, the dot.

Triton decides at `@triton.jit` time whether a kernel is compiled or interpreted, so
`INTERPRET` is read once, when these modules are first imported (lazily, by the dispatch).

fp8 caches reach a kernel in one of two forms (`kernels.fp8.fp8_conversion` picks, per device): as their fp8
dtype, converted by the hardware's cvt instructions (sm_89, Ada, and later), or as their bytes (a uint8 view),
decoded and encoded here with integer operations (`FP8_BITS` 1: e4m3fn, 2: e5m2): the path of GPUs without
fp8 conversions (T4, A100, A10G), and of the interpreter, whose own fp32 -> e4m3 rounding is wrong. Both give
torch's float8 casts bit for bit (tests/kernels/test_fp8_bits.py: every code, every rounding case).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton import knobs

from kernels.fp8 import fp8_conversion, is_fp8

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


def device_capability(t: torch.Tensor) -> tuple[int, int] | None:
    """(major, minor) of the GPU holding `t`; None under the interpreter. Tile sizes depend on it: Triton has
    tensor-core dots from sm_80 (Ampere) on; on a T4 (sm_75) every dot runs on the CUDA cores, in registers."""
    return torch.cuda.get_device_capability(t.device) if t.is_cuda else None


def fp8_storage(cache: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(the cache as the kernel takes it, FP8_BITS): itself and 0 for a non-fp8 cache or where the device
    converts fp8 natively; else its bytes and 1 (e4m3fn) or 2 (e5m2)."""
    if not is_fp8(cache.dtype) or fp8_conversion(cache.device) == "native":
        return cache, 0
    return cache.view(torch.uint8), 1 if cache.dtype == torch.float8_e4m3fn else 2


def fp8_args(key_cache: torch.Tensor, value_cache: torch.Tensor, k_scale: float | torch.Tensor,
             v_scale: float | torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, float | torch.Tensor,
                                                     float | torch.Tensor, dict]:
    """(key_cache, value_cache, k_scale, v_scale, flags) as the attention kernels take them for caches
    `[.., .., H_kv, D]` (fp8 caches in the form `fp8_storage` picks)."""
    if key_cache.dtype == torch.int8:
        raise ValueError("the Triton attention kernels have no int8 KV cache: use an fp8 or model-dtype cache, or "
                         "the cpu / torch backend")
    ks, ks_ptr, ks_stride = scale_arg(k_scale, key_cache.shape[2])
    vs, vs_ptr, vs_stride = scale_arg(v_scale, key_cache.shape[2])
    kc, bits = fp8_storage(key_cache)
    vc, _ = fp8_storage(value_cache)
    return kc, vc, ks, vs, dict(IS_FP8=is_fp8(key_cache.dtype), FP8_BITS=bits, K_SCALE_IS_PTR=ks_ptr,
                                V_SCALE_IS_PTR=vs_ptr, K_SCALE_STRIDE=ks_stride, V_SCALE_STRIDE=vs_stride)


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
def fp8_bits_to_f32(b, E5M2: tl.constexpr):
    """fp8 codes (uint8) -> their exact fp32 values with integer operations (no fp8 cvt instruction)."""
    u = b.to(tl.uint32)
    if E5M2:
        # an e5m2 code is the top byte of the fp16 with the same value; fp16 -> fp32 converts on every GPU
        x = (u << 8).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
    else:
        mag = u & 0x7F
        e = mag >> 3
        m = mag & 7
        normal = (((e + 120) << 23) | (m << 20)).to(tl.float32, bitcast=True)  # exponent bias 7 -> 127
        x = tl.where(e == 0, m.to(tl.float32) * 0.001953125, normal)  # subnormals: m * 2^-9
        x = tl.where(mag == 0x7F, float("nan"), x)  # e4m3fn's only non-finite code: S.1111.111
        x = (x.to(tl.uint32, bitcast=True) | ((u & 0x80) << 24)).to(tl.float32, bitcast=True)  # the sign (-0 too)
    return x


@triton.jit
def f32_to_fp8_bits(x, E5M2: tl.constexpr):
    """fp32 -> fp8 codes (uint8) with integer operations, rounded to nearest even as torch's cast rounds
    (c10's Float8 conversions), saturated at the format's largest value (448, 57344; +-inf too); NaN -> NaN."""
    bits = x.to(tl.uint32, bitcast=True)
    sign = (bits >> 24) & 0x80
    mag = bits & 0x7FFFFFFF
    is_nan = mag > 0x7F800000
    if E5M2:  # 2 mantissa bits, exponent bias 15
        mag = tl.minimum(mag, 0x47600000)  # 57344: positive floats order as their bit patterns
        # below 2^-14 (subnormal): add 2^7, whose ulp is 2^-16, e5m2's subnormal step: the fp32 adder rounds
        # to nearest even, and the low bits are the code
        sub = (mag.to(tl.float32, bitcast=True) + 128.0).to(tl.uint32, bitcast=True) - (134 << 23)
        # normal: rebias the exponent, round the 21 dropped mantissa bits to nearest even, shift
        odd = (mag >> 21) & 1
        normal = (mag - (112 << 23) + 0xFFFFF + odd) >> 21
        code = tl.where(mag < (113 << 23), sub, normal)
    else:  # e4m3fn: 3 mantissa bits, exponent bias 7
        mag = tl.minimum(mag, 0x43E00000)  # 448
        sub = (mag.to(tl.float32, bitcast=True) + 16384.0).to(tl.uint32, bitcast=True) - (141 << 23)  # 2^-9 steps
        odd = (mag >> 20) & 1
        normal = (mag - (120 << 23) + 0x7FFFF + odd) >> 20
        code = tl.where(mag < (121 << 23), sub, normal)
    code = tl.where(is_nan, 0x7F, code)
    return (code | sign).to(tl.uint8)


@triton.jit
def load_kv(ptrs, mask, scale, IS_FP8: tl.constexpr, FP8_BITS: tl.constexpr, UPCAST: tl.constexpr,
            DTYPE: tl.constexpr):
    """Load a K or V tile for `dot`: fp8 is dequantized in fp32 (value * scale) first (FP8_BITS: the
    tile holds codes, decoded with integer operations); on the tensor-core path the tile is then cast to
    the query's dtype, on the upcast path kept as is."""
    if FP8_BITS:
        x = fp8_bits_to_f32(tl.load(ptrs, mask=mask, other=0), FP8_BITS == 2)
    else:
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
