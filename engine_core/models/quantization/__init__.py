"""Weight quantization behind `Linear` (vLLM's `quant_method` seam, base.py): one file per scheme.

- unquantized.py: the dense GEMM (oneDNN prepacked fp32 on CPU): every Linear without a scheme
- int8.py: W8A8, `quantization="int8"`
- smoothquant.py: W8A8 after SmoothQuant's migration, `quantization_config={"smoothquant": FILE}`
- rtn.py: W4A16 (or W8A16) group-wise round-to-nearest, `quantization="rtn"`
- packed.py: GPTQ and AWQ checkpoints (gptq.py, awq.py: their packing), `quantization="gptq"` / `"awq"`
- gguf_q4_1.py: a GGUF file's Q4_1 blocks served as they are, `quantization="gguf"`
- gguf_q8_0.py: its Q8_0 embedding blocks as the tied LM head (bf16 on CPU, as llama.cpp serves it)
- fp8.py: W8A8 float8_e4m3fn quantized at load, `quantization="fp8"`
- nf4.py: QLoRA's NormalFloat4 weights (blocks of 64, fp32 absmax), `quantization="nf4"`

The embedding stays dense, and so does the LM head except gguf_q8_0's.
"""
from __future__ import annotations

from engine_core.config import QuantizationConfig
from engine_core.models.config import LlamaArgs
from engine_core.models.quantization.base import LinearMethodBase
from engine_core.models.quantization.fp8 import Fp8LinearMethod, check_fp8_supported
from engine_core.models.quantization.int8 import Int8LinearMethod
from engine_core.models.quantization.nf4 import NF4LinearMethod
from engine_core.models.quantization.packed import (PACKED_METHODS, PackedLinearMethod, fused_tensors,
                                                    resolve_packed_config)
from engine_core.models.quantization.rtn import RTNLinearMethod
from engine_core.models.quantization.smoothquant import SmoothQuantInt8LinearMethod, linear_amax_of
from engine_core.models.quantization.unquantized import UnquantizedLinearMethod


def get_linear_method(quant: QuantizationConfig | None, prefix: str | None = None,
                      in_features: int | None = None, logical_widths: list[int] | None = None) -> LinearMethodBase:
    """A fresh method for one projection (methods hold no per-layer state, but a layer may cache on itself);
    `prefix` (its first checkpoint name) and `in_features` find its calibrated maxima for SmoothQuant;
    `logical_widths` (the rows of each fused checkpoint matrix) give fp8 its per-tensor scales."""
    if quant is None:
        return UnquantizedLinearMethod()
    if quant.method == "fp8":
        return Fp8LinearMethod(logical_widths, quant.weight_strategy, quant.activation_strategy)
    if quant.method == "int8" and quant.smoothquant is not None:
        if prefix is None or in_features is None:
            raise ValueError("SmoothQuant needs each projection's checkpoint name and input size (a caller bug)")
        return SmoothQuantInt8LinearMethod(linear_amax_of(quant.smoothquant, prefix, in_features), quant.alpha)
    if quant.method == "int8":
        return Int8LinearMethod()
    if quant.method == "nf4":
        return NF4LinearMethod()
    return RTNLinearMethod(quant.bits, quant.group_size)


def check_model_shapes(quant: QuantizationConfig | None, args: LlamaArgs) -> None:
    """Before any weight loads: the group size must divide every projection's input size."""
    if quant is None or quant.group_size is None or quant.method in PACKED_METHODS:
        return  # a packed checkpoint's group size is checked against each tensor as it loads (packed.py)
    inputs = {"hidden_size": args.hidden_size, "num_attention_heads * head_dim": args.num_heads * args.head_dim,
              "intermediate_size": args.intermediate_size}
    bad = {name: k for name, k in inputs.items() if k % quant.group_size}
    if bad:
        raise ValueError(f"quantization_config['group_size'] must divide every projection's input size "
                         f"({', '.join(f'{n}={k}' for n, k in inputs.items())}), got {quant.group_size}, which does "
                         f"not divide {', '.join(bad)}")


__all__ = ["LinearMethodBase", "UnquantizedLinearMethod", "Int8LinearMethod", "RTNLinearMethod", "Fp8LinearMethod",
           "NF4LinearMethod", "check_fp8_supported",
           "SmoothQuantInt8LinearMethod", "PackedLinearMethod", "PACKED_METHODS", "fused_tensors",
           "resolve_packed_config",
           "get_linear_method", "check_model_shapes"]
