"""The KV cache tensors: per layer one K and one V of `[num_blocks, block_size, num_kv_heads, head_dim]`.

Slot `s` of a layer is `cache.view(-1, num_kv_heads, head_dim)[s]`, i.e. block `s // block_size`,
offset `s % block_size` (the kernel contract, docs/architecture.md). The device cache is in the model dtype, or in
float8_e4m3fn with one K and one V scale per layer (`kv_cache_dtype="fp8_e4m3"`). The CPU swap
pool has the same layout; block copies are batched: one indexed copy per layer and direction.
"""
from __future__ import annotations

import torch

from kernels.reference import FP8_DTYPE, FP8_MAX


def swap_blocks(src: torch.Tensor, dst: torch.Tensor, mapping: torch.Tensor) -> None:
    """dst[mapping[:, 1]] = src[mapping[:, 0]] for `[n, 2]` block-id pairs, across devices, in one copy."""
    if mapping.numel() == 0:
        return
    src_ids = mapping[:, 0].to(src.device)
    dst_ids = mapping[:, 1].to(dst.device)
    dst.index_copy_(0, dst_ids, src.index_select(0, src_ids).to(dst.device))


class KVCache:
    """Device KV cache + CPU swap pool for every layer, and the fp8 scales."""

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device, kv_cache_dtype: str = "auto", num_cpu_blocks: int = 0,
                 calculate_kv_scales: bool = False) -> None:
        if kv_cache_dtype not in ("auto", "fp8_e4m3"):
            raise ValueError(f"kv_cache_dtype must be 'auto' or 'fp8_e4m3', got {kv_cache_dtype!r}")
        self.kv_cache_dtype = kv_cache_dtype
        self.dtype = FP8_DTYPE if kv_cache_dtype == "fp8_e4m3" else dtype
        self.block_size = block_size
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        cpu_shape = (num_cpu_blocks, block_size, num_kv_heads, head_dim)
        pin = device.type == "cuda"
        self.key = [torch.zeros(shape, dtype=self.dtype, device=device) for _ in range(num_layers)]
        self.value = [torch.zeros(shape, dtype=self.dtype, device=device) for _ in range(num_layers)]
        self.cpu_key = [torch.zeros(cpu_shape, dtype=self.dtype, pin_memory=pin) for _ in range(num_layers)]
        self.cpu_value = [torch.zeros(cpu_shape, dtype=self.dtype, pin_memory=pin) for _ in range(num_layers)]
        # 0-dim fp32 tensors: kernels take them as-is, and CUDA graphs see updates in place.
        self.k_scale = [torch.ones((), dtype=torch.float32, device=device) for _ in range(num_layers)]
        self.v_scale = [torch.ones((), dtype=torch.float32, device=device) for _ in range(num_layers)]
        self.needs_scales = kv_cache_dtype == "fp8_e4m3" and calculate_kv_scales

    @property
    def num_layers(self) -> int:
        return len(self.key)

    @property
    def num_blocks(self) -> int:
        return self.key[0].shape[0]

    def calibrate_scales(self, layer: int, key: torch.Tensor, value: torch.Tensor) -> None:
        """Dynamic fp8 scales from the first forward's K/V: amax / 448 (fp8 e4m3's largest value)."""
        self.k_scale[layer].fill_(float(key.abs().amax().clamp_min(1e-6)) / FP8_MAX)
        self.v_scale[layer].fill_(float(value.abs().amax().clamp_min(1e-6)) / FP8_MAX)
        if layer == self.num_layers - 1:
            self.needs_scales = False

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
