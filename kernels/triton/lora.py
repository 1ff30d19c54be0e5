"""Triton multi-LoRA kernels in the Punica style: segmented gather matmuls (SGMV) for prefill
chunks, batched gather matrix-vector products (BGMV) for decode rows. Same contracts as
`kernels.lora_reference`.

* SGMV: one program per (segment, BLOCK_M rows of it[, BLOCK_N output columns]). A segment's
  rows share one adapter, so its A / B tile is loaded once per program and multiplied on the
  tensor cores (`tl.dot`) against BLOCK_M rows: the work of a prefill chunk is a real GEMM.
* BGMV: one program per row (per BLOCK_N output columns for the expand). Decode has one row
  per sequence and each may use another adapter: a matrix-vector product per row, the adapter's
  tile gathered by the row's slot. Rank is small (<= a few hundred), so the whole rank fits in one
  tile and the shrink loops over the input features, the expand over nothing.
* Shrink output (the `[T, R]` intermediate) is float32; expand adds `scaling * t @ B.T` into y in
  fp32 and rounds once. Rows with slot -1 are masked out: nothing loaded, nothing written.
The grids depend on host-known sizes (rows, segments, the longest segment): no device reads.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton._common import INTERPRET, check_device, device_capability, dot, upcast_dot

BLOCK_M, BLOCK_K, BLOCK_N = 16, 64, 64


def _block_r(rank: int) -> int:
    return max(16, triton.next_power_of_2(rank))


def sgmv_tiles(capability: tuple[int, int] | None) -> tuple[int, int, int]:
    """(BLOCK_K of the shrink, BLOCK_N of the expand, num_warps) of the SGMV kernels. A T4 (sm_75) gets no
    tensor-core dot from Triton, so the tiles' operands sit in registers: half-size tiles over 8 warps keep
    rank 64 within 128 registers there, where 64-wide tiles over 4 warps spilled (`make gpu-compile`)."""
    if INTERPRET:
        return BLOCK_K, BLOCK_N, 1
    if capability is not None and capability < (8, 0):
        return 32, 16, 8
    return BLOCK_K, BLOCK_N, 4


@triton.jit
def _sgmv_shrink_kernel(x_ptr, a_ptr, out_ptr, seg_starts_ptr, seg_slots_ptr, K, R,
                        stride_xm, stride_al, stride_ar, stride_om,
                        BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr, UPCAST: tl.constexpr):
    seg = tl.program_id(0)
    slot = tl.load(seg_slots_ptr + seg)
    end = tl.load(seg_starts_ptr + seg + 1)
    rows = tl.load(seg_starts_ptr + seg) + tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = (rows < end) & (slot >= 0)
    r = tl.arange(0, BLOCK_R)
    r_mask = (r < R) & (slot >= 0)
    a_base = a_ptr + tl.maximum(slot, 0).to(tl.int64) * stride_al
    acc = tl.zeros([BLOCK_M, BLOCK_R], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + rows[:, None] * stride_xm + k[None, :], mask=row_mask[:, None] & (k < K)[None, :],
                    other=0.0)
        a = tl.load(a_base + r[None, :] * stride_ar + k[:, None], mask=(k < K)[:, None] & r_mask[None, :],
                    other=0.0)  # A[slot].T tile: [BLOCK_K, BLOCK_R]
        acc += dot(x, a, UPCAST)
    tl.store(out_ptr + rows[:, None] * stride_om + r[None, :], acc, mask=row_mask[:, None] & (r < R)[None, :])


@triton.jit
def _sgmv_expand_kernel(t_ptr, b_ptr, y_ptr, scaling_ptr, seg_starts_ptr, seg_slots_ptr, N, R,
                        stride_tm, stride_bl, stride_bn, stride_ym,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, UPCAST: tl.constexpr):
    seg = tl.program_id(0)
    slot = tl.load(seg_slots_ptr + seg)
    end = tl.load(seg_starts_ptr + seg + 1)
    rows = tl.load(seg_starts_ptr + seg) + tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = (rows < end) & (slot >= 0)
    n = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = n < N
    r = tl.arange(0, BLOCK_R)
    r_mask = r < R
    safe = tl.maximum(slot, 0).to(tl.int64)
    t = tl.load(t_ptr + rows[:, None] * stride_tm + r[None, :], mask=row_mask[:, None] & r_mask[None, :], other=0.0)
    b = tl.load(b_ptr + safe * stride_bl + n[None, :] * stride_bn + r[:, None],
                mask=r_mask[:, None] & n_mask[None, :] & (slot >= 0), other=0.0)  # B[slot].T tile: [BLOCK_R, BLOCK_N]
    if not UPCAST:
        t = t.to(b.dtype)  # the tensor-core path: fp16/bf16 operands, fp32 accumulation
    delta = dot(t, b, UPCAST) * tl.load(scaling_ptr + safe, mask=slot >= 0, other=0.0)
    mask = row_mask[:, None] & n_mask[None, :]
    y_ptrs = y_ptr + rows[:, None] * stride_ym + n[None, :]
    y = tl.load(y_ptrs, mask=mask, other=0.0)
    tl.store(y_ptrs, (y.to(tl.float32) + delta).to(y.dtype), mask=mask)


@triton.jit
def _bgmv_shrink_kernel(x_ptr, a_ptr, out_ptr, row_slots_ptr, K, R, stride_xm, stride_al, stride_ar, stride_om,
                        BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr):
    row = tl.program_id(0)
    slot = tl.load(row_slots_ptr + row)
    r = tl.arange(0, BLOCK_R)
    r_mask = (r < R) & (slot >= 0)
    a_base = a_ptr + tl.maximum(slot, 0).to(tl.int64) * stride_al
    acc = tl.zeros([BLOCK_R], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_mask = (k < K) & (slot >= 0)
        x = tl.load(x_ptr + row * stride_xm + k, mask=k_mask, other=0.0).to(tl.float32)
        a = tl.load(a_base + r[:, None] * stride_ar + k[None, :], mask=r_mask[:, None] & k_mask[None, :],
                    other=0.0).to(tl.float32)
        acc += tl.sum(a * x[None, :], axis=1)
    tl.store(out_ptr + row * stride_om + r, acc, mask=(r < R) & (slot >= 0))


@triton.jit
def _bgmv_expand_kernel(t_ptr, b_ptr, y_ptr, scaling_ptr, row_slots_ptr, N, R, stride_tm, stride_bl, stride_bn,
                        stride_ym, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr):
    row = tl.program_id(0)
    slot = tl.load(row_slots_ptr + row)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = (n < N) & (slot >= 0)
    r = tl.arange(0, BLOCK_R)
    r_mask = (r < R) & (slot >= 0)
    safe = tl.maximum(slot, 0).to(tl.int64)
    t = tl.load(t_ptr + row * stride_tm + r, mask=r_mask, other=0.0)
    b = tl.load(b_ptr + safe * stride_bl + n[:, None] * stride_bn + r[None, :], mask=n_mask[:, None] & r_mask[None, :],
                other=0.0).to(tl.float32)
    delta = tl.sum(b * t[None, :], axis=1) * tl.load(scaling_ptr + safe, mask=slot >= 0, other=0.0)
    y = tl.load(y_ptr + row * stride_ym + n, mask=n_mask, other=0.0)
    tl.store(y_ptr + row * stride_ym + n, (y.to(tl.float32) + delta).to(y.dtype), mask=n_mask)


def _check(x: torch.Tensor, weights: torch.Tensor, what: str, *others: torch.Tensor) -> None:
    check_device(x, weights, *others)
    if x.dim() != 2 or weights.dim() != 3:
        raise ValueError(f"{what}: x must be [T, features] and the slot weights [num_slots, rows, cols], got "
                         f"{tuple(x.shape)} and {tuple(weights.shape)}")
    if x.stride(-1) != 1 or weights.stride(-1) != 1:
        raise ValueError(f"{what}: x and the slot weights need a contiguous last dim")


def bgmv_shrink(x: torch.Tensor, lora_a: torch.Tensor, row_slots: torch.Tensor) -> torch.Tensor:
    _check(x, lora_a, "bgmv_shrink", row_slots)
    num_rows, k = x.shape
    rank = lora_a.shape[1]
    out = torch.empty(num_rows, rank, dtype=torch.float32, device=x.device)
    if num_rows:
        out.zero_()  # rows with slot -1 are never written
        _bgmv_shrink_kernel[(num_rows,)](x, lora_a, out, row_slots, k, rank, x.stride(0), lora_a.stride(0),
                                         lora_a.stride(1), out.stride(0), BLOCK_K=BLOCK_K, BLOCK_R=_block_r(rank),
                                         num_warps=1 if INTERPRET else 4)
    return out


def bgmv_expand(y: torch.Tensor, t: torch.Tensor, lora_b: torch.Tensor, row_slots: torch.Tensor,
                scaling: torch.Tensor) -> None:
    _check(y, lora_b, "bgmv_expand", t, row_slots, scaling)
    num_rows, n = y.shape
    if num_rows:
        _bgmv_expand_kernel[(num_rows, triton.cdiv(n, BLOCK_N))](
            t, lora_b, y, scaling, row_slots, n, lora_b.shape[2], t.stride(0), lora_b.stride(0), lora_b.stride(1),
            y.stride(0), BLOCK_N=BLOCK_N, BLOCK_R=_block_r(lora_b.shape[2]), num_warps=1 if INTERPRET else 4)


def sgmv_shrink(x: torch.Tensor, lora_a: torch.Tensor, seg_starts: torch.Tensor, seg_slots: torch.Tensor,
                max_seg_len: int) -> torch.Tensor:
    _check(x, lora_a, "sgmv_shrink", seg_starts, seg_slots)
    k, rank = x.shape[1], lora_a.shape[1]
    out = torch.zeros(x.shape[0], rank, dtype=torch.float32, device=x.device)
    if len(seg_slots) and max_seg_len > 0:
        block_k, _, warps = sgmv_tiles(device_capability(x))
        _sgmv_shrink_kernel[(len(seg_slots), triton.cdiv(max_seg_len, BLOCK_M))](
            x, lora_a, out, seg_starts, seg_slots, k, rank, x.stride(0), lora_a.stride(0), lora_a.stride(1),
            out.stride(0), BLOCK_M=BLOCK_M, BLOCK_K=block_k, BLOCK_R=_block_r(rank), UPCAST=upcast_dot(x.dtype),
            num_warps=warps)
    return out


def sgmv_expand(y: torch.Tensor, t: torch.Tensor, lora_b: torch.Tensor, seg_starts: torch.Tensor,
                seg_slots: torch.Tensor, max_seg_len: int, scaling: torch.Tensor) -> None:
    _check(y, lora_b, "sgmv_expand", t, seg_starts, seg_slots, scaling)
    n = y.shape[1]
    if len(seg_slots) and max_seg_len > 0:
        _, block_n, warps = sgmv_tiles(device_capability(y))
        grid = (len(seg_slots), triton.cdiv(max_seg_len, BLOCK_M), triton.cdiv(n, block_n))
        _sgmv_expand_kernel[grid](
            t, lora_b, y, scaling, seg_starts, seg_slots, n, lora_b.shape[2], t.stride(0), lora_b.stride(0),
            lora_b.stride(1), y.stride(0), BLOCK_M=BLOCK_M, BLOCK_N=block_n, BLOCK_R=_block_r(lora_b.shape[2]),
            UPCAST=upcast_dot(y.dtype), num_warps=warps)
