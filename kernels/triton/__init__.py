"""Triton kernels, one file per op family, each with the same launcher signature as its
`kernels.reference` twin: `cache.py` (reshape_and_cache), `decode_attention.py`
(paged_attention_decode, flash-decoding), `prefill_attention.py` (varlen paged_attention), `lora.py` (multi-LoRA
SGMV / BGMV shrink and expand, twins of `kernels.lora_reference`), `w4a16.py` and `fp8_gemm.py` (the
weight-quantized GEMMs, twins of `kernels.quant_reference`; their tiles and split-K in `_gemm_tiles.py`).

Import these modules only through `kernels` (the dispatch), which imports them on first use:
whether a kernel is compiled or interpreted is fixed when its module is imported."""

import importlib.util

if importlib.util.find_spec("triton") is None:  # macOS, Windows: triton publishes Linux wheels only
    raise ModuleNotFoundError("kernels.triton needs triton, which publishes Linux wheels only and is not installed "
                              "here: the cpu and torch backends run everything else; for the Triton kernels use a "
                              "Linux machine or container, or a hosted GPU notebook (docs/hosted.md)", name="triton")
