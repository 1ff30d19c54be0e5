"""x @ w.T (+ bias) (+ residual) for the few rows of a small-batch decode step, w unpacked (csrc/skinny_gemm.c).

At one to a few rows a linear is a read of its weight, and the kernel streams it: each thread one contiguous
run of w's rows, read in order, all of x's rows against each weight row at once. It read SmolLM2's weights
faster than oneDNN's inner product on a packed weight at 1-2 rows: 1.45-1.9x on a 2-vCPU AMD EPYC Zen 4,
1.1-1.17x on an Intel Xeon with AMX (docs/benchmarks.md), so `UnquantizedLinearMethod` sends up to
`SKINNY_MAX_ROWS` rows here. fp32 accumulation; bf16 products on AVX512-BF16 where the CPU has it, 8-float
vectors otherwise. Contract: `F.linear(x, w, bias)`, then `residual + y` in x's dtype (fp32: added before
the one rounding, as oneDNN's fused add; bf16: rounded, added, rounded again, as PyTorch's two ops).
"""
from __future__ import annotations

import ctypes

import torch

from kernels.cpu import _profiled, load, load_error
from kernels.cpu.interface import SkinnyGemmArgs

__all__ = ["SKINNY_MAX_ROWS", "cpu_has_amx", "skinny_gemm", "skinny_gemm_applies"]


def cpu_has_amx() -> bool:
    """oneDNN can run bf16 on AMX tiles here (the bf16 paths' crossovers differ: docs/benchmarks.md)."""
    is_amx = getattr(torch.cpu, "_is_amx_tile_supported", None)
    return bool(is_amx and is_amx())


# rows up to which the kernel beat oneDNN on SmolLM2's linears and LM head (make bench-skinny-gemm, quiet, 2 threads):
# AMD Zen 4 (AVX512-BF16): fp32 1.45x, 1.72x, 1.13x at 1-3 rows, 0.97x at 4; bf16 1.70x, 1.92x, 1.23x, 1.06x at 1-4,
# 0.82x at 8. Intel Xeon with AMX, where oneDNN's bf16 runs on the tiles: fp32 1.14x, 1.15x, 1.09x at 1-3, 1.02x at
# 4; bf16 1.17x, 1.09x at 1-2, 0.95x at 3, 0.88x at 4.
SKINNY_MAX_ROWS = {torch.float32: 3, torch.bfloat16: 2 if cpu_has_amx() else 4}


def skinny_gemm_applies(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                        residual: torch.Tensor | None = None) -> bool:
    """The step's rows are few enough (1 to SKINNY_MAX_ROWS) and the operands are what the kernel reads: then
    `skinny_gemm(..., check=False)` is safe. Lean: it runs ~120 times a batch-1 decode step."""
    dtype = x.dtype
    return (0 < x.shape[0] <= SKINNY_MAX_ROWS.get(dtype, 0) and x.dim() == 2 and x.stride(-1) == 1 and x.is_cpu
            and weight.dtype == dtype and weight.is_cpu and weight.is_contiguous() and weight.shape[1] == x.shape[1]
            and (bias is None or (bias.dtype == dtype and bias.is_cpu and bias.is_contiguous()
                                  and bias.shape[0] == weight.shape[0] and bias.dim() == 1))
            and (residual is None or (residual.dtype == dtype and residual.is_cpu and residual.stride(-1) == 1
                                      and residual.shape == (x.shape[0], weight.shape[0])))
            and load() is not None)


def skinny_gemm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                residual: torch.Tensor | None = None, lib: ctypes.CDLL | None = None,
                check: bool = True) -> torch.Tensor:
    """x `[m, k]` (rows may be strided), weight `[n, k]` contiguous, bias `[n]`, residual `[m, n]` (rows may be
    strided), all fp32 or all bf16 on CPU -> `[m, n]`. `lib`: the C library (default `kernels.cpu.load()`; tests
    pass one built without AVX-512). `check=False` skips the checks: only after `skinny_gemm_applies`."""
    lib = lib or load()
    if check:
        problem = _problem(x, weight, bias, residual) or (None if lib is not None else f"the C kernels: {load_error()}")
        if problem:
            raise ValueError(f"skinny_gemm: {problem}")
    m, k = x.shape
    n = weight.shape[0]
    out = torch.empty(m, n, dtype=x.dtype)
    if m and n:
        with _profiled("kernels.cpu.skinny_gemm"):
            args = SkinnyGemmArgs(out.data_ptr(), x.data_ptr(), weight.data_ptr(),  # y, x, w, bias, residual, m, n, k,
                                  None if bias is None else bias.data_ptr(),  # x_stride, residual_stride
                                  None if residual is None else residual.data_ptr(), m, n, k, x.stride(0),
                                  0 if residual is None else residual.stride(0))
            (lib.skinny_gemm_bf16 if x.dtype == torch.bfloat16 else lib.skinny_gemm_f32)(ctypes.byref(args))
    return out


def _problem(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
             residual: torch.Tensor | None) -> str | None:
    """What is wrong with the operands, naming the first parameter at fault; None if nothing."""
    if x.dim() != 2 or x.stride(-1) != 1:
        return f"x must be [m, k] with its last dimension contiguous, got {tuple(x.shape)} strides {x.stride()}"
    if x.dtype not in SKINNY_MAX_ROWS or not x.is_cpu:
        return f"x must be fp32 or bf16 on CPU, got {x.dtype} on {x.device}"
    m, k = x.shape
    if weight.dim() != 2 or weight.shape[1] != k or not weight.is_contiguous():
        return f"weight must be [n, {k}] and contiguous, got {tuple(weight.shape)} strides {weight.stride()}"
    n = weight.shape[0]
    if bias is not None and (bias.shape != (n,) or not bias.is_contiguous()):
        return f"bias must be [{n}] and contiguous, got {tuple(bias.shape)}"
    if residual is not None and (residual.shape != (m, n) or residual.stride(-1) != 1):
        return f"residual must be [{m}, {n}] with its last dimension contiguous, got {tuple(residual.shape)}"
    for name, t in (("weight", weight), ("bias", bias), ("residual", residual)):
        if t is not None and (t.dtype != x.dtype or not t.is_cpu):
            return f"{name} must be x's dtype ({x.dtype}) on CPU, got {t.dtype} on {t.device}"
    return None
