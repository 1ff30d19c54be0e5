"""`UnquantizedLinearMethod`: the dense GEMM, `F.linear`, or oneDNN with a prepacked weight for fp32 and bf16 on CPU.

For the small row counts of decode steps (8 to 128 rows), MKL's sgemm behind `F.linear` reaches
a fraction of the machine's fp32 rate; oneDNN's inner product on a weight reordered once into its
blocked layout (what IPEX and vLLM's CPU backend do) is faster at those sizes and as fast at 2048 rows
(docs/benchmarks.md, "Tried, did not pay"). The packed copy is made on first
use and again whenever the weight changes in place (`Tensor._version`: a merged LoRA adapter), so it
is never stale. It costs one more copy of the weights in memory. The residual add rides on the same
call (oneDNN's binary post-op: one pass over the output instead of two).

bf16 (where oneDNN has bf16 kernels: AVX512-BF16, AMX) takes the same packed path: bf16 weights and
activations, fp32 accumulation, the output rounded to bf16 once, as `F.linear` does. Its residual is
added after the GEMM in bf16 (two roundings, Hugging Face's order), not fused into it: a fused add
rounds once and would move the engine's bf16 logits off Hugging Face's. At batch-1 decode the packed
bf16 weights read half the bytes of fp32 ones, and oneDNN's bf16 inner product beats `F.linear` in bf16
(docs/benchmarks.md).

At one to a few rows (a small-batch decode step) a linear is a read of its weight, and oneDNN's inner product
streamed it at half the memory's rate, plus a fixed cost per call (docs/benchmarks.md): up to `SKINNY_MAX_ROWS`
rows go to `kernels.cpu.skinny_gemm` on the unpacked weight instead (no packed copy is made for a layer only such
steps use), with the same rounding and residual order as the packed path of the same dtype.

bf16 on a CPU with AVX512-BF16 and no AMX runs the other rows on `kernels.cpu.packed_gemm` instead of oneDNN: the
fp8 packed GEMM's microkernel on the bf16 weight packed once (made on first use, remade when the weight changes,
like oneDNN's copy, which is then never made): 1.0-1.9x oneDNN's bf16 inner product at 8-64 rows, level at 256,
3-5% behind at 2048 (a prefill chunk) on a Zen 4 core; SmolLM2 at batch 8-32 1.13-1.21x. Where the CPU has AMX,
oneDNN's tiles keep the bf16 GEMMs (docs/benchmarks.md).
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from engine_core.models.quantization.base import LinearMethodBase
from kernels.cpu.packed_gemm import bf16_pack, bf16_packed_gemm, packed_gemm_native
from kernels.cpu.skinny_gemm import cpu_has_amx, skinny_gemm, skinny_gemm_applies

PACK_BATCH_HINT = 64  # the row count oneDNN picks its weight layout for: a full decode step


def onednn_available() -> bool:
    return torch.backends.mkldnn.enabled and torch.backends.mkldnn.is_available()


def onednn_bf16_available() -> bool:
    """oneDNN runs bf16 natively here (AVX512-BF16 or AMX), not by emulation."""
    return onednn_available() and _cpu_has_bf16()


@functools.cache
def _cpu_has_bf16() -> bool:
    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


@functools.cache
def bf16_packed_applies() -> bool:
    """bf16 linears past the skinny rows run `bf16_packed_gemm` here: AVX512-BF16 without AMX."""
    return packed_gemm_native() and not cpu_has_amx()


class UnquantizedLinearMethod(LinearMethodBase):
    """The weight as loaded (model dtype); the layer keeps `_packed` / `_packed_version`: oneDNN's copy, or
    `bf16_pack`'s where `bf16_packed_applies`."""

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        layer._packed, layer._packed_version = None, -1

    def apply(self, layer: nn.Module, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        if skinny_gemm_applies(x, layer.weight, layer.bias, residual):  # a few rows: stream the unpacked weight
            return skinny_gemm(x, layer.weight, layer.bias, residual, check=False)
        packed = _packed_weight(layer, x)
        if packed is not None and x.dtype == torch.bfloat16 and bf16_packed_applies():  # bf16_pack's layout
            x = x if x.stride(-1) == 1 else x.contiguous()
            residual = residual if residual is None or residual.stride(-1) == 1 else residual.contiguous()
            return bf16_packed_gemm(x, packed, layer.weight.shape[0], layer.bias, residual, check=False)
        if packed is None:
            y = F.linear(x, layer.weight, layer.bias)
            return y if residual is None else residual + y
        if residual is None or x.dtype != torch.float32:
            y = torch.ops.mkldnn._linear_pointwise(x, packed, layer.bias, "none", [], "")
            return y if residual is None else residual + y
        return torch.ops.mkldnn._linear_pointwise.binary(x, residual, packed, layer.bias, "add")

    def weight_bytes(self, layer: nn.Module) -> int:
        return layer.weight.nbytes


def _packed_weight(layer: nn.Module, x: torch.Tensor) -> torch.Tensor | None:
    w = layer.weight
    if not (x.dtype == w.dtype and x.is_cpu and w.is_cpu and x.dim() == 2 and x.shape[0] > 0):
        return None
    if layer._packed is not None and layer._packed_version == w._version and torch.backends.mkldnn.enabled:
        return layer._packed  # the per-step path (~200 calls a step): nothing more to check
    if not (onednn_available() if x.dtype == torch.float32 else x.dtype == torch.bfloat16 and onednn_bf16_available()):
        return None
    if x.dtype == torch.bfloat16 and bf16_packed_applies():
        layer._packed = bf16_pack(w.detach())
    else:
        layer._packed = torch.ops.mkldnn._reorder_linear_weight(w.detach(), PACK_BATCH_HINT)
    layer._packed_version = w._version
    return layer._packed
