"""GGUF matrices in llama.cpp's CPU arithmetic: int8 activations, integer dots (csrc/ggml_mul_mat_a8.c).

A `GgmlA8Weight` holds a Q4_1 or Q8_0 matrix in the kernel's layout; `ggml_mul_mat_a8(x, w)` quantizes x's
rows per 32 values to int8 (ggml's Q8_1) and sums integer dots per block, scaled once (contract:
`kernels.quant_reference.ggml_a8_gemm`). On AVX512-VNNI CPUs a dot is vpdpbusd over 16 output rows at once
(64 byte products an instruction), where torch's int4 kernel widens each weight to float; a block of weights is
unpacked once per 8 activation rows (the register block) and prefetched ahead; other CPUs get the same sums in
plain C. Every row count takes this kernel: dequantizing to bf16 for oneDNN above some row count never won where
it was measured (AVX512-VNNI without AMX; docs/benchmarks.md, issue 46). Rounding the activations to int8 per block (an output error of about 0.5% of its
norm on random data, measured in the tests) is what llama.cpp does for these formats.
"""
from __future__ import annotations

import ctypes
import dataclasses
from dataclasses import dataclass

import torch

from kernels.cpu import _profiled, load
from kernels.cpu.interface import GgmlMulMatA8Args
from kernels.quant_reference import GGML_BLOCK

__all__ = ["GgmlA8Weight", "ggml_a8_applies", "ggml_mul_mat_a8", "pack_q4_1", "pack_q8_0"]

TILE = 16  # output rows a kernel tile computes at once (one per vector lane)
_SLICE = 4  # consecutive k one vpdpbusd lane sums
_DTYPES = {torch.float32: 0, torch.bfloat16: 1}  # the activation dtypes, as the C call's `bf16` flag


@dataclass(frozen=True)
class GgmlA8Weight:
    """`[n, k]` weights q * dw + mw in the kernel's tiles: rows in tiles of 16 (zero rows pad the last), a
    tile's 32-value blocks in order, each block as 8 slices of 4 consecutive k for the 16 rows (`data` uint8:
    8 bits, 512 bytes a block; 4 bits, 256: slice v in the low nibbles, slice v + 4 in the high ones). `dw`,
    `mw`: fp16 `[tiles, k / 32, 16]` (the GGUF's own values); 8 bits: `mw` is None (mw = -128 dw)."""

    data: torch.Tensor
    dw: torch.Tensor
    mw: torch.Tensor | None
    bits: int
    n: int
    k: int
    args: tuple[int, int, int] = dataclasses.field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        # the C call's weight arguments, built once: this runs ~120 times a batch-1 decode step
        mw = self.dw if self.mw is None else self.mw
        object.__setattr__(self, "args", (self.data.data_ptr(), self.dw.data_ptr(), mw.data_ptr()))

    @property
    def nbytes(self) -> int:
        return self.data.nbytes + self.dw.nbytes + (0 if self.mw is None else self.mw.nbytes)


def ggml_a8_applies(device: torch.device, dtype: torch.dtype) -> bool:
    """The kernel serves fp32 or bf16 activations on CPU, when the C library loads."""
    return device.type == "cpu" and dtype in _DTYPES and load() is not None


