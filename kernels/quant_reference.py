"""The semantics of the weight-quantized GEMMs in plain PyTorch (the reference every backend is tested against).

- W4A16 (GPTQ's layout, what `engine_core.models.quantization.rtn` holds): `qweight` int32 `[K / 8, N]` packs
  8 consecutive K values per word (value i at bits [4i, 4i + 4)), `scales` `[G, N]` and integer `zeros`
  `[G, N]` (unpacked) per group of `group_size` consecutive K; w[n, k] = (q[n, k] - z[g, n]) * s[g, n] with
  g = k // group_size. Floating-point `zeros` are an additive offset instead (GGUF Q4_1's block minimum m:
  w = q * d + m), w[n, k] = q[n, k] * s[g, n] + zeros[g, n]. `perm` (act-order, after `act_order_permutation`) is the K order the packed weight
  is stored in: stored column j is the checkpoint's column perm[j], so y = x[:, perm] @ W_stored.T.
- FP8 (vLLM's scheme): `a` `[M, K]` and `w` `[N, K]` float8_e4m3fn, `a_scale` `[1]` (per tensor) or
  `[M, 1]` (per token), `w_scale` `[1]` or `[N, 1]` (per channel), fp32 (0-dim, `[M]` and `[N]` accepted too); y[m, n] = (a @ w.T)[m, n] *
  a_scale[m] * w_scale[n].
Both accumulate in fp32 and round once to the output dtype.
- GGML A8 (llama.cpp's CPU arithmetic for GGUF blocks, `kernels.cpu.ggml_a8`): each 32-value block of an
  activation row is quantized to int8 (Q8_1: dx = max|x| / 127, xq = round(x / dx), sx = dx * sum(xq)), and
  y[t, n] = sum_b dw[n, b] dx[t, b] (q[n, block b] . xq[t, block b]) + mw[n, b] sx[t, b] for weights
  w = q * dw + mw (q unsigned integers, `dw`, `mw` `[N, K / 32]`).
"""
from __future__ import annotations

import torch

PACK = 8  # int4 values per int32 word


def unpack_int4_along_k(qweight: torch.Tensor) -> torch.Tensor:
    """int32 `[K / 8, N]` -> the unsigned values int32 `[N, K]`."""
    shifts = torch.arange(PACK, device=qweight.device, dtype=torch.int32) * 4
    values = (qweight[:, None, :] >> shifts[None, :, None]) & 0xF
    return values.reshape(-1, qweight.shape[1]).t()


def dequantize_w4(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int
                  ) -> torch.Tensor:
    """The stored weight `[N, K]` in fp32."""
    q = unpack_int4_along_k(qweight).float()
    s = scales.float().t().repeat_interleave(group_size, dim=1)
    z = zeros.float().t().repeat_interleave(group_size, dim=1)
    return q * s + z if zeros.is_floating_point() else (q - z) * s


def w4a16_gemm(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
               group_size: int, perm: torch.Tensor | None = None) -> torch.Tensor:
    """x `[M, K]` @ W.T -> `[M, N]` in x's dtype, fp32 inside."""
    rows = x.float() if perm is None else x.float()[:, perm]
    return (rows @ dequantize_w4(qweight, scales, zeros, group_size).t()).to(x.dtype)


def fp8_gemm(a_fp8: torch.Tensor, a_scale: torch.Tensor, w_fp8: torch.Tensor, w_scale: torch.Tensor,
             out_dtype: torch.dtype, bias: torch.Tensor | None = None) -> torch.Tensor:
    """(a @ w.T) * a_scale * w_scale.T (+ bias) `[M, N]` in `out_dtype`, fp32 inside."""
    y = (a_fp8.float() @ w_fp8.float().t()) * a_scale.float().reshape(-1, 1) * w_scale.float().reshape(1, -1)
    if bias is not None:
        y = y + bias.float()
    return y.to(out_dtype)


