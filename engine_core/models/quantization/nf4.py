"""QLoRA's NormalFloat4 (Dettmers et al., QLoRA, 2023, arXiv 2305.14314, and bitsandbytes' `quant_type="nf4"`):
`quantization="nf4"`.

NF4 has 16 levels placed at quantiles of a standard normal, rescaled to [-1, 1], with an exact 0: a weight
matrix (whose entries are close to normal) is cut into blocks of 64 consecutive weights, each block divided
by its absolute maximum (its fp32 `absmax`) and each weight stored as the index of the nearest level. Two
indices share a byte, the first in the high nibble (bitsandbytes' order). 4 bits + 32 / 64 = 4.5 bits a weight
(QLoRA's double quantization stores the absmax in 8 bits instead: 4.127). QLoRA trains a LoRA adapter on top of
the frozen NF4 base: `qlora_linear` is its forward (dequantize, base GEMM, LoRA delta). bitsandbytes is not a
dependency of the kit (its CPU build is partial); the tests check the levels against the paper's table and
their construction from normal quantiles.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine_core.models.quantization.base import LinearMethodBase, add_bias_residual

NF4_BLOCK = 64
# QLoRA, appendix E (bitsandbytes `get_4bit_type("nf4")`): index 7 is the exact zero
NF4_LEVELS = (-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
              -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
              0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
              0.7229568362236023, 1.0)


def _check_blocks(name: str, numel: int, block_size: int) -> None:
    if block_size <= 0 or block_size % 2 or numel % block_size:
        raise ValueError(f"{name} must hold a whole number of blocks of block_size={block_size} weights (an even "
                         f"block_size > 0 dividing its size), got {numel} weights")


# seam: lab 15 (grader/seams.py)
def nf4_quantize(weight: torch.Tensor, block_size: int = NF4_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """Any float tensor (flattened, row-major) -> (packed uint8 `[numel / 2]`: two level indices a byte, the
    first in the high nibble; absmax fp32 `[numel / block_size]`). Each weight becomes the index of the level
    nearest to weight / absmax of its block; an all-zero block has absmax 0 and every index 7 (the level 0)."""
    _check_blocks("weight", weight.numel(), block_size)
    blocks = weight.detach().reshape(-1, block_size).float()
    absmax = blocks.abs().amax(dim=1)
    scaled = blocks / absmax.clamp_min(torch.finfo(torch.float32).tiny)[:, None]
    levels = torch.tensor(NF4_LEVELS, dtype=torch.float32, device=weight.device)
    idx = (scaled[..., None] - levels).abs().argmin(dim=-1).to(torch.uint8).reshape(-1)
    return (idx[0::2] << 4) | idx[1::2], absmax


# seam: lab 15 (grader/seams.py)
def nf4_dequantize(packed: torch.Tensor, absmax: torch.Tensor, shape: tuple[int, ...] | torch.Size,
                   block_size: int = NF4_BLOCK, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """`nf4_quantize`'s output -> the weight of `shape` in `dtype`: level[index] * absmax of its block."""
    numel = 2 * packed.numel()
    _check_blocks("packed", numel, block_size)
    if absmax.numel() != numel // block_size or torch.Size(shape).numel() != numel:
        raise ValueError(f"absmax must hold one scale per block of {block_size} ({numel // block_size}) and shape "
                         f"{numel} weights, got {absmax.numel()} scales and shape {tuple(shape)}")
    idx = torch.stack([packed >> 4, packed & 0x0F], dim=-1).reshape(-1, block_size).long()
    levels = torch.tensor(NF4_LEVELS, dtype=torch.float32, device=packed.device)
    return (levels[idx] * absmax.float()[:, None]).reshape(shape).to(dtype)


# seam: lab 15 (grader/seams.py)
def qlora_linear(x: torch.Tensor, packed: torch.Tensor, absmax: torch.Tensor, weight_shape: tuple[int, int],
                 lora_a: torch.Tensor, lora_b: torch.Tensor, scaling: float,
                 block_size: int = NF4_BLOCK) -> torch.Tensor:
    """QLoRA's forward: x `[..., in]` @ W.T with W `[out, in]` dequantized from NF4 into x's dtype, plus
    scaling * (x @ A.T) @ B.T (A `[r, in]`, B `[out, r]`). Output `[..., out]` in x's dtype."""
    w = nf4_dequantize(packed, absmax, weight_shape, block_size, x.dtype)
    return F.linear(x, w) + scaling * F.linear(F.linear(x, lora_a.to(x.dtype)), lora_b.to(x.dtype))


class NF4LinearMethod(LinearMethodBase):
    """Weights quantized to NF4 at load (blocks of 64 along each row), dequantized into the activations' dtype
    at every GEMM: QLoRA's frozen base, served. Memory-faithful (4.5 bits a weight), not fast: no kernel."""

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        w = layer.weight.detach()
        layer.nf4_shape, layer.dtype = tuple(w.shape), w.dtype
        layer.nf4_packed, layer.nf4_absmax = nf4_quantize(w, NF4_BLOCK)
        del layer.weight

    def apply(self, layer: nn.Module, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        w = nf4_dequantize(layer.nf4_packed, layer.nf4_absmax, layer.nf4_shape, NF4_BLOCK, x.dtype)
        return add_bias_residual(F.linear(x, w), layer.bias, residual)

    def weight_bytes(self, layer: nn.Module) -> int:
        return layer.nf4_packed.nbytes + layer.nf4_absmax.nbytes
