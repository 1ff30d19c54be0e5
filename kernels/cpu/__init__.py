"""C kernels for CPU tensors: paged decode and prefill attention read in place, the KV cache write, and the
model's fused elementwise ops (RMSNorm, SiLU-and-mul, RoPE in place; vLLM's names), and
`DecodeAttentionBlock`: a decode-only step's RoPE, cache write and decode attention in one call per layer.

The attention ops keep `kernels.reference`'s contracts (and are tested against it). They cover
fp32 and bf16 caches (bf16: widened to fp32 as read, fp32 softmax and accumulation, the output
rounded once); any other case (fp8 or fp16 caches, mixed dtypes) runs the reference op, so every
call here is valid. Prefill attention reads the blocks in place too, 8 query rows of a head per work item
(csrc/paged_attention.c; bf16 on AVX512-BF16: bf16 dot products, P rounded to bf16 for P V as on a GPU,
csrc/paged_attention_avx512bf16.h). The elementwise ops take fp32
or bf16 (bf16 rounded at every step where the model's PyTorch formula rounds) and are tested against
those formulas.

The library is built on first use (`build.py`: GCC or clang, OpenMP where it links); if that fails, `load()`
warns once in one line with the reason and returns None, and the dispatch in `kernels` keeps the reference ops.
The library's one interface is csrc/kernels_cpu.h (prototypes, status codes, argument structs, threading
thresholds); `interface.py` mirrors it for ctypes.
"""
from __future__ import annotations

import contextlib
import ctypes
import warnings
from typing import Callable

import torch
from torch.profiler import record_function

from kernels import reference
from kernels.cpu.build import BuildError, build, detected
from kernels.cpu.interface import (NO_MEMORY, STATUS, DecodeAttentionBlockArgs, PagedAttentionArgs,
                                   ReshapeAndCacheArgs, RotaryEmbeddingArgs, declare)

__all__ = ["DecodeAttentionBlock", "load", "load_error", "paged_attention", "paged_attention_decode",
           "reshape_and_cache", "rms_norm", "rotary_embedding", "silu_and_mul"]

_lib: ctypes.CDLL | None = None
_load_error: str | None = None

_ITEMS_PER_THREAD = 4  # decode work items per thread, at least, for the dynamic schedule to balance


def load() -> ctypes.CDLL | None:
    """The library (built and loaded once per process), or None with a one-line warning saying why; a build
    without OpenMP says once that it runs on one thread and how to get threads."""
    global _lib, _load_error
    if _lib is None and _load_error is None:
        try:
            toolchain = detected()
            lib = ctypes.CDLL(str(build(toolchain=toolchain)))
        except (BuildError, OSError) as e:
            _load_error = str(e)
            warnings.warn(f"kernels.cpu: the C kernels are unavailable, CPU tensors use the slower PyTorch reference "
                          f"ops: {_load_error.splitlines()[0]}", RuntimeWarning, stacklevel=2)
            return None
        if toolchain.openmp_flags is None:
            warnings.warn(f"kernels.cpu: {toolchain.cc} built the C kernels without OpenMP, so they run on one "
                          f"thread: {toolchain.openmp_hint}", RuntimeWarning, stacklevel=2)
        declare(lib)
        _lib = lib
    return _lib


def load_error() -> str | None:
    """Why the library could not be loaded (None if it loaded or was never tried)."""
    return _load_error


def _check(status: int) -> None:
    """Raise for a kernels_cpu_status other than 0 (csrc/kernels_cpu.h)."""
    if status:
        error = MemoryError if status == NO_MEMORY else IndexError
        raise error(f"kernels.cpu: {STATUS.get(status, f'error {status}')}")


def _profiled(name: str) -> contextlib.AbstractContextManager[object]:
    """A torch.profiler range around a C call (not an ATen op, so otherwise invisible), only while
    a profiler runs: record_function is a dispatcher call of a few microseconds even when off."""
    return record_function(name) if torch.autograd._profiler_enabled() else contextlib.nullcontext()


FAST_DTYPES = (torch.float32, torch.bfloat16)  # what the C kernels compute in


