"""Attention, cache and multi-LoRA ops with one contract and three backends.

- `torch`: the PyTorch reference (`kernels.reference`), the semantics every other backend is
  tested against;
- `cpu`: C kernels for CPU tensors (`kernels.cpu`: decode attention read in place, the cache
  write), built with the system compiler on first use; cases they do not cover run the reference;
- `triton`: the Triton kernels (CUDA, or CPU tensors under the interpreter).
The multi-LoRA ops (SGMV / BGMV, contracts in `kernels.lora_reference`) and the weight-quantized GEMMs
(W4A16 and FP8, contracts in `kernels.quant_reference`) have a reference and a Triton version; the `cpu`
backend runs their reference (a CPU W4A16 layer holds torch's int4 kernel layout instead: quantization/rtn.py).

`auto` picks `triton` for CUDA tensors and `cpu` for CPU ones (`torch` if the C kernels cannot
be built: a warning says why). A call or `KERNELS_BACKEND=torch|cpu|triton` in the environment
(the default for `auto`) can force one. Triton on CPU tensors runs under the interpreter, which
needs `TRITON_INTERPRET=1` set before triton is imported; triton itself is imported only when a
Triton op first runs, so `import kernels` stays cheap.

`kernel_ops(backend, device, dtype)` is the one place a step's kernels are picked: the backend's
attention and cache ops, and the fused elementwise ops (RMSNorm, SiLU-and-mul, RoPE) where the
backend has them for that dtype (None: the model's PyTorch formula). The model builds it once per
step (`models.attention.AttentionPlan`) and every layer uses it.
"""
from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from typing import Callable

import torch

from kernels import lora_reference, quant_reference, reference

__all__ = ["KernelOps", "kernel_ops", "bgmv_expand", "bgmv_shrink", "fp8_gemm", "paged_attention",
           "paged_attention_decode", "reshape_and_cache", "resolve_backend", "sgmv_expand", "sgmv_shrink", "w4a16_gemm"]

BACKENDS = ("auto", "torch", "cpu", "triton")


@dataclass(frozen=True)
class KernelOps:
    """One step's kernels: the backend's attention and cache ops, with `kernels.reference`'s signatures
    (positional arguments only), and the fused elementwise ops `kernels.cpu` has for fp32 and bf16 CPU rows."""

    backend: str
    reshape_and_cache: Callable[..., None]
    paged_attention: Callable[..., torch.Tensor]
    paged_attention_decode: Callable[..., torch.Tensor]
    rms_norm: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor] | None = None
    silu_and_mul: Callable[[torch.Tensor], torch.Tensor] | None = None
    rotary_embedding: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None] | None = None