def _check(q: torch.Tensor, d: torch.Tensor, top: int, name: str) -> tuple[int, int]:
    n, k = q.shape
    if k % GGML_BLOCK or d.shape != (n, k // GGML_BLOCK):
        raise ValueError(f"{name}: q must be [N, K] with K a multiple of {GGML_BLOCK} and d [N, K / {GGML_BLOCK}], "
                         f"got q {tuple(q.shape)} and d {tuple(d.shape)}")
    if d.dtype != torch.float16:
        raise ValueError(f"{name}: the block scales must be fp16 (as the GGUF stores them), got {d.dtype}")
    if q.numel() and (int(q.min()) < 0 or int(q.max()) > top):
        raise ValueError(f"{name}: q must hold integers in 0..{top}, got {int(q.min())}..{int(q.max())}")
    return n, k


def _tiled_rows(t: torch.Tensor) -> torch.Tensor:
    """`[n, ...]` -> `[tiles, 16, ...]`, zero rows padding the last tile."""
    pad = -t.shape[0] % TILE
    t = torch.cat([t, t.new_zeros(pad, *t.shape[1:])]) if pad else t
    return t.reshape(-1, TILE, *t.shape[1:])


def _tiled_scales(d: torch.Tensor) -> torch.Tensor:
    return _tiled_rows(d).transpose(1, 2).contiguous()  # [tiles, blocks, 16]


def pack_q4_1(q: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> GgmlA8Weight:
    """Q4_1 (w = q * d + m, q in 0..15 `[N, K]`, d and m fp16 `[N, K / 32]`) in the kernel's 4-bit tiles."""
    n, k = _check(q, d, 15, "pack_q4_1")
    if m.shape != d.shape or m.dtype != d.dtype:
        raise ValueError(f"pack_q4_1: m must be like d ({d.dtype} {tuple(d.shape)}), got {m.dtype} {tuple(m.shape)}")
    # [tiles, 16 rows, blocks, 2 halves, 4 slices, 4 k]: slice v of a half-block is slice v + 4 * half
    t = _tiled_rows(q.to(torch.uint8)).reshape(-1, TILE, k // GGML_BLOCK, 2, 4, _SLICE)
    nibbles = t[:, :, :, 0] | (t[:, :, :, 1] << 4)  # [tiles, 16, blocks, 4, 4]
    data = nibbles.permute(0, 2, 3, 1, 4).contiguous()  # [tiles, blocks, slices, 16 rows, 4 k]
    return GgmlA8Weight(data.reshape(-1), _tiled_scales(d), _tiled_scales(m), 4, n, k)


def pack_q8_0(q: torch.Tensor, d: torch.Tensor) -> GgmlA8Weight:
    """Q8_0 (w = q * d, q int8 `[N, K]`, d fp16 `[N, K / 32]`) in the kernel's 8-bit tiles, stored as unsigned
    q + 128 with mw = -128 d: the same products, where vpdpbusd wants one unsigned operand."""
    if q.dtype != torch.int8:
        raise ValueError(f"pack_q8_0: q must be int8, got {q.dtype}")
    unsigned = q.to(torch.int16) + 128
    n, k = _check(unsigned, d, 255, "pack_q8_0")
    t = _tiled_rows(unsigned.to(torch.uint8)).reshape(-1, TILE, k // GGML_BLOCK, 8, _SLICE)
    data = t.permute(0, 2, 3, 1, 4).contiguous()  # [tiles, blocks, 8 slices, 16 rows, 4 k]
    return GgmlA8Weight(data.reshape(-1), _tiled_scales(d), None, 8, n, k)


def ggml_mul_mat_a8(x: torch.Tensor, w: GgmlA8Weight, lib: ctypes.CDLL | None = None) -> torch.Tensor:
    """x `[..., k]` (fp32 or bf16 CPU; rows may be strided) -> `[..., n]` in x's dtype. `lib`: the C library
    (default `kernels.cpu.load()`; tests pass a build without AVX512-VNNI). Kept lean: at batch 1 the Python
    around the C call costs as much as the call."""
    lib = lib or load()
    if lib is None or x.dtype not in _DTYPES or not x.is_cpu or x.shape[-1] != w.k:
        raise ValueError(f"ggml_mul_mat_a8: x must be fp32 or bf16 on CPU with {w.k} columns (and the C kernels "
                         f"built), got {x.dtype} {x.device} {tuple(x.shape)}")
    rows = x if x.dim() == 2 else x.reshape(-1, w.k)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    m = rows.shape[0]
    out = torch.empty(m, w.n, dtype=x.dtype)
    if m:
        with _profiled("kernels.cpu.ggml_a8.ggml_mul_mat_a8"):
            args = GgmlMulMatA8Args(out.data_ptr(), rows.data_ptr(), *w.args, m, w.n, w.k,  # out, x, w, dw, mw, m, n,
                                    rows.stride(0), w.bits, _DTYPES[x.dtype])  # k, x_stride, bits, bf16
            status = lib.ggml_mul_mat_a8(ctypes.byref(args))
        if status:  # KERNELS_CPU_NO_MEMORY, its only failure
            raise MemoryError(f"ggml_mul_mat_a8: no memory for {m} quantized activation rows")
    return out if x.dim() == 2 else out.reshape(*x.shape[:-1], w.n)
