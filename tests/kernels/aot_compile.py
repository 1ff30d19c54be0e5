"""Compile every Triton kernel for an sm_90 GPU (H100/H200) without a GPU: Triton lowers to PTX
and its bundled ptxas assembles it. The interpreter accepts code the compiler rejects (globals
that are not constexpr, loop-carried values that change type, tl.dot shapes), so this catches
what CPU tests cannot. Run as a script, without TRITON_INTERPRET (test_kernels_compile.py
does so in a subprocess); prints one line per kernel variant with its shared memory."""
from __future__ import annotations

import sys

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from kernels.triton import cache, decode_attention, fp8_gemm, prefill_attention, w4a16
from kernels.triton._gemm_tiles import gemm_tiles

TARGET = GPUTarget("cuda", 90, 32)
H100_SMEM = 227 * 1024  # per-block shared memory limit on sm_90


def _compile(fn: triton.JITFunction, types: dict[str, str], constexprs: dict[str, object], num_warps: int,
             num_stages: int) -> triton.compiler.CompiledKernel:
    """Arguments not named in `types` are i32 (strides, sizes). As the runtime JIT would for a
    Llama-shaped batch, pointers and the cache/query strides are marked divisible by 16
    (that is what lets K/V loads vectorise); a block table's row stride and counts are not."""
    signature = {n: "constexpr" if n in constexprs else types.get(n, "i32") for n in fn.arg_names}
    unaligned = {"stride_bt", "num_seqs"}
    attrs = {(i,): [["tt.divisibility", 16]] for i, (n, t) in enumerate(signature.items())
             if t.startswith("*") or (t == "i32" and n not in unaligned)}
    return triton.compile(ASTSource(fn, signature, constexprs=constexprs, attrs=attrs), target=TARGET,
                          options=dict(num_warps=num_warps, num_stages=num_stages))


def _variants() -> list[tuple[str, triton.JITFunction, dict, dict, dict]]:
    """(name, kernel, argument types, constexprs, launch options) as the launchers use them on a GPU,
    for a Llama-style head_dim 128, GQA group 4, block size 16."""
    out = []
    for dtype, torch_dtype in (("bf16", torch.bfloat16), ("fp32", torch.float32)):  # fp16 compiles as bf16 does
        for kv in (dtype, "fp8e4nv", "fp8e5"):  # e4m3 / e5m2 caches: a per-tensor K scale, per-head V scales
            fp8 = kv != dtype
            types = dict(q_ptr=f"*{dtype}", k_cache_ptr=f"*{kv}", v_cache_ptr=f"*{kv}",
                         block_tables_ptr="*i32", seq_lens_ptr="*i32", query_start_loc_ptr="*i32", scale_log2="fp32",
                         k_scale="fp32", v_scale="*fp32", lse_ptr="*fp32")
            flags = dict(IS_FP8=fp8, K_SCALE_IS_PTR=False, V_SCALE_IS_PTR=True, K_SCALE_STRIDE=0, V_SCALE_STRIDE=1,
                         UPCAST=dtype == "fp32", BLOCK_SIZE=16, BLOCK_D=128, GROUP=4)
            cfg = decode_attention._config(16, torch_dtype)
            launch = dict(num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
            for splits in (1, 8):
                out.append((f"decode {dtype} cache={kv} splits={splits}", decode_attention._decode_kernel,
                            dict(types, out_ptr="*fp32" if splits > 1 else f"*{dtype}"),
                            dict(flags, BLOCK_G=16, BLOCK_N=cfg["BLOCK_N"], NUM_SPLITS=splits), launch))
            cfg = prefill_attention._config(4, torch_dtype)
            out.append((f"prefill {dtype} cache={kv}", prefill_attention._prefill_kernel,
                        dict(types, out_ptr=f"*{dtype}", num_seqs="i32"),
                        dict(flags, BLOCK_Q=cfg["BLOCK_M"] // 4, BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"]),
                        dict(num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])))
    out.append(("merge", decode_attention._merge_kernel, dict(part_ptr="*fp32", lse_ptr="*fp32", out_ptr="*bf16"),
                dict(NUM_SPLITS=8, BLOCK_S=8, BLOCK_D=128), dict(num_warps=4, num_stages=1)))
    for kv, fp8_max in (("bf16", 0.0), ("fp8e4nv", 448.0), ("fp8e5", 57344.0)):
        out.append((f"reshape_and_cache cache={kv}", cache._reshape_and_cache_kernel,
                    dict(key_ptr="*bf16", value_ptr="*bf16", key_cache_ptr=f"*{kv}", value_cache_ptr=f"*{kv}",
                         slot_mapping_ptr="*i64", k_scale="fp32", v_scale="*fp32"),
                    dict(BLOCK_SIZE=16, BLOCK_H=8, BLOCK_D=128, QUANTIZE=fp8_max > 0, FP8_MAX=fp8_max,
                         K_SCALE_IS_PTR=False, V_SCALE_IS_PTR=True, K_SCALE_STRIDE=0, V_SCALE_STRIDE=1),
                    dict(num_warps=4, num_stages=1)))
    for m in (1, 256):  # decode and a large batch: the configs' two ends (K = N = 8192, as benchmarks.quant_kernels)
        for act, perm, float_zeros in (("bf16", False, False), ("fp16", True, False), ("bf16", False, True)):
            cfg = gemm_tiles(m, 8192, 8192, 128, 132, False)[0]
            launch = dict(num_warps=cfg.pop("num_warps"), num_stages=cfg.pop("num_stages"))
            out.append((f"w4a16 M={m} {act} perm={perm} float_zeros={float_zeros}", w4a16._w4a16_kernel,
                        dict(x_ptr=f"*{act}", qweight_ptr="*i32", scales_ptr=f"*{act}",
                             zeros_ptr="*fp16" if float_zeros else "*u8", perm_ptr="*i32", out_ptr=f"*{act}"),
                        dict(cfg, GROUP_SIZE=128, HAS_PERM=perm, FLOAT_ZEROS=float_zeros, UPCAST=False), launch))
        for per_token, per_channel in ((True, True), (False, False)):
            cfg = gemm_tiles(m, 8192, 8192, 128, 132, False)[0]
            launch = dict(num_warps=cfg.pop("num_warps"), num_stages=cfg.pop("num_stages"))
            out.append((f"fp8_gemm M={m} per_token={per_token} per_channel={per_channel}", fp8_gemm._fp8_gemm_kernel,
                        dict(a_ptr="*fp8e4nv", w_ptr="*fp8e4nv", a_scale_ptr="*fp32", w_scale_ptr="*fp32",
                             bias_ptr="*bf16", out_ptr="*bf16"),
                        dict(cfg, A_PER_TOKEN=per_token, W_PER_CHANNEL=per_channel, HAS_BIAS=per_token, UPCAST=False),
                        launch))
    return out


def main() -> int:
    failed = 0
    for name, fn, types, constexprs, options in _variants():
        try:
            smem = _compile(fn, types, constexprs, **options).metadata.shared
        except Exception as e:  # report every variant, then fail
            print(f"FAIL {name}: {type(e).__name__}: {e}")
            failed += 1
            continue
        status = "ok" if smem <= H100_SMEM else "FAIL (shared memory over the sm_90 limit)"
        failed += smem > H100_SMEM
        print(f"{status} {name}: {smem} B shared memory")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
