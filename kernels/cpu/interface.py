"""The C library's interface on the Python side: csrc/kernels_cpu.h's argument structs as ctypes Structures
(field for field; tests/kernels/test_kernels_cpu_interface.py compares the two), its status codes, and one
signature table that `declare` applies to a loaded library."""
from __future__ import annotations

import ctypes

__all__ = ["DecodeAttentionBlockArgs", "Fp8GemmArgs", "GgmlMulMatA8Args", "PagedAttentionArgs", "ReshapeAndCacheArgs",
           "NO_MEMORY", "RotaryEmbeddingArgs", "SIGNATURES", "STATUS", "SkinnyGemmArgs", "declare"]

_ptr, _i64 = ctypes.c_void_p, ctypes.c_int64


def _fields(spec: str, ctype: type) -> list[tuple[str, type]]:
    return [(name, ctype) for name in spec.split()]


class PagedAttentionArgs(ctypes.Structure):
    _fields_ = (_fields("out query key_cache value_cache block_tables seq_lens query_start_loc", _ptr)
                + _fields("num_seqs num_heads num_kv_heads head_dim block_size num_blocks q_token_stride q_head_stride "
                          "table_stride table_width head_splits", _i64) + [("scale", ctypes.c_float)])


class ReshapeAndCacheArgs(ctypes.Structure):
    _fields_ = (_fields("key value key_cache value_cache slot_mapping", _ptr)
                + _fields("num_tokens num_kv_heads head_dim num_slots k_token_stride k_head_stride v_token_stride "
                          "v_head_stride elem_size", _i64))


class RotaryEmbeddingArgs(ctypes.Structure):
    _fields_ = (_fields("x positions cos sin", _ptr)
                + _fields("tokens heads head_dim token_stride max_positions", _i64))


class DecodeAttentionBlockArgs(ctypes.Structure):
    _fields_ = (_fields("out qkv positions cos sin key_cache value_cache slot_mapping block_tables seq_lens", _ptr)
                + _fields("tokens num_heads num_kv_heads head_dim block_size num_blocks qkv_stride table_stride "
                          "table_width head_splits max_positions", _i64) + [("scale", ctypes.c_float)])


class SkinnyGemmArgs(ctypes.Structure):
    _fields_ = _fields("y x w bias residual", _ptr) + _fields("m n k x_stride residual_stride", _i64)


class GgmlMulMatA8Args(ctypes.Structure):
    _fields_ = _fields("out x w dw mw", _ptr) + _fields("m n k x_stride bits bf16", _i64)


class Fp8GemmArgs(ctypes.Structure):
    _fields_ = _fields("y x bias residual w scale", _ptr) + _fields("m n k x_stride residual_stride bf16", _i64)


# kernels_cpu_status, what each code means
STATUS = {1: "a block table entry that a sequence uses is outside the cache", 2: "a slot is past the cache's end",
          3: "a sequence needs more blocks than its block table row has", 4: "a position is outside the RoPE tables",
          5: "a sequence's query rows (query_start_loc) fall or outnumber its tokens (seq_lens)", 6: "out of memory"}
NO_MEMORY = 6


def _by_ref(struct: type[ctypes.Structure]) -> list[type]:
    return [ctypes.POINTER(struct)]


# every exported function: (argument types, return type)
SIGNATURES: dict[str, tuple[list[type], type | None]] = {
    **{f"{op}_{t}": (_by_ref(PagedAttentionArgs), ctypes.c_int)
       for op in ("paged_attention_decode", "paged_attention") for t in ("f32", "bf16")},
    "reshape_and_cache": (_by_ref(ReshapeAndCacheArgs), ctypes.c_int),
    **{f"rotary_embedding_{t}": (_by_ref(RotaryEmbeddingArgs), ctypes.c_int) for t in ("f32", "bf16")},
    **{f"decode_attention_block_{t}": (_by_ref(DecodeAttentionBlockArgs), ctypes.c_int) for t in ("f32", "bf16")},
    **{f"skinny_gemm_{t}": (_by_ref(SkinnyGemmArgs), None) for t in ("f32", "bf16")},
    "ggml_mul_mat_a8": (_by_ref(GgmlMulMatA8Args), ctypes.c_int),
    "fp8_gemm_w8a16": (_by_ref(Fp8GemmArgs), ctypes.c_int),
    "fp8_gemm_w8a16_packed": (_by_ref(Fp8GemmArgs), ctypes.c_int),
    "bf16_gemm_packed": (_by_ref(SkinnyGemmArgs), None),
    "packed_gemm_native": ([_i64], ctypes.c_int),
    "fp8_dequantize": ([_ptr] * 3 + [_i64] * 3, None),
    **{f"rms_norm_{t}": ([_ptr] * 3 + [_i64] * 3 + [ctypes.c_float], None) for t in ("f32", "bf16")},
    **{f"silu_and_mul_{t}": ([_ptr] * 2 + [_i64] * 3, None) for t in ("f32", "bf16")},
}


def declare(lib: ctypes.CDLL) -> None:
    """Give every exported function of `lib` its argument and return types."""
    for name, (argtypes, restype) in SIGNATURES.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = argtypes, restype
