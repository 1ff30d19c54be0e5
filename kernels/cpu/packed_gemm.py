"""bf16 x @ w.T (+ bias) (+ residual) against a bf16 weight packed once in 32-row blocks (csrc/packed_gemm.c).

The fp8 packed GEMM's microkernel (8 rows of x x 32 outputs in 16 zmm of fp32 sums, vdpbf16ps on a broadcast pair
of x) with the weight's bf16 pairs loaded as they are. On a Zen 4 core (AVX512-BF16, no AMX) it beat oneDNN's
packed bf16 inner product by 1.0-1.9x at 8-64 rows, ran level at 256 and 3-5% behind at 2048 (docs/benchmarks.md):
`UnquantizedLinearMethod` sends bf16 linears here above `SKINNY_MAX_ROWS` on CPUs without AMX (oneDNN's AMX
tiles are another matter). Contract: `skinny_gemm`'s, `F.linear(x, w, bias)` rounded once to bf16, then
`residual + y` rounded again; the products are exact in fp32 and each lane sums its k products in order.
"""
from __future__ import annotations

import ctypes

import torch

from kernels.cpu import _profiled, load, load_error
from kernels.cpu.interface import SkinnyGemmArgs
from kernels.cpu.skinny_gemm import _problem

__all__ = ["PACK_BLOCK", "bf16_pack", "bf16_packed_gemm", "packed_gemm_native"]

PACK_BLOCK = 32  # output rows of a packed block, bf16 or fp8 (csrc/packed_gemm.c's BLOCK)


def packed_gemm_native(lib: ctypes.CDLL | None = None) -> bool:
    """Whether the library computes the packed GEMMs (bf16 here, fp8's `fp8_w8a16_packed_gemm`) for bf16 x on
    AVX512-BF16 dot products; elsewhere they are a slow reference in C, and the engine keeps oneDNN for bf16 weights
    and the row-major fp8 weight with `fp8_w8a16_gemm`."""
    lib = lib or load()
    return lib is not None and bool(lib.packed_gemm_native(1))


def bf16_pack(w: torch.Tensor) -> torch.Tensor:
    """bf16 `[n, k]` -> `[ceil(n / 32), ceil(k / 2), 32, 2]` (zeros padding n and k): for each block of 32 output
    rows and each pair of k, the rows' two weights in row order, the two zmm vdpbf16ps multiplies with a pair of
    x. A copy: the caller keeps `w` for the other paths."""
    if w.dtype != torch.bfloat16 or w.dim() != 2:
        raise ValueError(f"bf16_pack: w must be bf16 [n, k], got {w.dtype} {tuple(w.shape)}")
    n, k = w.shape
    nb, pairs = -(-n // PACK_BLOCK), -(-k // 2)
    padded = torch.zeros(nb * PACK_BLOCK, pairs * 2, dtype=torch.bfloat16, device=w.device)
    padded[:n, :k] = w
    return padded.view(nb, PACK_BLOCK, pairs, 2).permute(0, 2, 1, 3).contiguous()


def bf16_packed_gemm(x: torch.Tensor, packed: torch.Tensor, n: int, bias: torch.Tensor | None = None,
                     residual: torch.Tensor | None = None, lib: ctypes.CDLL | None = None,
                     check: bool = True) -> torch.Tensor:
    """x `[m, k]` bf16 (rows may be strided) against `bf16_pack(w)` of a `[n, k]` w, bias `[n]`, residual `[m, n]`
    -> `[m, n]` bf16. `lib`: the C library (default `kernels.cpu.load()`). `check=False` only with operands the
    caller built (the engine's layers)."""
    lib = lib or load()
    if check:
        problem = _packed_problem(x, packed, n, bias, residual) or (
            None if lib is not None else f"the C kernels: {load_error()}")
        if problem:
            raise ValueError(f"bf16_packed_gemm: {problem}")
    m, k = x.shape
    out = torch.empty(m, n, dtype=x.dtype)
    if m and n:
        with _profiled("kernels.cpu.bf16_packed_gemm"):
            args = SkinnyGemmArgs(out.data_ptr(), x.data_ptr(), packed.data_ptr(),
                                  None if bias is None else bias.data_ptr(),
                                  None if residual is None else residual.data_ptr(), m, n, k, x.stride(0),
                                  0 if residual is None else residual.stride(0))
            lib.bf16_gemm_packed(ctypes.byref(args))
    return out


def _packed_problem(x: torch.Tensor, packed: torch.Tensor, n: int, bias: torch.Tensor | None,
                    residual: torch.Tensor | None) -> str | None:
    """What is wrong with the operands, naming the first parameter at fault; None if nothing."""
    if x.dtype != torch.bfloat16 or x.dim() != 2:
        return f"x must be bf16 [m, k], got {x.dtype} {tuple(x.shape)}"
    k = x.shape[1]
    want = (-(-n // PACK_BLOCK), -(-k // 2), PACK_BLOCK, 2)
    if packed.dtype != torch.bfloat16 or tuple(packed.shape) != want or not packed.is_contiguous() \
            or not packed.is_cpu:
        return (f"packed must be bf16_pack's bf16 {list(want)} (n = {n}, k = {k}), contiguous on CPU, got "
                f"{packed.dtype} {tuple(packed.shape)} on {packed.device}")
    return _problem(x, torch.empty(n, k, dtype=torch.bfloat16), bias, residual)  # x's strides, bias, residual
