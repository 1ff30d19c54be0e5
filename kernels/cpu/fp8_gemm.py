"""Weight-only fp8 (W8A16) on CPU (csrc/fp8_gemm.c): x @ (q * scale).T (+ bias) (+ residual) with q float8_e4m3fn.

No x86 CPU here has fp8 arithmetic, and `torch._scaled_mm` on CPU converts the whole weight each call (224 ms a
call on SmolLM2, issue 46). This kernel keeps the weight at one byte a value (half of bf16's traffic) and widens
16 codes at a time to fp32 inside the product (exact: e4m3 has 3 mantissa bits), x in fp32 or bf16 unquantized.
Contract: `F.linear(x.double(), q.double() * scale[:, None], bias)` within fp32 summation (K u of sum |x w|),
the output in x's dtype (bf16: rounded once after the bias), then the residual added as `skinny_gemm` does.

For bf16 x on AVX512-BF16 (`packed_gemm_native`), `fp8_w8a16_packed_gemm` keeps the same contract against the
weight repacked once (`fp8_pack`, csrc/packed_gemm.c): the codes decoded exactly to bf16 in registers and
multiplied on vdpbf16ps, 8 rows x 32 outputs at a time, faster than the bf16 weight's oneDNN GEMM from 1 to 64
rows on SmolLM2's shapes (docs/benchmarks.md); fp32 x keeps `fp8_w8a16_gemm` (no silent rounding to bf16).
"""
from __future__ import annotations

import ctypes
from typing import Callable

import torch

from kernels.cpu import _profiled, load, load_error
from kernels.cpu.interface import Fp8GemmArgs
from kernels.cpu.packed_gemm import PACK_BLOCK

__all__ = ["fp8_dequantize", "fp8_pack", "fp8_unpack", "fp8_w8a16_applies",
           "fp8_w8a16_gemm", "fp8_w8a16_packed_gemm"]