def resolve_backend(backend: str, device: torch.device) -> str:
    """'torch', 'cpu' or 'triton' for tensors on `device`; raises before any work if it cannot run."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        backend = os.environ.get("KERNELS_BACKEND", "auto") or "auto"
        if backend not in BACKENDS:
            raise ValueError(f"KERNELS_BACKEND must be one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        if device.type == "cuda":
            return "triton"
        from kernels import cpu
        return "cpu" if cpu.load() is not None else "torch"
    if backend == "cpu":
        if device.type != "cpu":
            raise RuntimeError(f"the cpu backend got {device.type} tensors; use backend='triton' or 'torch'")
        from kernels import cpu
        if cpu.load() is None:
            raise RuntimeError(f"the cpu backend's C kernels could not be built: {cpu.load_error()}")
    if backend == "triton" and importlib.util.find_spec("triton") is None:
        raise ModuleNotFoundError("the Triton backend needs triton, which publishes Linux wheels only and is not "
                                  "installed here: use backend='cpu' or 'torch' (a Linux machine, container or hosted "
                                  "GPU notebook for Triton: docs/hosted.md)", name="triton")
    interpret = os.environ.get("TRITON_INTERPRET", "").strip().lower() in ("1", "true", "on", "yes")
    if backend == "triton" and device.type != "cuda" and not interpret:
        raise RuntimeError(f"the Triton backend got {device.type} tensors: set TRITON_INTERPRET=1 in the environment "
                           "before triton is first imported to run it under the interpreter, or use backend='torch'")
    return backend


def kernel_ops(backend: str, device: torch.device, dtype: torch.dtype | None = None) -> KernelOps:
    """The ops of `backend` for tensors on `device`; with `dtype` float32 or bfloat16 on the cpu backend, its
    fused elementwise C ops too (rounding where the model's PyTorch formulas round, so they match Hugging Face). The functions are looked up in
    their modules at each call of this function, so a replaced module attribute (lab 06's seam) takes
    effect from the next step."""
    resolved = resolve_backend(backend, device)
    if resolved == "torch":
        return KernelOps(resolved, reference.reshape_and_cache, reference.paged_attention,
                         reference.paged_attention_decode)
    if resolved == "cpu":
        from kernels import cpu
        fused = dtype in cpu.FAST_DTYPES
        return KernelOps(resolved, cpu.reshape_and_cache, cpu.paged_attention, cpu.paged_attention_decode,
                         cpu.rms_norm if fused else None, cpu.silu_and_mul if fused else None,
                         cpu.rotary_embedding if fused else None)
    from kernels.triton import cache, decode_attention, prefill_attention
    return KernelOps(resolved, cache.reshape_and_cache, prefill_attention.paged_attention,
                     decode_attention.paged_attention_decode)


def reshape_and_cache(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                      slot_mapping: torch.Tensor, kv_cache_dtype: str = "auto",
                      k_scale: float | torch.Tensor = 1.0, v_scale: float | torch.Tensor = 1.0, *,
                      backend: str = "auto") -> None:
    """Write key/value `[num_tokens, num_kv_heads, head_dim]` into the paged caches at `slot_mapping`."""
    kernel_ops(backend, key.device).reshape_and_cache(key, value, key_cache, value_cache, slot_mapping,
                                                         kv_cache_dtype, k_scale, v_scale)


def paged_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                    block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
                    scale: float, k_scale: float | torch.Tensor = 1.0, v_scale: float | torch.Tensor = 1.0, *,
                    backend: str = "auto") -> torch.Tensor:
    """Varlen causal attention over paged KV (prefill chunks and decode rows alike)."""
    return kernel_ops(backend, query.device).paged_attention(query, key_cache, value_cache, block_tables,
                                                                seq_lens, query_start_loc, scale, k_scale, v_scale)


def paged_attention_decode(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                           k_scale: float | torch.Tensor = 1.0, v_scale: float | torch.Tensor = 1.0,
                           num_splits: int = 1, *, backend: str = "auto") -> torch.Tensor:
    """One query row per sequence over its whole context; `num_splits > 1` is flash-decoding."""
    return kernel_ops(backend, query.device).paged_attention_decode(query, key_cache, value_cache, block_tables,
                                                                       seq_lens, scale, k_scale, v_scale, num_splits)


# ---- multi-LoRA (Punica's SGMV / BGMV; contracts in kernels.lora_reference) ------------------------------
def bgmv_shrink(x: torch.Tensor, lora_a: torch.Tensor, row_slots: torch.Tensor, *,
                backend: str = "auto") -> torch.Tensor:
    """t[i] = x[i] @ lora_a[row_slots[i]].T in float32 (0 where the slot is -1): decode rows."""
    if resolve_backend(backend, x.device) != "triton":
        return lora_reference.bgmv_shrink(x, lora_a, row_slots)
    from kernels.triton.lora import bgmv_shrink as triton_op
    return triton_op(x, lora_a, row_slots)


def bgmv_expand(y: torch.Tensor, t: torch.Tensor, lora_b: torch.Tensor, row_slots: torch.Tensor,
                scaling: torch.Tensor, *, backend: str = "auto") -> None:
    """y[i] += scaling[s] * t[i] @ lora_b[s].T for s = row_slots[i] >= 0, in place: decode rows."""
    if resolve_backend(backend, y.device) != "triton":
        return lora_reference.bgmv_expand(y, t, lora_b, row_slots, scaling)
    from kernels.triton.lora import bgmv_expand as triton_op
    return triton_op(y, t, lora_b, row_slots, scaling)


def sgmv_shrink(x: torch.Tensor, lora_a: torch.Tensor, seg_starts: torch.Tensor, seg_slots: torch.Tensor,
                max_seg_len: int, *, backend: str = "auto") -> torch.Tensor:
    """bgmv_shrink for segments of rows sharing a slot (rows seg_starts[j]:seg_starts[j+1]): prefill chunks."""
    if resolve_backend(backend, x.device) != "triton":
        return lora_reference.sgmv_shrink(x, lora_a, seg_starts, seg_slots, max_seg_len)
    from kernels.triton.lora import sgmv_shrink as triton_op
    return triton_op(x, lora_a, seg_starts, seg_slots, max_seg_len)


def sgmv_expand(y: torch.Tensor, t: torch.Tensor, lora_b: torch.Tensor, seg_starts: torch.Tensor,
                seg_slots: torch.Tensor, max_seg_len: int, scaling: torch.Tensor, *, backend: str = "auto") -> None:
    """bgmv_expand for segments of rows sharing a slot: prefill chunks."""
    if resolve_backend(backend, y.device) != "triton":
        return lora_reference.sgmv_expand(y, t, lora_b, seg_starts, seg_slots, max_seg_len, scaling)
    from kernels.triton.lora import sgmv_expand as triton_op
    return triton_op(y, t, lora_b, seg_starts, seg_slots, max_seg_len, scaling)


# ---- weight-quantized GEMMs (contracts in kernels.quant_reference) ---------------------------------------
def w4a16_gemm(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int,
               perm: torch.Tensor | None = None, *, backend: str = "auto") -> torch.Tensor:
    """x `[M, K]` @ W.T for the int4 weight in GPTQ's layout (qweight `[K / 8, N]`, scales and zeros
    `[K / group_size, N]`); `perm`: act-order's stored K order (x's columns are read through it)."""
    if resolve_backend(backend, x.device) != "triton":
        quant_reference.check_w4a16(x, qweight, scales, zeros, group_size, perm)
        return quant_reference.w4a16_gemm(x, qweight, scales, zeros, group_size, perm)
    from kernels.triton.w4a16 import w4a16_gemm as triton_op
    return triton_op(x, qweight, scales, zeros, group_size, perm)


def fp8_gemm(a_fp8: torch.Tensor, a_scale: torch.Tensor, w_fp8: torch.Tensor, w_scale: torch.Tensor,
             out_dtype: torch.dtype, bias: torch.Tensor | None = None, *, backend: str = "auto") -> torch.Tensor:
    """(a @ w.T) * a_scale * w_scale (+ bias) in `out_dtype`: float8_e4m3fn a `[M, K]` and w `[N, K]`,
    a_scale `[1]` or `[M, 1]`, w_scale `[1]` or `[N, 1]` (vLLM's fp8 scheme)."""
    if resolve_backend(backend, a_fp8.device) != "triton":
        quant_reference.check_fp8(a_fp8, a_scale, w_fp8, w_scale)
        return quant_reference.fp8_gemm(a_fp8, a_scale, w_fp8, w_scale, out_dtype, bias)
    from kernels.triton.fp8_gemm import fp8_gemm as triton_op
    return triton_op(a_fp8, a_scale, w_fp8, w_scale, out_dtype, bias)
