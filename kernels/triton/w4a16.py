"""W4A16 dequant-in-GEMM: int4 weights in GPTQ's layout times fp16/bf16 activations (`kernels.quant_reference`'s
`w4a16_gemm` is the contract).

The idea of exllama's and Marlin's kernels without their hand-tuned layouts: the weight stays packed in
memory (0.5 bytes a value plus a scale and a zero per group), each program streams its `[BLOCK_K / 8, BLOCK_N]`
tile of words (each read once), unpacks the 8 nibbles of each in registers (K row 8r + j is nibble j of word
row r), dequantizes them with its group's scale and zero and feeds the tensor cores in the activations' dtype,
accumulating in fp32. Decode (M small) is bound by the weight bytes, so reading a quarter of bf16's bytes is the
whole speedup; split-K (_gemm_tiles.py) puts enough programs on the GPU to stream them at the HBM rate.
BLOCK_K divides the group size, so a K tile has one scale and one zero per column (one row load). Integer
zeros (GPTQ, AWQ) dequantize as (q - z) * s, float ones (GGUF Q4_1's minimum) as q * s + zero.

Act-order (`perm`): the loader stores K in `argsort(g_idx)` order so groups are contiguous again, and the
kernel reads the activation columns through `perm` (a gather along K of x only: x is small in decode).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.quant_reference import check_w4a16
from kernels.triton._common import INTERPRET, check_device, dot, upcast_dot
from kernels.triton._gemm_tiles import gemm_tiles


@triton.jit
def _w4a16_kernel(x_ptr, qweight_ptr, scales_ptr, zeros_ptr, perm_ptr, out_ptr, M, N, K, tiles_per_split,
                  stride_xm, stride_qk, stride_sg, stride_zg, stride_os, stride_om,
                  GROUP_SIZE: tl.constexpr, HAS_PERM: tl.constexpr, FLOAT_ZEROS: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, UPCAST: tl.constexpr):
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask, n_mask = rm < M, rn < N
    rk = tl.arange(0, BLOCK_K)
    rw = tl.arange(0, BLOCK_K // 8)  # the tile's words along K: each word is read once, unpacked in registers
    shifts = tl.arange(0, 8) * 4
    w_mask = (rw < BLOCK_K // 8)[:, None] & n_mask[None, :]
    split = tl.program_id(2)  # split-K: this program's contiguous range of K tiles (_gemm_tiles.py)
    k_begin = split * tiles_per_split * BLOCK_K
    k_end = tl.minimum(K, k_begin + tiles_per_split * BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(k_begin, k_end, BLOCK_K):  # K % BLOCK_K == 0 (BLOCK_K divides GROUP_SIZE, which divides K)
        k = k0 + rk
        if HAS_PERM:
            cols = tl.load(perm_ptr + k)
        else:
            cols = k
        a = tl.load(x_ptr + rm[:, None].to(tl.int64) * stride_xm + cols[None, :], mask=m_mask[:, None], other=0.0)
        words = tl.load(qweight_ptr + (k0 // 8 + rw)[:, None].to(tl.int64) * stride_qk + rn[None, :], mask=w_mask,
                        other=0)
        q = (words[:, None, :] >> shifts[None, :, None]) & 0xF  # [BLOCK_K / 8, 8, BLOCK_N]: K row 8r + j
        q = tl.reshape(q, (BLOCK_K, BLOCK_N)).to(tl.float32)
        g = k0 // GROUP_SIZE
        s = tl.load(scales_ptr + g * stride_sg + rn, mask=n_mask, other=0.0).to(tl.float32)
        z = tl.load(zeros_ptr + g * stride_zg + rn, mask=n_mask, other=0).to(tl.float32)
        if FLOAT_ZEROS:
            w = q * s[None, :] + z[None, :]
        else:
            w = (q - z[None, :]) * s[None, :]
        if not UPCAST:
            w = w.to(x_ptr.dtype.element_ty)
        acc += dot(a, w, UPCAST)
    tl.store(out_ptr + split * stride_os + rm[:, None].to(tl.int64) * stride_om + rn[None, :],
             acc.to(out_ptr.dtype.element_ty),
             mask=m_mask[:, None] & n_mask[None, :])


def block_k_for(group_size: int) -> int:
    """The largest K tile in 64, 32, 16 that divides `group_size` (tl.dot needs >= 16). Not 128: the
    unpacked [BLOCK_K, BLOCK_N] weight tile is built in registers, and at 128 the kernel sat at 255 registers
    per thread (the occupancy floor) and spilled at M = 256 (`make gpu-compile`)."""
    for b in (64, 32, 16):
        if group_size % b == 0:
            return b
    raise ValueError(f"group_size must be a multiple of 16 for the Triton W4A16 kernel, got {group_size}")


def max_block_m_for(major: int) -> int:
    """Tallest output tile: a T4 (sm_75) has no MMA that Triton uses, so the operands and accumulator of a tall
    tile live in registers there (`make gpu-compile`, docs/gpu_targets.md: 16 rows fit the budget)."""
    return 16 if major < 8 else 128


def w4a16_gemm(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
               group_size: int, perm: torch.Tensor | None = None) -> torch.Tensor:
    """x `[M, K]` fp16/bf16/fp32 @ the int4 weight `[N, K]`.T -> `[M, N]` in x's dtype (contract:
    `kernels.quant_reference.w4a16_gemm`)."""
    check_w4a16(x, qweight, scales, zeros, group_size, perm)
    check_device(x, qweight, scales, zeros, *([] if perm is None else [perm]))
    m, k = x.shape
    n = qweight.shape[1]
    if m == 0 or n == 0:
        return torch.empty(m, n, dtype=x.dtype, device=x.device)
    x = x if x.stride(1) == 1 else x.contiguous()
    qweight, scales, zeros = qweight.contiguous(), scales.contiguous(), zeros.contiguous()
    perm_arg = qweight if perm is None else perm.to(torch.int32).contiguous()  # unread without HAS_PERM
    sms = torch.cuda.get_device_properties(x.device).multi_processor_count if x.is_cuda else 1
    cfg, split, per_split = gemm_tiles(m, n, k, block_k_for(group_size), sms, INTERPRET, max_block_n=64,
                                       max_block_m=max_block_m_for(torch.cuda.get_device_capability(x.device)[0]
                                                                   if x.is_cuda else 8))
    # split-K partials in fp32, added in a fixed order; one split writes the output directly
    out = torch.empty(split, m, n, dtype=torch.float32 if split > 1 else x.dtype, device=x.device)
    grid = (triton.cdiv(m, cfg["BLOCK_M"]), triton.cdiv(n, cfg["BLOCK_N"]), split)
    _w4a16_kernel[grid](x, qweight, scales, zeros, perm_arg, out, m, n, k, per_split,
                        x.stride(0), qweight.stride(0), scales.stride(0), zeros.stride(0), out.stride(0),
                        out.stride(1), GROUP_SIZE=group_size, HAS_PERM=perm is not None,
                        FLOAT_ZEROS=zeros.is_floating_point(), UPCAST=upcast_dot(x.dtype), **cfg)
    return out[0] if split == 1 else out.sum(dim=0).to(x.dtype)
