"""The seam between a `Linear` and its GEMM (vLLM's `LinearMethodBase`, quantization/base_config.py).

A `Linear` owns no arithmetic: its `quant_method` registers the weights on it (`create_weights`), turns
the loaded dense weight into the scheme's tensors once (`process_weights_after_loading`: quantize,
pack, prepack for a kernel) and runs the product (`apply`). A new scheme or a new CPU kernel is one
more method; the model code, LoRA and tensor parallelism do not change.
"""
from __future__ import annotations

import os
from abc import ABC, abstractmethod

import torch
from torch import nn

import kernels


class LinearMethodBase(ABC):
    """How one `Linear` stores its weight and computes x @ W.T + bias (+ residual)."""

    def create_weights(self, layer: nn.Module, weight: nn.Parameter, bias: nn.Parameter | None) -> None:
        """Hang the checkpoint's dense weight `[out, in]` and bias on `layer` (a scheme that quantizes online;
        packed.py's GPTQ/AWQ method loads integers instead and overrides this)."""
        layer.weight, layer.bias = weight, bias
        layer.input_size, layer.output_size = weight.shape[1], weight.shape[0]

    @abstractmethod
    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Once, after the weight is final: turn it into what `apply` reads."""

    @abstractmethod
    def apply(self, layer: nn.Module, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """x `[rows, in]` -> x @ W.T + bias (+ residual) `[rows, out]`, in x's dtype."""

    @abstractmethod
    def weight_bytes(self, layer: nn.Module) -> int:
        """Bytes the layer's weight takes in this scheme (scales and zero points included, bias excluded)."""


def add_bias_residual(y: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor | None) -> torch.Tensor:
    """y + bias + residual, in place on y (a fresh GEMM output)."""
    if bias is not None:
        y += bias
    if residual is not None:
        y += residual
    return y


def triton_kernels_apply(device: torch.device) -> bool:
    """Whether a quantized layer on `device` takes the project's Triton GEMMs: where the kernel backend for it is
    Triton (CUDA; CPU tensors only with KERNELS_BACKEND=triton, under the interpreter: how CPU tests reach them)."""
    if device.type != "cuda" and os.environ.get("KERNELS_BACKEND") != "triton":
        return False
    return kernels.resolve_backend("auto", device) == "triton"
