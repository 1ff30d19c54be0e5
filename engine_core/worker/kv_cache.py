"""The KV cache tensors: per layer one K and one V of `[num_blocks, block_size, num_kv_heads, head_dim]`.

Slot `s` of a layer is `cache.view(-1, num_kv_heads, head_dim)[s]`, i.e. block `s // block_size`,
offset `s % block_size` (the kernel contract, docs/kernel_contract.md). The device cache is in the model dtype, or in
an fp8 format (`kv_cache_dtype` "fp8"/"fp8_e4m3" or "fp8_e5m2") or int8 ("int8") with one K and one V scale per layer: fp32
tensors of shape `[]`, or `[num_kv_heads]` with per-head scales, updated in place (CUDA graphs read them
where they are). The CPU swap pool has the same layout; block copies are batched: one indexed copy per
layer and direction, fp8 blocks moved as bytes.
"""
from __future__ import annotations

from typing import Callable

import torch

from engine_core.models.attention import LayerKV
from kernels.fp8 import is_fp8, is_quantized_kv, kv_storage_dtype

# Called by attention with each layer's new K and V `[num_tokens, num_kv_heads, head_dim]` before they
# are written: how dynamic scales and calibration see the values (engine_core/worker/kv_scales.py).
KVObserver = Callable[[int, torch.Tensor, torch.Tensor], None]


def swap_blocks(src: torch.Tensor, dst: torch.Tensor, mapping: torch.Tensor) -> None:
    """dst[mapping[:, 1]] = src[mapping[:, 0]] for `[n, 2]` block-id pairs, across devices, in one copy."""
    if mapping.numel() == 0:
        return
    src_ids = mapping[:, 0].to(src.device)
    dst_ids = mapping[:, 1].to(dst.device)
    if is_fp8(src.dtype):  # index_copy_ has no fp8 kernel on CPU; the bytes are what moves anyway
        src, dst = src.view(torch.uint8), dst.view(torch.uint8)
    dst.index_copy_(0, dst_ids, src.index_select(0, src_ids).to(dst.device))


class KVCache:
    """Device KV cache + CPU swap pool for every layer, and the fp8 scales (1.0 until set)."""

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device, kv_cache_dtype: str = "auto", num_cpu_blocks: int = 0,
                 per_head_scales: bool = False) -> None:
        self.kv_cache_dtype = kv_cache_dtype
        self.dtype = kv_storage_dtype(kv_cache_dtype) or dtype
        if per_head_scales and not is_quantized_kv(self.dtype):
            raise ValueError(f"per-head scales need an fp8 or int8 kv_cache_dtype, got {kv_cache_dtype!r}")
        self.block_size = block_size
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        cpu_shape = (num_cpu_blocks, block_size, num_kv_heads, head_dim)
        pin = device.type == "cuda"
        self.key = [torch.zeros(shape, dtype=self.dtype, device=device) for _ in range(num_layers)]
        self.value = [torch.zeros(shape, dtype=self.dtype, device=device) for _ in range(num_layers)]
        self.cpu_key = [torch.zeros(cpu_shape, dtype=self.dtype, pin_memory=pin) for _ in range(num_layers)]
        self.cpu_value = [torch.zeros(cpu_shape, dtype=self.dtype, pin_memory=pin) for _ in range(num_layers)]
        # fp32 tensors: kernels take them as-is, and CUDA graphs see updates in place.
        scale_shape = (num_kv_heads,) if per_head_scales else ()
        self.k_scale = [torch.ones(scale_shape, dtype=torch.float32, device=device) for _ in range(num_layers)]
        self.v_scale = [torch.ones(scale_shape, dtype=torch.float32, device=device) for _ in range(num_layers)]
        self.observer: KVObserver | None = None

    @property
    def num_layers(self) -> int:
        return len(self.key)

    @property
    def num_blocks(self) -> int:
        return self.key[0].shape[0]

    def layer(self, i: int) -> LayerKV:
        """Layer i's K and V caches and scales, as the model's attention reads them."""
        return LayerKV(self.key[i], self.value[i], self.k_scale[i], self.v_scale[i])

    def set_scales(self, k_scales: list[torch.Tensor], v_scales: list[torch.Tensor]) -> None:
        """Per layer, K and V scales broadcastable to the cache's (`[]`, or `[num_kv_heads]`), copied in place."""
        for dst, src in zip(self.k_scale + self.v_scale, k_scales + v_scales, strict=True):
            dst.copy_(src)

    def swap_out(self, pairs: list[tuple[int, int]]) -> None:
        """(gpu_block, cpu_block) pairs: device -> CPU pool."""
        if pairs:
            m = torch.tensor(pairs, dtype=torch.int64)
            for layer in range(self.num_layers):
                swap_blocks(self.key[layer], self.cpu_key[layer], m)
                swap_blocks(self.value[layer], self.cpu_value[layer], m)

    def swap_in(self, pairs: list[tuple[int, int]]) -> None:
        """(cpu_block, gpu_block) pairs: CPU pool -> device."""
        if pairs:
            m = torch.tensor(pairs, dtype=torch.int64)
            for layer in range(self.num_layers):
                swap_blocks(self.cpu_key[layer], self.key[layer], m)
                swap_blocks(self.cpu_value[layer], self.value[layer], m)
