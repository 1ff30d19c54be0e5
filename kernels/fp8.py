"""FP8 KV-cache formats: the scale that maps a tensor's range onto a format, quantize on write,
dequantize on read. Every backend does exactly this arithmetic (the Triton kernels in registers),
so torch's own float8 casts, which round to nearest even correctly on CPU, are the reference.

vLLM's names: `kv_cache_dtype="fp8"` is `"fp8_e4m3"` (OCP e4m3fn: 3 mantissa bits, largest value
448, no infinity; the OCP spec leaves overflow to NaN), `"fp8_e5m2"` trades a mantissa bit for
range (largest value 57344). A cache stores `x / scale` rounded to the format and saturated at
its largest value; a read returns `code * scale`. A scale is fp32, one per tensor (a float or a
0-dim tensor) or one per KV head (shape `[num_kv_heads]`), for K and for V of each layer: one
outlier head would otherwise squeeze every other head's values into the format's subnormals.

GPUs convert fp8 in hardware from sm_89 (Ada, Hopper) on; a T4, an A100 or an A10G has no fp8 conversion
instruction, so there (as in vLLM) the cache still stores fp8 codes and the kernels decode and encode them with
integer operations (`fp8_conversion` decides, for every Triton fp8 kernel; kernels/triton/_common.py).
"""
from __future__ import annotations

import torch

FP8_FORMATS: dict[str, torch.dtype] = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn,
                                       "fp8_e5m2": torch.float8_e5m2}
KV_CACHE_DTYPES = ("auto", *FP8_FORMATS, "int8")  # "int8": symmetric int8 with the same scales (kernels.int8_kv)


def fp8_dtype(kv_cache_dtype: str) -> torch.dtype | None:
    """The fp8 format `kv_cache_dtype` names: None for "auto" (the model's dtype) and "int8" (not fp8)."""
    if kv_cache_dtype in ("auto", "int8"):
        return None
    if kv_cache_dtype not in FP8_FORMATS:
        raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {kv_cache_dtype!r}")
    return FP8_FORMATS[kv_cache_dtype]


def kv_storage_dtype(kv_cache_dtype: str) -> torch.dtype | None:
    """The quantized dtype a KV cache of `kv_cache_dtype` stores: an fp8 format, torch.int8, or None for "auto"."""
    return torch.int8 if kv_cache_dtype == "int8" else fp8_dtype(kv_cache_dtype)


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in (torch.float8_e4m3fn, torch.float8_e5m2)


def is_quantized_kv(dtype: torch.dtype) -> bool:
    """An fp8 or int8 cache: stored as value / scale, read as code * scale."""
    return is_fp8(dtype) or dtype == torch.int8


def fp8_max(dtype: torch.dtype) -> float:
    """The largest finite value of an fp8 dtype: where quantization saturates (448 or 57344)."""
    if not is_fp8(dtype):
        raise ValueError(f"an fp8 dtype (float8_e4m3fn or float8_e5m2) is needed, got {dtype}")
    return float(torch.finfo(dtype).max)


def native_fp8(capability: tuple[int, int]) -> bool:
    """Whether a GPU of this compute capability has fp8 (e4m3 / e5m2) conversion instructions: sm_89 on."""
    return tuple(capability) >= (8, 9)


def fp8_conversion(device: torch.device) -> str:
    """How the Triton kernels convert fp8 on `device`: "native" (the hardware's cvt instructions) or "integer"
    (bit operations on the codes: GPUs before Ada, and the interpreter, which rounds fp32 -> e4m3 wrongly)."""
    if device.type == "cuda" and native_fp8(torch.cuda.get_device_capability(device)):
        return "native"
    return "integer"


def cache_format(kv_cache_dtype: str, cache: torch.Tensor) -> torch.dtype | None:
    """The format a write must quantize to (an fp8 dtype, torch.int8, or None: a plain copy). The cache's dtype
    decides; a `kv_cache_dtype` naming a different format is a caller bug, reported here."""
    named = kv_storage_dtype(kv_cache_dtype)
    stored = cache.dtype if is_quantized_kv(cache.dtype) else None
    if named is not None and named != stored:
        raise ValueError(f"kv_cache_dtype={kv_cache_dtype!r} needs a {named} cache, got a {cache.dtype} cache")
    return stored


def per_head(scale: float | torch.Tensor) -> float | torch.Tensor:
    """A scale ready to broadcast over `[..., num_kv_heads, head_dim]`: `[H]` becomes `[H, 1]`."""
    if isinstance(scale, torch.Tensor) and scale.dim() == 1:
        return scale.float()[:, None]
    return scale.float() if isinstance(scale, torch.Tensor) else scale


# seam: lab 08 (grader/seams.py)
def scale_from_amax(amax: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The scale that maps [-amax, amax] onto the format's whole range: amax / fp8_max(dtype), in fp32.
    An all-zero tensor (amax 0) gets scale 1: any scale stores zeros exactly, and 0 would divide by 0."""
    amax = amax.float()
    return torch.where(amax > 0, amax / fp8_max(dtype), torch.ones_like(amax))


# seam: lab 08 (grader/seams.py)
def quantize_fp8(x: torch.Tensor, scale: float | torch.Tensor, dtype: torch.dtype = torch.float8_e4m3fn) -> torch.Tensor:
    """x `[..., num_kv_heads, head_dim]` / scale (per tensor or `[num_kv_heads]`) in fp32, saturated at
    +-fp8_max(dtype) (so +-inf and overflow store the largest value, never NaN), rounded to nearest even."""
    limit = fp8_max(dtype)
    return (x.float() / per_head(scale)).clamp(-limit, limit).to(dtype)


# seam: lab 08 (grader/seams.py)
def dequantize_fp8(x: torch.Tensor, scale: float | torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """code * scale in fp32, then cast to `dtype`: the value a kernel computes with."""
    return (x.float() * per_head(scale)).to(dtype)
