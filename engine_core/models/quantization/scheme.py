"""`WeightScheme`: how one model's projections are built under its weight quantization, the one place a scheme is
chosen. `WeightScheme.load` reads and checks what the scheme needs before any weight loads (a GPTQ/AWQ
checkpoint's options, a GGUF file's blocks, the group size against the shapes, fp8 support); `linear` builds each
projection's `Linear` (its method from the scheme's module), `lm_head` the gguf scheme's Q8_0 head. The model code
(models/llama.py) knows no scheme."""
from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from engine_core.config import QuantizationConfig
from engine_core.gguf_file import read_quant_blocks
from engine_core.models.config import LlamaArgs, packed_quant_method
from engine_core.models.linear import Linear
from engine_core.models.loader import CheckpointReader, read_config
from engine_core.models.quantization import (PACKED_METHODS, PackedLinearMethod, check_fp8_supported,
                                            check_model_shapes, fused_tensors, get_linear_method,
                                            resolve_packed_config)
from engine_core.models.quantization.gguf_q4_1 import q4_1_method
from engine_core.models.quantization.gguf_q8_0 import q8_0_head_method


def _param(t: torch.Tensor | None) -> nn.Parameter | None:
    return None if t is None else nn.Parameter(t, requires_grad=False)


class WeightScheme:
    """`quant`: the options (None: dense); `blocks`: a gguf model's quantized tensors by Hugging Face name."""

    def __init__(self, quant: QuantizationConfig | None = None,
                 blocks: dict[str, tuple[str, torch.Tensor]] | None = None) -> None:
        self.quant, self.blocks = quant, blocks or {}
        self.method = None if quant is None else quant.method

    @classmethod
    def load(cls, folder: str | Path, quant: QuantizationConfig | None, args: LlamaArgs,
             device: torch.device) -> "WeightScheme":
        """The scheme of the checkpoint in `folder` under `quant`, checked before any weight is read."""
        blocks = None
        if quant is not None and quant.method in PACKED_METHODS:
            quant = resolve_packed_config(folder, quant)
        elif quant is not None and quant.method == "gguf":
            blocks = read_quant_blocks(quant.file, args.num_heads, args.num_kv_heads)
        elif (stored := packed_quant_method(read_config(folder))) is not None:
            raise ValueError(f"checkpoint {str(folder)!r} is {stored}-quantized (config.json's quantization_config); "
                             f"load it with quantization={stored!r}, got {None if quant is None else quant.method!r}")
        check_model_shapes(quant, args)
        if quant is not None and quant.method == "fp8":
            check_fp8_supported(device)
        return cls(quant, blocks)

    def linear(self, ckpt: CheckpointReader, names: list[str], bias: bool, rows: list[slice] | None = None) -> Linear:
        """One Linear over the checkpoint matrices `names` stacked along the output dimension; with `rows`, only
        those rows of each (a column-parallel shard: dense schemes only, as the config allows)."""
        if self.method in PACKED_METHODS or self.method == "gguf":  # no dense weight: the stored integers
            method = (PackedLinearMethod(self.quant, fused_tensors(ckpt.get_stored, ckpt.has, names, self.quant),
                                         ckpt.dtype) if self.method in PACKED_METHODS
                      else q4_1_method(self.blocks, names, self.quant.file, ckpt.dtype))
            return Linear(None, _param(torch.cat([ckpt.get(f"{n}.bias") for n in names])) if bias else None, method)
        rows = rows or [slice(None)] * len(names)
        parts = [ckpt.get(f"{n}.weight")[r] for n, r in zip(names, rows)]
        weight = torch.cat(parts)
        return Linear(_param(weight), _param(torch.cat([ckpt.get(f"{n}.bias")[r] for n, r in zip(names, rows)]))
                      if bias else None, get_linear_method(self.quant, names[0], weight.shape[1],
                                                           [p.shape[0] for p in parts]))

    def lm_head(self, embed: torch.Tensor, tied: bool) -> Linear | None:
        """The gguf scheme's tied LM head on the file's Q8_0 embedding blocks; None: the dense head."""
        method = q8_0_head_method(self.blocks, embed) if self.method == "gguf" and tied else None
        return None if method is None else Linear(None, None, method)