def _fast_cpu(*tensors: torch.Tensor) -> bool:
    """CPU tensors of one dtype the C kernels take. A plain loop over `is_cpu`: this runs ~200 times a decode
    step, where a generator and a `torch.device` per tensor cost ~0.5 ms of a batch-1 step."""
    dtype = tensors[0].dtype
    if dtype not in FAST_DTYPES:
        return False
    for t in tensors:
        if t.dtype != dtype or not t.is_cpu:
            return False
    return True


def _attention_in_c(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor) -> bool:
    """The cases the C attention kernels take: fp32 or bf16 caches and query on CPU, contiguous caches, head_dim
    a multiple of 8 and contiguous in the query."""
    return (_fast_cpu(query, key_cache, value_cache) and key_cache.is_contiguous() and value_cache.is_contiguous()
            and query.stride(-1) == 1 and query.shape[-1] % 8 == 0)


def _check_caches(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor) -> None:
    num_heads, head_dim = query.shape[1:]
    if key_cache.shape[3] != head_dim or value_cache.shape != key_cache.shape or num_heads % key_cache.shape[2]:
        raise ValueError(f"query {tuple(query.shape)} and caches {tuple(key_cache.shape)} / "
                         f"{tuple(value_cache.shape)} disagree")


def _int32_tables(block_tables: torch.Tensor, seq_lens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The block tables (rows contiguous) and sequence lengths as the C kernels read them."""
    tables = block_tables.to(torch.int32)
    return tables if tables.stride(-1) == 1 else tables.contiguous(), seq_lens.to(torch.int32).contiguous()


def paged_attention_decode(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                           k_scale: float | torch.Tensor = 1.0, v_scale: float | torch.Tensor = 1.0,
                           num_splits: int = 1) -> torch.Tensor:
    """`reference.paged_attention_decode`, fp32 or bf16 caches (the query of the same dtype) with head_dim a
    multiple of 8 in C. `num_splits` only names a GPU work split: it is checked, then ignored (the result does
    not depend on it)."""
    lib = load()
    if lib is None or not _attention_in_c(query, key_cache, value_cache):
        return reference.paged_attention_decode(query, key_cache, value_cache, block_tables, seq_lens, scale,
                                                k_scale, v_scale, num_splits)
    if num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    _check_caches(query, key_cache, value_cache)
    num_seqs, num_heads, head_dim = query.shape
    num_blocks, block_size, num_kv_heads, _ = key_cache.shape
    if block_tables.dim() != 2 or block_tables.shape[0] != num_seqs or seq_lens.shape != (num_seqs,):
        raise ValueError(f"block_tables must be [{num_seqs}, max_blocks] and seq_lens [{num_seqs}], got "
                         f"{tuple(block_tables.shape)} and {tuple(seq_lens.shape)}")
    tables, lens = _int32_tables(block_tables, seq_lens)
    out = torch.empty_like(query, memory_format=torch.contiguous_format)
    # Whole sequences are the best work items (their blocks stream contiguously); cut each one's
    # KV heads into runs only when there are too few sequences to keep every thread busy.
    head_splits = min(num_kv_heads, -(-_ITEMS_PER_THREAD * torch.get_num_threads() // max(num_seqs, 1)))
    with _profiled("kernels.cpu.paged_attention_decode"):
        args = PagedAttentionArgs(
            out=out.data_ptr(), query=query.data_ptr(), key_cache=key_cache.data_ptr(),
            value_cache=value_cache.data_ptr(), block_tables=tables.data_ptr(), seq_lens=lens.data_ptr(),
            num_seqs=num_seqs, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
            block_size=block_size, num_blocks=num_blocks, q_token_stride=query.stride(0),
            q_head_stride=query.stride(1), table_stride=tables.stride(0), table_width=tables.shape[1],
            head_splits=head_splits, scale=scale)
        status = _typed(lib.paged_attention_decode_f32, lib.paged_attention_decode_bf16, query)(ctypes.byref(args))
    _check(status)
    return out


def paged_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                    block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
                    scale: float, k_scale: float | torch.Tensor = 1.0,
                    v_scale: float | torch.Tensor = 1.0) -> torch.Tensor:
    """`reference.paged_attention` (varlen causal attention over paged KV), fp32 or bf16 caches (the query of
    the same dtype) with head_dim a multiple of 8 in C."""
    lib = load()
    if lib is None or not _attention_in_c(query, key_cache, value_cache):
        return reference.paged_attention(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc,
                                         scale, k_scale, v_scale)
    _check_caches(query, key_cache, value_cache)
    num_tokens, num_heads, head_dim = query.shape
    num_blocks, block_size, num_kv_heads, _ = key_cache.shape
    num_seqs = seq_lens.shape[0]
    if (block_tables.dim() != 2 or block_tables.shape[0] != num_seqs or seq_lens.dim() != 1
            or query_start_loc.shape != (num_seqs + 1,)):
        raise ValueError(f"block_tables must be [{num_seqs}, max_blocks] and query_start_loc [{num_seqs + 1}], got "
                         f"{tuple(block_tables.shape)} and {tuple(query_start_loc.shape)}")
    starts = query_start_loc.to(torch.int32).contiguous()
    if num_seqs and (int(starts[0]) != 0 or int(starts[-1]) != num_tokens):  # the C code checks each step between
        raise ValueError(f"query_start_loc must rise from 0 to the query's {num_tokens} rows, got {starts.tolist()}")
    tables, lens = _int32_tables(block_tables, seq_lens)
    out = torch.empty_like(query, memory_format=torch.contiguous_format)
    with _profiled("kernels.cpu.paged_attention"):
        args = PagedAttentionArgs(
            out=out.data_ptr(), query=query.data_ptr(), key_cache=key_cache.data_ptr(),
            value_cache=value_cache.data_ptr(), block_tables=tables.data_ptr(), seq_lens=lens.data_ptr(),
            query_start_loc=starts.data_ptr(), num_seqs=num_seqs, num_heads=num_heads, num_kv_heads=num_kv_heads,
            head_dim=head_dim, block_size=block_size, num_blocks=num_blocks, q_token_stride=query.stride(0),
            q_head_stride=query.stride(1), table_stride=tables.stride(0), table_width=tables.shape[1], scale=scale)
        status = _typed(lib.paged_attention_f32, lib.paged_attention_bf16, query)(ctypes.byref(args))
    _check(status)
    return out


def reshape_and_cache(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                      slot_mapping: torch.Tensor, kv_cache_dtype: str = "auto",
                      k_scale: float | torch.Tensor = 1.0, v_scale: float | torch.Tensor = 1.0) -> None:
    """`reference.reshape_and_cache`, fp32 or bf16 caches in C (K/V may be strided views, head_dim contiguous)."""
    lib = load()
    if (lib is None or kv_cache_dtype != "auto" or not _fast_cpu(key, value, key_cache, value_cache)
            or not key_cache.is_contiguous() or not value_cache.is_contiguous()
            or key.stride(-1) != 1 or value.stride(-1) != 1):
        return reference.reshape_and_cache(key, value, key_cache, value_cache, slot_mapping, kv_cache_dtype,
                                           k_scale, v_scale)
    num_tokens, num_kv_heads, head_dim = key.shape
    if value.shape != key.shape or key_cache.shape[2:] != key.shape[1:] or value_cache.shape != key_cache.shape:
        raise ValueError(f"key {tuple(key.shape)}, value {tuple(value.shape)} and caches "
                         f"{tuple(key_cache.shape)} / {tuple(value_cache.shape)} disagree")
    slots = slot_mapping.to(torch.int64).contiguous()
    if slots.shape != (num_tokens,):
        raise ValueError(f"slot_mapping must be [{num_tokens}], got {tuple(slot_mapping.shape)}")
    with _profiled("kernels.cpu.reshape_and_cache"):
        args = ReshapeAndCacheArgs(
            key=key.data_ptr(), value=value.data_ptr(), key_cache=key_cache.data_ptr(),
            value_cache=value_cache.data_ptr(), slot_mapping=slots.data_ptr(), num_tokens=num_tokens,
            num_kv_heads=num_kv_heads, head_dim=head_dim, num_slots=key_cache.shape[0] * key_cache.shape[1],
            k_token_stride=key.stride(0), k_head_stride=key.stride(1), v_token_stride=value.stride(0),
            v_head_stride=value.stride(1), elem_size=key.element_size())
        status = lib.reshape_and_cache(ctypes.byref(args))
    _check(status)


def _require(lib: ctypes.CDLL | None, *tensors: torch.Tensor) -> ctypes.CDLL:
    if lib is None:
        raise RuntimeError(f"kernels.cpu: the C kernels are unavailable: {_load_error}")
    if not _fast_cpu(*tensors) or not _last_dim_contiguous(tensors):
        raise ValueError("kernels.cpu elementwise ops take fp32 or bf16 CPU tensors of one dtype whose last dimension "
                         "is contiguous, got "
                         + ", ".join(f"{t.dtype} {t.device} strides {t.stride()}" for t in tensors))
    return lib


def _last_dim_contiguous(tensors: tuple[torch.Tensor, ...]) -> bool:
    for t in tensors:
        if t.stride(-1) != 1:
            return False
    return True


def _typed(f32: Callable[..., object], bf16: Callable[..., object], x: torch.Tensor) -> Callable[..., object]:
    return bf16 if x.dtype == torch.bfloat16 else f32


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * (x * rsqrt(mean(x^2, -1) + eps)) for x [rows, width] (rows may be strided)."""
    lib = _require(load(), x, weight)
    rows, width = x.shape
    out = torch.empty(rows, width, dtype=x.dtype)
    with _profiled("kernels.cpu.rms_norm"):
        _typed(lib.rms_norm_f32, lib.rms_norm_bf16, x)(out.data_ptr(), x.data_ptr(), weight.data_ptr(), rows, width,
                                                      x.stride(0), eps)
    return out


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """silu(x[:, :d]) * x[:, d:] for x [rows, 2d] (rows may be strided): SwiGLU's activation."""
    lib = _require(load(), x)
    rows, d = x.shape[0], x.shape[1] // 2
    out = torch.empty(rows, d, dtype=x.dtype)
    with _profiled("kernels.cpu.silu_and_mul"):
        _typed(lib.silu_and_mul_f32, lib.silu_and_mul_bf16, x)(out.data_ptr(), x.data_ptr(), rows, d, x.stride(0))
    return out


def rotary_embedding(x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Rotate-half RoPE in place on x [tokens, heads, head_dim] (heads head_dim apart, tokens any stride
    apart) at `positions`; cos/sin are [max_positions, head_dim / 2] tables."""
    lib = _require(load(), x, cos, sin)
    tokens, heads, head_dim = x.shape
    if x.stride(1) != head_dim or cos.shape != sin.shape or cos.shape[1] * 2 != head_dim or not cos.is_contiguous() \
            or not sin.is_contiguous():
        raise ValueError(f"rotary_embedding: x {tuple(x.shape)} strides {x.stride()}, cos {tuple(cos.shape)}, "
                         f"sin {tuple(sin.shape)} disagree")
    pos = positions.to(torch.int64).contiguous()
    if pos.shape != (tokens,):
        raise ValueError(f"positions must be [{tokens}], got {tuple(positions.shape)}")
    with _profiled("kernels.cpu.rotary_embedding"):
        args = RotaryEmbeddingArgs(x=x.data_ptr(), positions=pos.data_ptr(), cos=cos.data_ptr(), sin=sin.data_ptr(),
                                   tokens=tokens, heads=heads, head_dim=head_dim, token_stride=x.stride(0),
                                   max_positions=cos.shape[0])
        status = _typed(lib.rotary_embedding_f32, lib.rotary_embedding_bf16, x)(ctypes.byref(args))
    _check(status)


class DecodeAttentionBlock:
    """A decode-only step's attention block after the QKV GEMM, one C call per layer: `rotary_embedding` on
    the q and k heads, `reshape_and_cache` of k and v, `paged_attention_decode` of the rotated queries
    (csrc/decode_attention_block.c runs those three kernels, so the result is theirs bit for bit). The step's
    positions, slots, tables and lengths are checked and converted here once; each layer passes only its
    qkv rows and caches. `applies` says whether this step's tensors are the kind it takes."""

    def __init__(self, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, slot_mapping: torch.Tensor,
                 block_tables: torch.Tensor, seq_lens: torch.Tensor, num_heads: int, num_kv_heads: int,
                 head_dim: int) -> None:
        lib = load()
        tokens = positions.shape[0]
        self.applies = (lib is not None and _fast_cpu(cos, sin) and cos.is_contiguous() and sin.is_contiguous()
                        and head_dim % 8 == 0 and cos.shape[1] * 2 == head_dim and num_heads % num_kv_heads == 0
                        and block_tables.dim() == 2 and block_tables.shape[0] == tokens
                        and seq_lens.shape == (tokens,) and slot_mapping.shape == (tokens,) and tokens > 0)
        if not self.applies:
            return
        self.fn = _typed(lib.decode_attention_block_f32, lib.decode_attention_block_bf16, cos)
        self.dtype, self.cos, self.sin = cos.dtype, cos, sin
        self.positions = positions.to(torch.int64).contiguous()
        self.slots = slot_mapping.to(torch.int64).contiguous()
        self.tables, self.lens = _int32_tables(block_tables, seq_lens)
        self.num_heads, self.num_kv_heads, self.head_dim, self.tokens = num_heads, num_kv_heads, head_dim, tokens
        self.width = (num_heads + 2 * num_kv_heads) * head_dim
        head_splits = min(num_kv_heads, -(-_ITEMS_PER_THREAD * torch.get_num_threads() // tokens))
        # the step's arguments, set once; each layer sets its own output, qkv, caches and scale
        self.args = DecodeAttentionBlockArgs(
            positions=self.positions.data_ptr(), cos=cos.data_ptr(), sin=sin.data_ptr(),
            slot_mapping=self.slots.data_ptr(), block_tables=self.tables.data_ptr(), seq_lens=self.lens.data_ptr(),
            tokens=tokens, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
            table_stride=self.tables.stride(0), table_width=self.tables.shape[1], head_splits=head_splits,
            max_positions=cos.shape[0])
        self.args_ref = ctypes.byref(self.args)

    def __call__(self, qkv: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                 scale: float) -> torch.Tensor:
        """qkv `[tokens, (num_heads + 2 num_kv_heads) * head_dim]` (rotated in place) -> attention output
        `[tokens, num_heads * head_dim]`; K and V written into the caches `[num_blocks, block_size, kv_heads,
        head_dim]` (contiguous, this step's dtype)."""
        if (qkv.shape != (self.tokens, self.width) or qkv.stride(-1) != 1 or qkv.dtype != self.dtype
                or not qkv.is_cpu or not _fast_cpu(key_cache, value_cache) or key_cache.dtype != self.dtype
                or not key_cache.is_contiguous() or not value_cache.is_contiguous()
                or value_cache.shape != key_cache.shape or key_cache.shape[2:] != (self.num_kv_heads, self.head_dim)):
            raise ValueError(f"DecodeAttentionBlock: qkv {tuple(qkv.shape)} {qkv.dtype} strides {qkv.stride()} and "
                             f"caches {tuple(key_cache.shape)} / {tuple(value_cache.shape)} {key_cache.dtype} do not "
                             f"fit a step of {self.tokens} tokens, {self.num_heads} heads on {self.num_kv_heads} KV "
                             f"heads of {self.head_dim} in {self.dtype}")
        out = torch.empty(self.tokens, self.num_heads * self.head_dim, dtype=self.dtype)
        args = self.args
        args.out, args.qkv, args.key_cache, args.value_cache = (out.data_ptr(), qkv.data_ptr(), key_cache.data_ptr(),
                                                                value_cache.data_ptr())
        args.block_size, args.num_blocks, args.qkv_stride, args.scale = (key_cache.shape[1], key_cache.shape[0],
                                                                         qkv.stride(0), scale)
        with _profiled("kernels.cpu.decode_attention_block"):
            status = self.fn(self.args_ref)
        _check(status)
        return out