_DTYPES = {torch.float32: 0, torch.bfloat16: 1}  # the activation dtypes, as the C call's `bf16` flag
# where each of a k pair's 64 codes (row r's two at 2r, 2r + 1) is stored: csrc/packed_gemm.c's `slot`, the
# order in which its byte interleave (within 128-bit lanes) yields rows 0-15, then 16-31
_SLOT = torch.tensor([16 * (i // 8) + i % 8 if i < 32 else 16 * ((i - 32) // 8) + 8 + i % 8 for i in range(64)])


def fp8_w8a16_applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """The kernel computes x (fp32 or bf16, CPU, 2-D, last dimension contiguous) against this fp8 weight."""
    return (x.dtype in _DTYPES and x.is_cpu and x.dim() == 2 and x.stride(-1) == 1 and weight.is_cpu
            and weight.dtype == torch.float8_e4m3fn and weight.is_contiguous() and load() is not None)


def fp8_w8a16_gemm(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None,
                   residual: torch.Tensor | None = None, lib: ctypes.CDLL | None = None,
                   check: bool = True) -> torch.Tensor:
    """x `[m, k]` (fp32 or bf16, rows may be strided), weight float8_e4m3fn `[n, k]` contiguous, scale fp32 `[n]`,
    bias `[n]` and residual `[m, n]` in x's dtype -> `[m, n]` in x's dtype. `lib`: the C library (default
    `kernels.cpu.load()`; tests pass a build without AVX-512). `check=False` only after `fp8_w8a16_applies` and
    with operands the caller built (the engine's layers)."""
    lib = lib or load()
    if check:
        problem = _problem(x, weight, scale, bias, residual) or (
            None if lib is not None else f"the C kernels: {load_error()}")
        if problem:
            raise ValueError(f"fp8_w8a16_gemm: {problem}")
    out, status = _call(lib.fp8_gemm_w8a16, "kernels.cpu.fp8_w8a16_gemm", x, weight, weight.shape[0], scale, bias,
                        residual)
    if status:  # KERNELS_CPU_NO_MEMORY, its only failure
        raise MemoryError(f"fp8_w8a16_gemm: no memory for the fp32 copy of x ({x.shape[0]} x {x.shape[1]})")
    return out


def _call(fn: Callable[[object], int], label: str, x: torch.Tensor, weight: torch.Tensor, n: int, scale: torch.Tensor,
          bias: torch.Tensor | None, residual: torch.Tensor | None) -> tuple[torch.Tensor, int]:
    """One C GEMM call on checked operands (`weight` row-major or packed: the kernel knows which): the output
    `[m, n]` in x's dtype and the kernel's status (0 when there was nothing to compute)."""
    m, k = x.shape
    out = torch.empty(m, n, dtype=x.dtype)
    if not (m and n):
        return out, 0
    with _profiled(label):
        args = Fp8GemmArgs(out.data_ptr(), x.data_ptr(), None if bias is None else bias.data_ptr(),
                           None if residual is None else residual.data_ptr(), weight.data_ptr(), scale.data_ptr(),
                           m, n, k, x.stride(0), 0 if residual is None else residual.stride(0), _DTYPES[x.dtype])
        return out, fn(ctypes.byref(args))


def fp8_pack(q: torch.Tensor) -> torch.Tensor:
    """float8_e4m3fn `[n, k]` -> the same codes as `[ceil(n / 32), ceil(k / 2), 64]` (zero codes padding n and k):
    for each block of 32 output rows and each pair of k, the 32 rows' two codes side by side (in `_SLOT`'s order),
    the layout vdpbf16ps multiplies with a pair of x (csrc/packed_gemm.c). One byte a weight, as before."""
    if q.dtype != torch.float8_e4m3fn or q.dim() != 2:
        raise ValueError(f"fp8_pack: q must be float8_e4m3fn [n, k], got {q.dtype} {tuple(q.shape)}")
    n, k = q.shape
    nb, pairs = -(-n // PACK_BLOCK), -(-k // 2)
    padded = torch.zeros(nb * PACK_BLOCK, pairs * 2, dtype=torch.uint8, device=q.device)
    padded[:n, :k] = q.view(torch.uint8)
    logical = padded.reshape(nb, PACK_BLOCK, pairs, 2).permute(0, 2, 1, 3).reshape(nb, pairs, 2 * PACK_BLOCK)
    packed = torch.empty_like(logical)
    packed[..., _SLOT] = logical
    return packed.view(torch.float8_e4m3fn)


def fp8_unpack(packed: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """`fp8_pack`'s inverse: the `[n, k]` codes (a new tensor)."""
    nb, pairs = packed.shape[:2]
    logical = packed.view(torch.uint8)[..., _SLOT].reshape(nb, pairs, PACK_BLOCK, 2)
    rows = logical.permute(0, 2, 1, 3).reshape(nb * PACK_BLOCK, pairs * 2)
    return rows[:n, :k].contiguous().view(torch.float8_e4m3fn)


def fp8_w8a16_packed_gemm(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None,
                          residual: torch.Tensor | None = None, lib: ctypes.CDLL | None = None,
                          check: bool = True) -> torch.Tensor:
    """`fp8_w8a16_gemm` for bf16 x against `fp8_pack(weight)` (n from scale's length): the products on AVX512-BF16
    dot products, exact (e4m3 values are bf16 values), summed in fp32. Same contract, same output dtype (bf16)."""
    lib = lib or load()
    n = scale.shape[0] if scale.dim() == 1 else -1
    if check:
        problem = _packed_problem(x, packed, n) or _problem(x, _shape_only(packed, n, x), scale, bias, residual) or (
            None if lib is not None else f"the C kernels: {load_error()}")
        if problem:
            raise ValueError(f"fp8_w8a16_packed_gemm: {problem}")
    return _call(lib.fp8_gemm_w8a16_packed, "kernels.cpu.fp8_w8a16_packed_gemm", x, packed, n, scale, bias,
                 residual)[0]  # its status is always KERNELS_CPU_OK: it allocates nothing


def fp8_dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype,
                   lib: ctypes.CDLL | None = None) -> torch.Tensor:
    """float8_e4m3fn `[n, k]` (or its uint8 bits) times fp32 scale `[n]` -> `[n, k]` in `dtype` (fp32 or bf16),
    each product rounded once (scale 1: the codes' exact values; NaN codes: NaN). The large-batch path's weight."""
    lib = lib or load()
    if (lib is None or q.dtype not in (torch.float8_e4m3fn, torch.uint8) or not q.is_cpu or q.dim() != 2
            or dtype not in _DTYPES or scale.dtype != torch.float32 or scale.shape != (q.shape[0],)):
        raise ValueError(f"fp8_dequantize: q must be float8_e4m3fn (or uint8) [n, k] on CPU, scale fp32 [n], dtype "
                         f"fp32 or bf16 (and the C kernels built), got q {q.dtype} {tuple(q.shape)} on {q.device}, "
                         f"scale {scale.dtype} {tuple(scale.shape)}, dtype {dtype}")
    q, scale = q.contiguous(), scale.contiguous()
    out = torch.empty(q.shape, dtype=dtype)
    if q.numel():
        lib.fp8_dequantize(out.data_ptr(), q.data_ptr(), scale.data_ptr(), q.shape[0], q.shape[1], _DTYPES[dtype])
    return out


def _packed_problem(x: torch.Tensor, packed: torch.Tensor, n: int) -> str | None:
    if x.dtype != torch.bfloat16:
        return f"x must be bf16 (fp32 x runs fp8_w8a16_gemm: no silent rounding to bf16), got {x.dtype}"
    k = x.shape[-1]
    want = (-(-n // PACK_BLOCK), -(-k // 2), 2 * PACK_BLOCK)
    if packed.dtype != torch.float8_e4m3fn or tuple(packed.shape) != want or not packed.is_contiguous():
        return (f"packed must be fp8_pack's float8_e4m3fn {list(want)} (n = len(scale) = {n}, k = {k}), contiguous, "
                f"got {packed.dtype} {tuple(packed.shape)}")
    return None


def _shape_only(packed: torch.Tensor, n: int, x: torch.Tensor) -> torch.Tensor:
    """An fp8 `[n, k]` stand-in (no data) for `_problem`'s checks of scale, bias and residual."""
    return torch.empty(n, x.shape[-1], dtype=torch.float8_e4m3fn, device=packed.device)


def _problem(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
             residual: torch.Tensor | None) -> str | None:
    """What is wrong with the operands, naming the first parameter at fault; None if nothing."""
    if x.dim() != 2 or x.stride(-1) != 1:
        return f"x must be [m, k] with its last dimension contiguous, got {tuple(x.shape)} strides {x.stride()}"
    if x.dtype not in _DTYPES or not x.is_cpu:
        return f"x must be fp32 or bf16 on CPU, got {x.dtype} on {x.device}"
    m, k = x.shape
    if weight.dtype != torch.float8_e4m3fn or not weight.is_cpu:
        return f"weight must be float8_e4m3fn on CPU, got {weight.dtype} on {weight.device}"
    if weight.dim() != 2 or weight.shape[1] != k or not weight.is_contiguous():
        return f"weight must be [n, {k}] and contiguous, got {tuple(weight.shape)} strides {weight.stride()}"
    n = weight.shape[0]
    if scale.dtype != torch.float32 or scale.shape != (n,) or not scale.is_contiguous() or not scale.is_cpu:
        return f"scale must be fp32 [{n}] contiguous on CPU, got {scale.dtype} {tuple(scale.shape)}"
    if bias is not None and (bias.shape != (n,) or not bias.is_contiguous()):
        return f"bias must be [{n}] and contiguous, got {tuple(bias.shape)}"
    if residual is not None and (residual.shape != (m, n) or residual.stride(-1) != 1):
        return f"residual must be [{m}, {n}] with its last dimension contiguous, got {tuple(residual.shape)}"
    for name, t in (("bias", bias), ("residual", residual)):
        if t is not None and (t.dtype != x.dtype or not t.is_cpu):
            return f"{name} must be x's dtype ({x.dtype}) on CPU, got {t.dtype} on {t.device}"
    return None
