"""Linear layers: `F.linear`, or oneDNN with a prepacked weight for fp32 on CPU.

For the small row counts of decode steps (8 to 128 rows), MKL's sgemm behind `F.linear` reaches
a fraction of the machine's fp32 rate; oneDNN's inner product on a weight reordered once into its
blocked layout (what IPEX and vLLM's CPU backend do) was 1.5-2.4x faster at those sizes on the
benchmark machine and as fast at 2048 rows (docs/benchmarks.md). The packed copy is made on first
use and again whenever the weight changes in place (`Tensor._version`), so it is never stale.
It costs one more copy of the weights in memory. The residual add can ride on the same call
(oneDNN's binary post-op: one pass over the output instead of two).

With multi-LoRA serving a Linear also holds its adapter slots (`lora`, set by
`models.lora.attach_lora_stacks`); a step whose rows use adapters adds each row's delta
(`models.lora.add_lora`) after the GEMM.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine_core.models.lora import LoRAMapping, LoRAStack, add_lora

PACK_BATCH_HINT = 64  # the row count oneDNN picks its weight layout for: a full decode step


def onednn_available() -> bool:
    return torch.backends.mkldnn.enabled and torch.backends.mkldnn.is_available()


class Linear(nn.Module):
    """y = x @ weight.T + bias (+ each row's LoRA delta) (+ residual). Parameters keep their dense layout."""

    def __init__(self, weight: nn.Parameter, bias: nn.Parameter | None = None) -> None:
        super().__init__()
        self.weight = weight
        self.bias = bias
        self._packed: torch.Tensor | None = None
        self._packed_version = -1
        self.lora: LoRAStack | None = None  # adapter slots, when the engine serves LoRA

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None,
                lora: LoRAMapping | None = None) -> torch.Tensor:
        if lora is not None and self.lora is not None:
            y = self._gemm(x, None)
            add_lora(y, x, self.lora, lora)
            return y if residual is None else residual + y
        return self._gemm(x, residual)

    def _gemm(self, x: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
        packed = self._packed_weight(x)
        if packed is None:
            y = F.linear(x, self.weight, self.bias)
            return y if residual is None else residual + y
        if residual is None:
            return torch.ops.mkldnn._linear_pointwise(x, packed, self.bias, "none", [], "")
        return torch.ops.mkldnn._linear_pointwise.binary(x, residual, packed, self.bias, "add")

    def _packed_weight(self, x: torch.Tensor) -> torch.Tensor | None:
        w = self.weight
        if not (x.dtype == w.dtype == torch.float32 and x.device.type == w.device.type == "cpu" and x.dim() == 2
                and x.shape[0] > 0 and onednn_available()):
            return None
        if self._packed is None or self._packed_version != w._version:
            self._packed = torch.ops.mkldnn._reorder_linear_weight(w.detach(), PACK_BATCH_HINT)
            self._packed_version = w._version
        return self._packed
