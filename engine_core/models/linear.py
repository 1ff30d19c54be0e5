"""Linear layers: `F.linear`, or oneDNN with a prepacked weight for fp32 on CPU.

For the small row counts of decode steps (8 to 128 rows), MKL's sgemm behind `F.linear` reaches
a fraction of the machine's fp32 rate; oneDNN's inner product on a weight reordered once into its
blocked layout (what IPEX and vLLM's CPU backend do) was 1.5-2.4x faster at those sizes on the
benchmark machine and as fast at 2048 rows (docs/benchmarks.md). The packed copy is made on first
use and again whenever the weight changes in place (`Tensor._version`), so it is never stale.
It costs one more copy of the weights in memory. The residual add can ride on the same call
(oneDNN's binary post-op: one pass over the output instead of two).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

PACK_BATCH_HINT = 64  # the row count oneDNN picks its weight layout for: a full decode step


def onednn_available() -> bool:
    return torch.backends.mkldnn.enabled and torch.backends.mkldnn.is_available()


class Linear(nn.Module):
    """y = x @ weight.T + bias (+ residual). Parameters keep their dense layout for everything else."""

    def __init__(self, weight: nn.Parameter, bias: nn.Parameter | None = None) -> None:
        super().__init__()
        self.weight = weight
        self.bias = bias
        self._packed: torch.Tensor | None = None
        self._packed_version = -1

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
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
