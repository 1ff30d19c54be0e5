"""Attention, cache and multi-LoRA ops with one contract and two backends.

CUDA tensors go to the Triton kernels, CPU tensors to the PyTorch reference, unless the
backend is forced: `backend="triton"` / `"torch"` on a call, or `KERNELS_BACKEND=triton|torch`
in the environment (the default for `backend="auto"`). Triton on CPU tensors runs under the
interpreter, which needs `TRITON_INTERPRET=1` set before triton is imported. triton itself is
imported only when a Triton op first runs, so `import kernels` stays cheap.
"""
from __future__ import annotations

import os

import torch

from kernels import lora_reference, reference

__all__ = ["bgmv_expand", "bgmv_shrink", "paged_attention", "paged_attention_decode", "reshape_and_cache",
           "resolve_backend", "sgmv_expand", "sgmv_shrink"]

BACKENDS = ("auto", "torch", "triton")


def resolve_backend(backend: str, device: torch.device) -> str:
    """'torch' or 'triton' for tensors on `device`; raises before any work if Triton cannot run."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        backend = os.environ.get("KERNELS_BACKEND", "auto") or "auto"
        if backend not in BACKENDS:
            raise ValueError(f"KERNELS_BACKEND must be one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        return "triton" if device.type == "cuda" else "torch"
    interpret = os.environ.get("TRITON_INTERPRET", "").strip().lower() in ("1", "true", "on", "yes")
    if backend == "triton" and device.type != "cuda" and not interpret:
        raise RuntimeError(f"the Triton backend got {device.type} tensors: set TRITON_INTERPRET=1 in the environment "
                           "before triton is first imported to run it under the interpreter, or use backend='torch'")
    return backend


def reshape_and_cache(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                      slot_mapping: torch.Tensor, kv_cache_dtype: str = "auto",
                      k_scale: float | torch.Tensor = 1.0, v_scale: float | torch.Tensor = 1.0, *,
                      backend: str = "auto") -> None:
    """Write key/value `[num_tokens, num_kv_heads, head_dim]` into the paged caches at `slot_mapping`."""
    if resolve_backend(backend, key.device) == "torch":
        return reference.reshape_and_cache(key, value, key_cache, value_cache, slot_mapping, kv_cache_dtype,
                                           k_scale, v_scale)
    from kernels.triton.cache import reshape_and_cache as triton_op
    return triton_op(key, value, key_cache, value_cache, slot_mapping, kv_cache_dtype, k_scale, v_scale)


def paged_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                    block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
                    scale: float, k_scale: float | torch.Tensor = 1.0, v_scale: float | torch.Tensor = 1.0, *,
                    backend: str = "auto") -> torch.Tensor:
    """Varlen causal attention over paged KV (prefill chunks and decode rows alike)."""
    if resolve_backend(backend, query.device) == "torch":
        return reference.paged_attention(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc,
                                         scale, k_scale, v_scale)
    from kernels.triton.prefill_attention import paged_attention as triton_op
    return triton_op(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale, k_scale, v_scale)


def paged_attention_decode(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                           k_scale: float | torch.Tensor = 1.0, v_scale: float | torch.Tensor = 1.0,
                           num_splits: int = 1, *, backend: str = "auto") -> torch.Tensor:
    """One query row per sequence over its whole context; `num_splits > 1` is flash-decoding."""
    if resolve_backend(backend, query.device) == "torch":
        return reference.paged_attention_decode(query, key_cache, value_cache, block_tables, seq_lens, scale,
                                                k_scale, v_scale, num_splits)
    from kernels.triton.decode_attention import paged_attention_decode as triton_op
    return triton_op(query, key_cache, value_cache, block_tables, seq_lens, scale, k_scale, v_scale, num_splits)


# ---- multi-LoRA (Punica's SGMV / BGMV; contracts in kernels.lora_reference) ------------------------------
def bgmv_shrink(x: torch.Tensor, lora_a: torch.Tensor, row_slots: torch.Tensor, *,
                backend: str = "auto") -> torch.Tensor:
    """t[i] = x[i] @ lora_a[row_slots[i]].T in float32 (0 where the slot is -1): decode rows."""
    if resolve_backend(backend, x.device) == "torch":
        return lora_reference.bgmv_shrink(x, lora_a, row_slots)
    from kernels.triton.lora import bgmv_shrink as triton_op
    return triton_op(x, lora_a, row_slots)


def bgmv_expand(y: torch.Tensor, t: torch.Tensor, lora_b: torch.Tensor, row_slots: torch.Tensor,
                scaling: torch.Tensor, *, backend: str = "auto") -> None:
    """y[i] += scaling[s] * t[i] @ lora_b[s].T for s = row_slots[i] >= 0, in place: decode rows."""
    if resolve_backend(backend, y.device) == "torch":
        return lora_reference.bgmv_expand(y, t, lora_b, row_slots, scaling)
    from kernels.triton.lora import bgmv_expand as triton_op
    return triton_op(y, t, lora_b, row_slots, scaling)


def sgmv_shrink(x: torch.Tensor, lora_a: torch.Tensor, seg_starts: torch.Tensor, seg_slots: torch.Tensor,
                max_seg_len: int, *, backend: str = "auto") -> torch.Tensor:
    """bgmv_shrink for segments of rows sharing a slot (rows seg_starts[j]:seg_starts[j+1]): prefill chunks."""
    if resolve_backend(backend, x.device) == "torch":
        return lora_reference.sgmv_shrink(x, lora_a, seg_starts, seg_slots, max_seg_len)
    from kernels.triton.lora import sgmv_shrink as triton_op
    return triton_op(x, lora_a, seg_starts, seg_slots, max_seg_len)


def sgmv_expand(y: torch.Tensor, t: torch.Tensor, lora_b: torch.Tensor, seg_starts: torch.Tensor,
                seg_slots: torch.Tensor, max_seg_len: int, scaling: torch.Tensor, *, backend: str = "auto") -> None:
    """bgmv_expand for segments of rows sharing a slot: prefill chunks."""
    if resolve_backend(backend, y.device) == "torch":
        return lora_reference.sgmv_expand(y, t, lora_b, seg_starts, seg_slots, max_seg_len, scaling)
    from kernels.triton.lora import sgmv_expand as triton_op
    return triton_op(y, t, lora_b, seg_starts, seg_slots, max_seg_len, scaling)
