"""INT8 KV-cache format (`kv_cache_dtype="int8"`): symmetric int8 with a static fp32 scale per tensor or per KV head
(one K and one V scale per layer, the fp8 cache's scales: dynamic, calibrated or from the checkpoint), and
vLLM's `int8_per_token_head` layout as functions (an fp32 scale per token and KV head).

Symmetric int8 maps [-amax, amax] onto the integers [-127, 127] (-128 is left out, so the range is symmetric):
scale = amax / 127, code = clamp(round(x / scale), -127, 127), value = code * scale. Its 255 levels are evenly
spaced: the rounding error is at most scale / 2 wherever the value lies. fp8 e4m3 at the same byte spaces its
levels logarithmically (3 mantissa bits: a relative error up to 2^-4 at every magnitude), so for values near the
top of the range int8 is ~8x finer, and for small values fp8 is: which one wins depends on how the values spread
under one scale (docs/fp8_kv_cache.md, "INT8").

`int8_per_token_head` gives every head vector of every token its own scale (its own amax / 127), computed as the
token is written, so no calibration and no outlier head or token squeezes the others; it costs 4 bytes per
head vector: 132 bytes instead of 128 for head_dim 128. The engine's cache keeps one scale per layer and head
(the fp8 cache's scale plumbing); the per-token-head functions here are graded on their own in lab 08.
"""
from __future__ import annotations

import torch

from kernels.fp8 import per_head

INT8_MAX = 127  # symmetric: -128 is never stored


def int8_scale_from_amax(amax: torch.Tensor) -> torch.Tensor:
    """amax / 127 in fp32 (1 where amax is 0: any scale stores zeros exactly)."""
    amax = amax.float()
    return torch.where(amax > 0, amax / INT8_MAX, torch.ones_like(amax))


# seam: lab 08 (grader/seams.py)
def quantize_int8(x: torch.Tensor, scale: float | torch.Tensor) -> torch.Tensor:
    """x `[..., num_kv_heads, head_dim]` / scale (per tensor or `[num_kv_heads]`) in fp32, rounded to nearest
    (half to even), saturated at +-127 (so +-inf stores +-127; NaN stores 0): int8."""
    return torch.nan_to_num(torch.round(x.float() / per_head(scale)), nan=0.0).clamp(-INT8_MAX, INT8_MAX).to(torch.int8)


# seam: lab 08 (grader/seams.py)
def dequantize_int8(x: torch.Tensor, scale: float | torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """code * scale in fp32, then cast to `dtype`."""
    return (x.float() * per_head(scale)).to(dtype)


# seam: lab 08 (grader/seams.py)
def quantize_int8_per_token_head(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x `[num_tokens, num_kv_heads, head_dim]` -> (int8 codes of the same shape, fp32 scales
    `[num_tokens, num_kv_heads]`): each head vector's own amax / 127 (1 for an all-zero vector)."""
    scale = int8_scale_from_amax(x.float().abs().amax(dim=-1))
    return torch.round(x.float() / scale[..., None]).clamp(-INT8_MAX, INT8_MAX).to(torch.int8), scale


def dequantize_int8_per_token_head(codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(codes `[T, H, D]`, scales `[T, H]`) -> codes * scale in fp32, cast to `dtype`."""
    return (codes.float() * scales.float()[..., None]).to(dtype)