def act_order_permutation(g_idx: torch.Tensor, group_size: int) -> torch.Tensor | None:
    """The K order that makes act-order groups contiguous (exllama's and Marlin's): `argsort(g_idx)`, stable;
    None where some group does not hold exactly `group_size` columns (no contiguous layout exists)."""
    counts = torch.bincount(g_idx.long(), minlength=g_idx.numel() // group_size)
    if counts.numel() * group_size != g_idx.numel() or bool((counts != group_size).any()):
        return None
    return torch.argsort(g_idx.long(), stable=True)


def check_w4a16(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                group_size: int, perm: torch.Tensor | None) -> None:
    """ValueError naming the argument before any work, for every backend alike."""
    if x.dim() != 2 or not x.is_floating_point():
        raise ValueError(f"x must be 2-D floating point [M, K], got {x.dtype} {tuple(x.shape)}")
    k = x.shape[1]
    if qweight.dtype != torch.int32 or qweight.dim() != 2 or qweight.shape[0] * PACK != k:
        raise ValueError(f"qweight must be int32 [K / 8, N] = [{k // PACK}, N] for x's K = {k}, got "
                         f"{qweight.dtype} {tuple(qweight.shape)}")
    if group_size <= 0 or k % group_size:
        raise ValueError(f"group_size must be a positive divisor of K = {k}, got {group_size}")
    shape = (k // group_size, qweight.shape[1])
    for name, t in (("scales", scales), ("zeros", zeros)):
        if tuple(t.shape) != shape:
            raise ValueError(f"{name} must be [K / group_size, N] = {list(shape)}, got {tuple(t.shape)}")
    if perm is not None and tuple(perm.shape) != (k,):
        raise ValueError(f"perm must be [K] = [{k}], got {tuple(perm.shape)}")


def check_fp8(a_fp8: torch.Tensor, a_scale: torch.Tensor, w_fp8: torch.Tensor, w_scale: torch.Tensor) -> None:
    """ValueError naming the argument before any work: vLLM's shapes only."""
    for name, t in (("a_fp8", a_fp8), ("w_fp8", w_fp8)):
        if t.dtype != torch.float8_e4m3fn or t.dim() != 2:
            raise ValueError(f"{name} must be 2-D float8_e4m3fn, got {t.dtype} {tuple(t.shape)}")
    (m, k), (n, kw) = a_fp8.shape, w_fp8.shape
    if k != kw:
        raise ValueError(f"w_fp8 must be [N, K] with a_fp8's K = {k}, got {tuple(w_fp8.shape)}")
    for name, t, count, per in (("a_scale", a_scale, m, "M"), ("w_scale", w_scale, n, "N")):
        if tuple(t.shape) not in {(), (1,), (1, 1), (count,), (count, 1)}:
            kind = "per token" if name == "a_scale" else "per channel"
            raise ValueError(f"{name} must be [1] (per tensor) or [{per}, 1] = [{count}, 1] ({kind}; [{per}] is "
                             f"read the same), got {tuple(t.shape)}")


GGML_BLOCK = 32  # values per activation / weight block in llama.cpp's formats


def quantize_q8_1(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x `[M, K]` (K a multiple of 32) -> (xq int8 `[M, K]`, dx fp32 `[M, K / 32]`, sx fp32 `[M, K / 32]`), in fp32
    as the C kernel computes them (round half to even)."""
    blocks = x.float().reshape(x.shape[0], -1, GGML_BLOCK)
    d = blocks.abs().amax(-1) / 127.0
    inv = torch.where(d != 0, 1.0 / d, torch.zeros_like(d))
    q = torch.round(blocks * inv[..., None])
    return q.to(torch.int8).reshape(x.shape), d, d * q.sum(-1)


def ggml_a8_gemm(x: torch.Tensor, q: torch.Tensor, dw: torch.Tensor, mw: torch.Tensor) -> torch.Tensor:
    """x `[M, K]` times the weight q * dw + mw (q `[N, K]` unsigned integers, dw / mw `[N, K / 32]`) with x
    quantized by `quantize_q8_1`, summed in float64 -> `[M, N]` float64 (the C kernel's sums in fp32)."""
    xq, dx, sx = quantize_q8_1(x)
    n, k = q.shape
    dots = torch.einsum("mbi,nbi->mnb", xq.double().reshape(-1, k // GGML_BLOCK, GGML_BLOCK),
                        q.double().reshape(n, -1, GGML_BLOCK))
    return (dots * dx.double()[:, None, :] * dw.double()[None]).sum(-1) + sx.double() @ mw.double().t()

