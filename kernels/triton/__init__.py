"""Triton kernels, one file per op family, each with the same launcher signature as its
`kernels.reference` twin: `cache.py` (reshape_and_cache), `decode_attention.py`
(paged_attention_decode, flash-decoding), `prefill_attention.py` (varlen paged_attention), `lora.py` (multi-LoRA
SGMV / BGMV shrink and expand, twins of `kernels.lora_reference`), `w4a16.py` and `fp8_gemm.py` (the
weight-quantized GEMMs, twins of `kernels.quant_reference`; their tiles and split-K in `_gemm_tiles.py`).

Import these modules only through `kernels` (the dispatch), which imports them on first use:
whether a kernel is compiled or interpreted is fixed when its module is imported."""
