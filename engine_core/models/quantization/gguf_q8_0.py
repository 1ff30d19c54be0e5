"""llama.cpp's Q8_0 blocks: SmolLM2's GGUF stores its embedding so, and the LM head is tied to it.

A block covers 32 consecutive weights of a row in 34 bytes: `d` (fp16, the step), then 32 int8 values q;
weight = q * d (symmetric, 8.5 bits a weight). `Q8_0LinearMethod` serves the file's blocks as the LM head
with `quantization="gguf"` at bf16 on CPU, as llama.cpp does: through `kernels.cpu.ggml_a8.ggml_mul_mat_a8` (int8
activations, integer dots: half the bytes a bf16 head streams per step). Elsewhere the head stays the dense
embedding (the converted folder holds q * d exactly).
"""
from __future__ import annotations

import torch
from torch import nn

from engine_core.models.quantization.base import LinearMethodBase, add_bias_residual
from engine_core.models.quantization.gguf_q4_1 import gguf_a8_applies
from kernels.cpu.ggml_a8 import ggml_mul_mat_a8, pack_q8_0

Q8_0_BLOCK_WEIGHTS, Q8_0_BLOCK_BYTES = 32, 34


def q8_0_parts(raw: torch.Tensor, n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A `[n, k]` matrix's Q8_0 blocks (uint8, row-major) -> (q int8 `[n, k]`, d fp16 `[n, k / 32]`), w = q * d."""
    if raw.dtype != torch.uint8 or k % Q8_0_BLOCK_WEIGHTS or raw.numel() != n * k // Q8_0_BLOCK_WEIGHTS * Q8_0_BLOCK_BYTES:
        raise ValueError(f"raw must be the uint8 Q8_0 blocks of a [{n}, {k}] matrix (k a multiple of "
                         f"{Q8_0_BLOCK_WEIGHTS}, {Q8_0_BLOCK_BYTES} bytes a block), got {raw.dtype} with {raw.numel()} "
                         f"elements")
    blocks = raw.reshape(n, k // Q8_0_BLOCK_WEIGHTS, Q8_0_BLOCK_BYTES)
    d = blocks[..., 0:2].contiguous().view(torch.float16)[..., 0]  # little-endian, as the file
    q = blocks[..., 2:].contiguous().view(torch.int8).reshape(n, k)
    return q, d.contiguous()


class Q8_0LinearMethod(LinearMethodBase):
    """A GGUF Q8_0 matrix `[n, k]` as a Linear through `ggml_mul_mat_a8` (where `gguf_a8_applies`)."""

    def __init__(self, raw: torch.Tensor, n: int, k: int, dtype: torch.dtype) -> None:
        if not gguf_a8_applies(raw.device, dtype):
            raise ValueError(f"Q8_0LinearMethod serves bf16 activations on CPU with the C kernels, got {dtype} on "
                             f"{raw.device}")
        self.parts, self.n, self.k = q8_0_parts(raw, n, k), n, k

    def create_weights(self, layer: nn.Module, weight: nn.Parameter | None, bias: nn.Parameter | None) -> None:
        layer.bias, layer.input_size, layer.output_size = bias, self.k, self.n

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        layer.ggml = pack_q8_0(*self.parts)
        del self.parts

    def apply(self, layer: nn.Module, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        return add_bias_residual(ggml_mul_mat_a8(x, layer.ggml), layer.bias, residual)

    def weight_bytes(self, layer: nn.Module) -> int:
        return layer.ggml.nbytes


def q8_0_head_method(blocks: dict[str, tuple[str, torch.Tensor]], embed: torch.Tensor) -> Q8_0LinearMethod | None:
    """The tied LM head from the file's Q8_0 embedding blocks, as llama.cpp serves it, where they can run
    (`gguf_a8_applies`) and match the embedding's shape; None: the dense head."""
    kind, raw = blocks.get("model.embed_tokens.weight", ("none", None))
    if (not gguf_a8_applies(embed.device, embed.dtype) or kind != "Q8_0"
            or raw.shape != (embed.shape[0], embed.shape[1] // Q8_0_BLOCK_WEIGHTS * Q8_0_BLOCK_BYTES)):
        return None
    return Q8_0LinearMethod(raw.reshape(-1), embed.shape[0], embed.shape[1], embed.dtype)
