"""FP8 (`quantization="fp8"`, vLLM's online `Fp8LinearMethod`): the dense checkpoint's weights quantized at load to
float8_e4m3fn (3 mantissa bits, largest value 448); where the hardware has fp8 arithmetic (CUDA through Triton),
activations quantized dynamically each step too (W8A8):

    y[m, n] = sx[m] * sw[n] * sum_k qx[m, k] * qw[n, k]

Weights: `quantization_config={"weight_strategy": "tensor"}` (vLLM's online default) keeps one scale per
checkpoint matrix, amax / 448; "channel" one per output row. A fused q|k|v or gate|up matrix with per-tensor
scales holds one scale per module, which `convert_to_channelwise` (int8.py, vLLM's w8a8_utils) expands to one per
output row, so the epilogue always reads a `[N]` vector. Activations: "activation_strategy" "tensor" (vLLM's
dynamic per-tensor: one amax over the step's rows) or "token" (one per row). `activation_scheme` is "dynamic"
only (vLLM's "static" needs calibrated input scales this kit does not write for weights).

Every product qx * qw of two e4m3 values has at most 8 significant bits, exact in fp32, so the only rounding in
the GEMM is the fp32 accumulation's (about K u of the sum of magnitudes, in any order); the errors are the
roundings to fp8 (relative 2^-4 for normal values, absolute 2^-10 * scale for subnormals) and the fp32 epilogue.
Where the kernel backend is Triton (CUDA) the project's fp8 GEMM (`kernels.fp8_gemm`, kernels/triton/fp8_gemm.py)
computes the sum and applies both scales in its fp32 epilogue.

CPUs have no fp8 arithmetic (`torch._scaled_mm` on CPU converts the weight each call: 224 ms a call on
SmolLM2, issue 46), so on CPU the scheme is weight-only (W8A16, as vLLM's Marlin fallback on GPUs without fp8):
the activation strategy does not apply, x stays in the model's dtype and `kernels.cpu.fp8_gemm` widens the fp8
weight inside the product. bf16 models on CPUs with AVX512-BF16 (`packed_gemm_native`) repack the weight once at
load (`fp8_pack`: the same bytes in blocks of 32 rows x pairs of k, still one byte a weight, the row-major copy
freed) and every call runs `fp8_w8a16_packed_gemm`: e4m3 decoded exactly to bf16 and multiplied on vdpbf16ps, at
every batch (issue 46: faster than the bf16 weight's oneDNN GEMM from 1 to 64 rows on SmolLM2's shapes). Elsewhere
(fp32 models, other CPUs): up to `FP8_KERNEL_MAX_ROWS` rows the fp32 C kernel (one byte a weight read), above them
the weight dequantized to x's dtype (q * scale rounded once: 2^-9 relative in bf16) and x's own GEMM (oneDNN).
Without the C kernels, CPU runs the dequantized weight through `F.linear`. `use_kernel=False` keeps the W8A8
reference path (both sides dequantized to fp32, `F.linear`: what tests compare the Triton GEMM with). The CUDA
branch is not yet run on a GPU here (CPU tests run the Triton kernel under the interpreter). The LM head stays
dense.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import kernels
from engine_core.models.quantization.base import LinearMethodBase, add_bias_residual, triton_kernels_apply
from engine_core.models.quantization.int8 import convert_to_channelwise
from kernels.cpu.fp8_gemm import (fp8_dequantize, fp8_pack, fp8_unpack, fp8_w8a16_applies, fp8_w8a16_gemm,
                                  fp8_w8a16_packed_gemm)
from kernels.cpu.packed_gemm import packed_gemm_native

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448: where quantization saturates
MIN_FP8_CAPABILITY = (8, 9)  # fp8 tensor cores: Ada (8.9) and Hopper (9.0) onwards
# rows up to which the W8A16 C kernel beat dequantize-then-oneDNN on SmolLM2's shapes (benchmarks/cpu_gemm_rows.py;
# above, the fp32 FMAs of the kernel lose to the bf16 GEMM's dot products)
FP8_KERNEL_MAX_ROWS = 8


def _cuda_capability(device: torch.device) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device)


def check_fp8_supported(device: torch.device) -> None:
    """Refuse `quantization="fp8"` on a device without fp8 GEMMs (before any weight is read)."""
    if device.type == "cpu":
        return  # weight-only: the fp8 weight widened in the product (kernels.cpu.fp8_gemm, or dequantized)
    if device.type == "cuda":
        cap = _cuda_capability(device)
        if tuple(cap) >= MIN_FP8_CAPABILITY:
            return
        raise ValueError(f"quantization='fp8' needs fp8 tensor cores (CUDA compute capability >= 8.9: Ada, Hopper), "
                         f"got {device} with capability {cap[0]}.{cap[1]}; use quantization='int8' or 'rtn' there")
    raise ValueError(f"quantization='fp8' runs on cpu or cuda (compute capability >= 8.9), got device {device}")


def scale_of(amax: torch.Tensor) -> torch.Tensor:
    """amax / 448 in fp32; an all-zero tensor or row gets scale 1 (any scale stores zeros exactly)."""
    amax = amax.float()
    return torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))


def to_fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x / scale in fp32, saturated at +-448 (never NaN), rounded to nearest even e4m3."""
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def quantize_weight_fp8(w: torch.Tensor, logical_widths: list[int], strategy: str
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """w `[N, K]` (the modules of `logical_widths` stacked along N) -> (fp8 `[N, K]`, fp32 scale `[N]`):
    per "channel", or per "tensor" of each module, expanded to its rows."""
    if sum(logical_widths) != w.shape[0]:
        raise ValueError(f"logical_widths {logical_widths} must sum to the weight's {w.shape[0]} rows")
    if strategy == "channel":
        scale = scale_of(w.abs().amax(dim=1))
    elif strategy == "tensor":
        per_module = torch.stack([scale_of(part.abs().amax()) for part in w.split(logical_widths)])
        scale = convert_to_channelwise(per_module, logical_widths)
    else:
        raise ValueError(f"quantization_config['weight_strategy'] must be 'tensor' or 'channel', got {strategy!r}")
    return to_fp8(w, scale[:, None]), scale


def quantize_activation_fp8(x: torch.Tensor, strategy: str) -> tuple[torch.Tensor, torch.Tensor]:
    """x `[rows, K]` -> (fp8 `[rows, K]`, fp32 scale `[rows, 1]` per "token", or `[1, 1]` per "tensor")."""
    if strategy == "token":
        scale = scale_of(x.abs().amax(dim=1, keepdim=True))
    else:
        scale = scale_of(x.abs().amax()).reshape(1, 1) if x.numel() else torch.ones(1, 1, device=x.device)
    return to_fp8(x, scale), scale


def scaled_mm_applies(m: int, k: int, n: int, device: torch.device) -> bool:
    """Whether `torch._scaled_mm` takes these shapes: CUDA (fp8 tensor cores) with K and N multiples of 16. Never
    on CPU: there it widens the weight every call (three orders of magnitude slower than fp32, issue 46)."""
    return m > 0 and device.type == "cuda" and k % 16 == 0 and n % 16 == 0


_ONE: dict[torch.device, torch.Tensor] = {}


def _one(device: torch.device) -> torch.Tensor:
    if device not in _ONE:
        _ONE[device] = torch.ones((), dtype=torch.float32, device=device)
    return _ONE[device]


def fp8_mm(qx: torch.Tensor, qw: torch.Tensor) -> torch.Tensor:
    """fp8 `[M, K]` @ fp8 `[N, K]`.T -> the fp32 sum `[M, N]` (the kernel contract: unit scales)."""
    (m, k), n = qx.shape, qw.shape[0]
    if scaled_mm_applies(m, k, n, qx.device):
        one = _one(qx.device)
        return torch._scaled_mm(qx, qw.t(), scale_a=one, scale_b=one, out_dtype=torch.float32)
    return fp8_mm_reference(qx, qw)


def fp8_mm_reference(qx: torch.Tensor, qw: torch.Tensor) -> torch.Tensor:
    """The same sum through fp32: both sides dequantized (fp8 -> fp32 is exact), then `F.linear`."""
    return F.linear(qx.float(), qw.float())


class Fp8LinearMethod(LinearMethodBase):
    """The layer holds `weight_fp8` (float8_e4m3fn `[N, K]`, or `fp8_pack`'s 3-D layout of it for the bf16 path on
    AVX512-BF16) and `weight_scale` (fp32 `[N]`); the dense weight is freed. `logical_widths`: the rows of each
    fused module (q|k|v, gate|up; one entry otherwise); `use_kernel=False` keeps the reference path (tests compare
    the two)."""

    def __init__(self, logical_widths: list[int] | None, weight_strategy: str = "tensor",
                 activation_strategy: str = "tensor", use_kernel: bool = True) -> None:
        self.logical_widths, self.use_kernel = logical_widths, use_kernel
        self.weight_strategy, self.activation_strategy = weight_strategy, activation_strategy

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        w = layer.weight.detach()
        check_fp8_supported(w.device)
        q, scale = quantize_weight_fp8(w, self.logical_widths or [w.shape[0]], self.weight_strategy)
        del layer.weight
        if self.use_kernel and w.dtype == torch.bfloat16 and w.is_cpu and packed_gemm_native():
            q = fp8_pack(q)  # the row-major codes freed: one copy, one byte a weight
        layer.register_buffer("weight_fp8", q)
        layer.register_buffer("weight_scale", scale)

    def apply(self, layer: nn.Module, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        if self.use_kernel and rows.is_cpu and not triton_kernels_apply(rows.device):
            res = None if residual is None else residual.reshape(-1, layer.output_size)
            return self._apply_weight_only(layer, rows, res).reshape(*x.shape[:-1], layer.output_size)
        qx, sx = quantize_activation_fp8(rows, self.activation_strategy)
        qw = self._row_major(layer)
        if self.use_kernel and triton_kernels_apply(rows.device):  # the scales in the kernel's epilogue
            y = kernels.fp8_gemm(qx, sx, qw, layer.weight_scale, x.dtype, backend="triton")
        else:
            acc = fp8_mm(qx, qw) if self.use_kernel else fp8_mm_reference(qx, qw)
            y = (acc * sx * layer.weight_scale).to(x.dtype)
        y = y.reshape(*x.shape[:-1], layer.output_size)
        return add_bias_residual(y, layer.bias, residual)

    @staticmethod
    def _row_major(layer: nn.Module) -> torch.Tensor:
        """The fp8 codes `[N, K]` (unpacked into a new tensor when the layer holds the packed layout)."""
        q = layer.weight_fp8
        return fp8_unpack(q, layer.output_size, layer.input_size) if q.dim() == 3 else q

    @classmethod
    def _apply_weight_only(cls, layer: nn.Module, rows: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
        """W8A16 on CPU: the packed bf16 kernel where the weight is packed, else the C kernel up to
        FP8_KERNEL_MAX_ROWS rows and the weight dequantized to x's dtype above."""
        bias = layer.bias
        fits = rows.is_cpu and rows.stride(-1) == 1 and (bias is None or bias.dtype == rows.dtype) and (
            residual is None or (residual.dtype == rows.dtype and residual.stride(-1) == 1))
        if layer.weight_fp8.dim() == 3 and fits and rows.dtype == torch.bfloat16:
            return fp8_w8a16_packed_gemm(rows, layer.weight_fp8, layer.weight_scale, bias, residual, check=False)
        q = cls._row_major(layer)
        if fits and fp8_w8a16_applies(rows, q):
            if rows.shape[0] <= FP8_KERNEL_MAX_ROWS:
                return fp8_w8a16_gemm(rows, q, layer.weight_scale, bias, residual, check=False)
            w = fp8_dequantize(q, layer.weight_scale, rows.dtype)
        else:
            w = (q.float() * layer.weight_scale[:, None]).to(rows.dtype)
        return add_bias_residual(F.linear(rows, w), bias, residual)

    def dequantized_weight(self, layer: nn.Module) -> torch.Tensor:
        """q * scale `[N, K]` in fp32: the weight the scheme computes with."""
        return self._row_major(layer).float() * layer.weight_scale[:, None]

    def weight_bytes(self, layer: nn.Module) -> int:
        return layer.weight_fp8.nbytes + layer.weight_scale.nbytes
