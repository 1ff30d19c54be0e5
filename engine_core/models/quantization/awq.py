"""AWQ checkpoints (AutoAWQ's GEMM layout, vLLM's awq.py): 4-bit values packed along N, interleaved.

`qweight` int32 `[K, N / 8]` and `qzeros` int32 `[K / group_size, N / 8]`: word j of a row holds columns
8j .. 8j + 7, but nibble i (bits [4i, 4i + 4)) holds column 8j + AWQ_ORDER[i], the order AutoAWQ's
packer writes so its CUDA kernel can dequantize two halves with one shift. The zeros are the real
zeros (no GPTQ minus-one); `scales` `[K / group_size, N]`; no `g_idx` (groups are always contiguous).
"""
from __future__ import annotations

import torch

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of a word holds column AWQ_ORDER[i] of its 8


def unpack_awq(packed: torch.Tensor) -> torch.Tensor:
    """int32 `[R, N / 8]` (AutoAWQ's interleaved nibbles) -> the values int32 `[R, N]`."""
    shifts = torch.arange(8, device=packed.device, dtype=torch.int32) * 4
    nibbles = (packed[:, :, None] >> shifts) & 0xF  # [R, words, 8]: nibble i is column AWQ_ORDER[i]
    inverse = torch.tensor(AWQ_ORDER, device=packed.device).argsort()  # column c sits in nibble inverse[c]
    return nibbles[:, :, inverse].reshape(packed.shape[0], -1)
