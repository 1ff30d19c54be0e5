"""Linear layers: the projection, with its GEMM delegated to a `quant_method` (vLLM's seam).

The method (models/quantization/) stores the weight its way and computes x @ W.T + bias (+ residual):
`UnquantizedLinearMethod` (the default: `F.linear`, or oneDNN with a prepacked weight for fp32 and bf16 on CPU,
fp32 with the residual fused), `Int8LinearMethod` (W8A8), `RTNLinearMethod` (W4A16 group-wise),
`PackedLinearMethod` (a GPTQ/AWQ checkpoint's integers: no dense `weight`).

With multi-LoRA serving a Linear also holds its adapter slots (`lora`, set by
`models.lora.attach_lora_stacks`); a step whose rows use adapters adds each row's delta
(`models.lora.add_lora`) after the GEMM, whatever the scheme (the adapters stay dense).
"""
from __future__ import annotations

import torch
from torch import nn

from engine_core.models.lora import LoRAMapping, LoRAStack, add_lora
from engine_core.models.quantization import LinearMethodBase, UnquantizedLinearMethod


class Linear(nn.Module):
    """y = x @ weight.T + bias (+ each row's LoRA delta) (+ residual)."""

    def __init__(self, weight: nn.Parameter | None, bias: nn.Parameter | None = None,
                 quant_method: LinearMethodBase | None = None) -> None:
        super().__init__()
        self.quant_method = quant_method or UnquantizedLinearMethod()
        self.quant_method.create_weights(self, weight, bias)
        self.quant_method.process_weights_after_loading(self)
        self.lora: LoRAStack | None = None  # adapter slots, when the engine serves LoRA

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None,
                lora: LoRAMapping | None = None) -> torch.Tensor:
        if lora is not None and self.lora is not None:
            y = self.quant_method.apply(self, x, None)
            add_lora(y, x, self.lora, lora)
            return y if residual is None else residual + y
        return self.quant_method.apply(self, x, residual)

    def weight_bytes(self) -> int:
        """Bytes of this projection's weight as stored by its scheme (scales and zero points included)."""
        return self.quant_method.weight_bytes(self)
