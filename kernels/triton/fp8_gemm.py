"""FP8 GEMM: float8_e4m3fn activations times float8_e4m3fn weights, fp32 accumulation, the scales applied
once to the accumulator (vLLM's `Fp8LinearMethod` shapes; `kernels.quant_reference.fp8_gemm` is the contract).

y[m, n] = sum_k a[m, k] * w[n, k] * a_scale[m or 0] * w_scale[n or 0]: a scale that is per token or per
channel factors out of the sum over k, so the tensor cores multiply the raw fp8 codes (sm_89 / sm_90: twice
bf16's rate, half its bytes) and the epilogue multiplies one row scale and one column scale. The weight is
read as stored, `[N, K]` with K contiguous (the K-major operand the fp8 tensor-core instructions want).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.quant_reference import check_fp8
from kernels.triton._common import INTERPRET, check_device
from kernels.triton._gemm_tiles import gemm_tiles


@triton.jit
def _fp8_gemm_kernel(a_ptr, w_ptr, a_scale_ptr, w_scale_ptr, bias_ptr, out_ptr, M, N, K, tiles_per_split,
                     stride_am, stride_wn, stride_os, stride_om,
                     A_PER_TOKEN: tl.constexpr, W_PER_CHANNEL: tl.constexpr, HAS_BIAS: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, UPCAST: tl.constexpr):
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask, n_mask = rm < M, rn < N
    rk = tl.arange(0, BLOCK_K)
    split = tl.program_id(2)  # split-K: this program's contiguous range of K tiles (_gemm_tiles.py)
    k_begin = split * tiles_per_split * BLOCK_K
    k_end = tl.minimum(K, k_begin + tiles_per_split * BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(k_begin, k_end, BLOCK_K):
        k = k0 + rk
        a = tl.load(a_ptr + rm[:, None].to(tl.int64) * stride_am + k[None, :],
                    mask=m_mask[:, None] & (k < K)[None, :], other=0.0)
        b = tl.load(w_ptr + rn[None, :].to(tl.int64) * stride_wn + k[:, None],
                    mask=(k < K)[:, None] & n_mask[None, :], other=0.0)  # w.T tile [BLOCK_K, BLOCK_N]
        if UPCAST:  # the interpreter multiplies fp8 wrongly: exact fp32 products of the codes instead
            acc += tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
        else:
            acc += tl.dot(a, b, out_dtype=tl.float32)
    if A_PER_TOKEN:
        sa = tl.load(a_scale_ptr + rm, mask=m_mask, other=0.0)
    else:
        sa = tl.load(a_scale_ptr + tl.zeros([BLOCK_M], tl.int32))
    if W_PER_CHANNEL:
        sw = tl.load(w_scale_ptr + rn, mask=n_mask, other=0.0)
    else:
        sw = tl.load(w_scale_ptr + tl.zeros([BLOCK_N], tl.int32))
    y = acc * sa[:, None] * sw[None, :]  # the scales factor out of every partial sum alike
    if HAS_BIAS:
        y += tl.load(bias_ptr + rn, mask=n_mask & (split == 0), other=0.0).to(tl.float32)[None, :]  # added once
    tl.store(out_ptr + split * stride_os + rm[:, None].to(tl.int64) * stride_om + rn[None, :],
             y.to(out_ptr.dtype.element_ty),
             mask=m_mask[:, None] & n_mask[None, :])


def fp8_gemm_refusal(capability: tuple[int, int], name: str = "this GPU") -> str | None:
    """Why a GPU of this compute capability cannot run the fp8 GEMM (None: it can). fp8 tensor-core MMAs exist
    from sm_89 (Ada, Hopper) on: an A100 (sm_80) has none (unlike the fp8 KV cache, which only converts)."""
    if tuple(capability) < (8, 9):
        return (f"the fp8 GEMM needs a GPU of compute capability >= 8.9 (Ada or Hopper) for fp8 tensor cores; "
                f"{name} is {capability[0]}.{capability[1]}: use an fp16/bf16 scheme (or W8A16 / W4A16) there")
    return None


def check_fp8_support(device: torch.device) -> None:
    """Refuses, before any launch, a GPU without fp8 tensor cores (`fp8_gemm_refusal`)."""
    if device.type == "cuda" and (reason := fp8_gemm_refusal(torch.cuda.get_device_capability(device),
                                                              torch.cuda.get_device_name(device))):
        raise RuntimeError(reason)


def fp8_gemm(a_fp8: torch.Tensor, a_scale: torch.Tensor, w_fp8: torch.Tensor, w_scale: torch.Tensor,
             out_dtype: torch.dtype, bias: torch.Tensor | None = None) -> torch.Tensor:
    """(a @ w.T) * a_scale * w_scale (+ bias) `[M, N]` in `out_dtype` (contract: `kernels.quant_reference.fp8_gemm`)."""
    check_fp8(a_fp8, a_scale, w_fp8, w_scale)
    check_device(a_fp8, a_scale, w_fp8, w_scale, *([] if bias is None else [bias]))
    check_fp8_support(a_fp8.device)
    (m, k), n = a_fp8.shape, w_fp8.shape[0]
    if m == 0 or n == 0:
        return torch.empty(m, n, dtype=out_dtype, device=a_fp8.device)
    a_fp8 = a_fp8 if a_fp8.stride(1) == 1 else a_fp8.contiguous()
    w_fp8 = w_fp8 if w_fp8.stride(1) == 1 else w_fp8.contiguous()
    sa, sw = a_scale.float().reshape(-1).contiguous(), w_scale.float().reshape(-1).contiguous()
    sms = torch.cuda.get_device_properties(a_fp8.device).multi_processor_count if a_fp8.is_cuda else 1
    cfg, split, per_split = gemm_tiles(m, n, k, 32 if INTERPRET else 128, sms, INTERPRET)
    out = torch.empty(split, m, n, dtype=torch.float32 if split > 1 else out_dtype, device=a_fp8.device)
    grid = (triton.cdiv(m, cfg["BLOCK_M"]), triton.cdiv(n, cfg["BLOCK_N"]), split)
    _fp8_gemm_kernel[grid](a_fp8, w_fp8, sa, sw, sw if bias is None else bias.contiguous(), out, m, n, k, per_split,
                           a_fp8.stride(0), w_fp8.stride(0), out.stride(0), out.stride(1),
                           A_PER_TOKEN=sa.numel() > 1, W_PER_CHANNEL=sw.numel() > 1,
                           HAS_BIAS=bias is not None, UPCAST=INTERPRET, **cfg)
    return out[0] if split == 1 else out.sum(dim=0).to(out_dtype)
