"""GPTQ checkpoints' zero points (AutoGPTQ's `qzeros`): packed along N, stored minus one.

`qweight` packs along K (rtn.py's layout); `qzeros` int32 `[K / group_size, N * bits / 32]` packs the
integer zeros of each group along the output dimension, 32 / bits per word, value i at bits
[i * bits, (i + 1) * bits), and AutoGPTQ's packer stores z - 1 (a long-standing quirk kept for
compatibility: vLLM's GPTQ kernels add the 1 back). A loader that forgets the 1 shifts every
dequantized weight by one step s.
"""
from __future__ import annotations

import torch


# seam: lab 13 (grader/seams.py)
def unpack_gptq_qzeros(qzeros: torch.Tensor, bits: int) -> torch.Tensor:
    """`qzeros` int32 `[G, N * bits / 32]` -> the zero points int32 `[G, N]` (unpacked, plus one)."""
    if bits not in (4, 8):
        raise ValueError(f"bits must be 4 or 8, got {bits}")
    per = 32 // bits
    shifts = torch.arange(per, device=qzeros.device, dtype=torch.int32) * bits
    values = (qzeros[:, :, None] >> shifts) & (2**bits - 1)  # [G, words, per]: word w holds columns w*per ..
    return values.reshape(qzeros.shape[0], -1) + 1
