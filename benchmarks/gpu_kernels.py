"""The kernel cases of `make gpu-compile` (benchmarks/gpu_compile.py): every Triton kernel specialization the
engine and the labs launch on a GPU, with a register budget beside each kernel.

The launch parameters come from the launchers' own helpers (`_config`, `gemm_tiles`, `_block_r`, the fp8 storage
rule), so a changed tile size shows up here. Shapes: the real models' (SmolLM2-135M: 9 query / 3 KV heads of 64,
hidden 576; qwen3-0.6b-shape: 16 / 8 heads of 128, hidden 1024), block 16, fp32 / bf16 / fp16 and both fp8
caches, split and unsplit decode, LoRA ranks 16 (the engine's default max) and 64; the CPU tests' odd head size
(24) and block size 8; and the learner kernels of labs 06, 07, 09 and 18 as their solution notebooks (or, with
`--labs-dir labs`, the learner's own notebooks) write them.

Register budgets: 255 is the hardware's ceiling per thread; at 128 a 4-warp block still leaves 4 blocks (16
warps) per SM on every target, enough to hide memory latency in these memory-bound decode kernels. A budget
above 128 says why more pays.

Adding a kernel: write a function `cap -> Launch | str` (the specialization your launcher passes on a GPU of
that capability, or the engine's reason for refusing it there) and append `Case(name, budget, that function)`
in `cases()`; or try it first from your own file: `python -m benchmarks.gpu_compile --cases my_cases.py`.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from functools import lru_cache, partial
from pathlib import Path

import torch

from benchmarks.gpu_targets import Case, Launch
from kernels.fp8 import native_fp8

ROOT = Path(__file__).resolve().parent.parent
TRITON_TYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
KV = {"auto": None, "fp8_e4m3": ("fp8e4nv", 1, 448.0), "fp8_e5m2": ("fp8e5", 2, 57344.0)}


@dataclass(frozen=True)
class Model:
    name: str
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden: int


SMOLLM2 = Model("smollm2", 9, 3, 64, 576)
QWEN3 = Model("qwen3-0.6b", 16, 8, 128, 1024)
TESTS = Model("tests", 4, 2, 24, 48)  # the CPU tests' odd head size (BLOCK_D 32, half masked)

# ---- register budgets, one per kernel -------------------------------------------------------------------------
# Attention: a [16 x D] query, a [D x 64] K and [64 x D] V tile (bf16) and a [16 x D] fp32 accumulator per
# 4-warp block live in registers through the loop; at head_dim 128 that is ~160 registers, and spilling them
# (or halving BLOCK_N, which doubles the loop's rescales) costs more than the occupancy (2 blocks/SM of 4 warps at
# 168) that decode, one block per (sequence, KV head), rarely reaches anyway.
DECODE_REGISTERS = 192
PREFILL_REGISTERS = 192  # a [64 x D] query tile and accumulator over 8 warps: FlashAttention-2's register shape
MERGE_REGISTERS = 64
CACHE_WRITE_REGISTERS = 64
LORA_REGISTERS = 128
W4A16_REGISTERS = 128  # decode sizes (M <= 64): a GEMV streaming the int4 weight; occupancy hides its latency
W4A16_LARGE_M_REGISTERS = 192  # M = 256: a 128 x 64 fp32 accumulator over 8 warps (tensor-core reuse pays there)
FP8_GEMM_REGISTERS = 192  # a 128 x 128 fp32 accumulator over 8 warps at M = 256: the tensor-core GEMM's shape
LAB_ATTENTION_REGISTERS = 128  # labs 06 and 07: the notebooks' `decode_tiles` keep every target within it
LAB_LORA_REGISTERS = 128


def _kv_types(kv: str, dtype: torch.dtype, cap: int) -> tuple[str, dict, str]:
    """(cache pointer type, fp8 constexprs, note) for a `kv` cache on `cap`: an fp8 cache is passed as its fp8
    dtype where the GPU converts fp8 (sm_89 on), as its bytes elsewhere (kernels/triton/_common.fp8_storage)."""
    if KV[kv] is None:
        return f"*{TRITON_TYPES[dtype]}", dict(IS_FP8=False, FP8_BITS=0), ""
    name, bits, _ = KV[kv]
    if native_fp8((cap // 10, cap % 10)):
        return f"*{name}", dict(IS_FP8=True, FP8_BITS=0), "cvt"
    return "*u8", dict(IS_FP8=True, FP8_BITS=bits), "int"


SCALES = dict(k_scale="*fp32", v_scale="*fp32")  # the engine passes device scales (CUDA-graph safe)
PER_TENSOR = dict(K_SCALE_IS_PTR=True, V_SCALE_IS_PTR=True, K_SCALE_STRIDE=0, V_SCALE_STRIDE=0)
PER_HEAD = dict(K_SCALE_IS_PTR=True, V_SCALE_IS_PTR=True, K_SCALE_STRIDE=1, V_SCALE_STRIDE=1)


def _block_d(head_dim: int) -> int:
    import triton
    return max(16, triton.next_power_of_2(head_dim))


def decode(model: Model, dtype: torch.dtype, kv: str, splits: int, cap: int, block_size: int = 16,
           scales: dict = PER_TENSOR) -> Launch:
    import triton

    from kernels.triton import decode_attention
    cache, fp8, note = _kv_types(kv, dtype, cap)
    dt = TRITON_TYPES[dtype]
    cfg = decode_attention._config(block_size, dtype, (cap // 10, cap % 10), fp8["FP8_BITS"] > 0)
    group = model.num_heads // model.num_kv_heads
    types = dict(q_ptr=f"*{dt}", k_cache_ptr=cache, v_cache_ptr=cache, block_tables_ptr="*i32",
                 seq_lens_ptr="*i32", out_ptr="*fp32" if splits > 1 else f"*{dt}",
                 lse_ptr="*fp32" if splits > 1 else f"*{dt}", scale_log2="fp32", **SCALES)
    return Launch(decode_attention._decode_kernel, types,
                  dict(BLOCK_SIZE=block_size, GROUP=group, BLOCK_G=max(16, triton.next_power_of_2(group)),
                       BLOCK_D=_block_d(model.head_dim), BLOCK_N=cfg["BLOCK_N"], NUM_SPLITS=splits,
                       UPCAST=dtype == torch.float32, **fp8, **scales),
                  cfg["num_warps"], cfg["num_stages"], frozenset({"stride_bt"}), note)


def merge(model: Model, dtype: torch.dtype, splits: int, cap: int) -> Launch:
    import triton

    from kernels.triton import decode_attention
    return Launch(decode_attention._merge_kernel,
                  dict(part_ptr="*fp32", lse_ptr="*fp32", out_ptr=f"*{TRITON_TYPES[dtype]}"),
                  dict(NUM_SPLITS=splits, BLOCK_S=triton.next_power_of_2(splits), BLOCK_D=_block_d(model.head_dim)),
                  4, 1, frozenset({"stride_ls", "stride_lh"}))


def prefill(model: Model, dtype: torch.dtype, kv: str, cap: int, block_size: int = 16,
            scales: dict = PER_TENSOR) -> Launch:
    from kernels.triton import prefill_attention
    cache, fp8, note = _kv_types(kv, dtype, cap)
    dt = TRITON_TYPES[dtype]
    group = model.num_heads // model.num_kv_heads
    cfg = prefill_attention._config(group, dtype, (cap // 10, cap % 10), fp8["IS_FP8"])
    types = dict(q_ptr=f"*{dt}", k_cache_ptr=cache, v_cache_ptr=cache, block_tables_ptr="*i32",
                 seq_lens_ptr="*i32", query_start_loc_ptr="*i32", out_ptr=f"*{dt}", scale_log2="fp32",
                 num_seqs="i32", **SCALES)
    return Launch(prefill_attention._prefill_kernel, types,
                  dict(BLOCK_SIZE=block_size, GROUP=group, BLOCK_Q=cfg["BLOCK_M"] // group, BLOCK_M=cfg["BLOCK_M"],
                       BLOCK_D=_block_d(model.head_dim), BLOCK_N=cfg["BLOCK_N"], UPCAST=dtype == torch.float32,
                       **fp8, **scales),
                  cfg["num_warps"], cfg["num_stages"], frozenset({"stride_bt", "num_seqs"}), note)


def cache_write(model: Model, dtype: torch.dtype, kv: str, cap: int, block_size: int = 16,
                scales: dict = PER_TENSOR) -> Launch:
    import triton

    from kernels.triton import cache
    cache_ptr, fp8, note = _kv_types(kv, dtype, cap)
    dt = TRITON_TYPES[dtype]
    return Launch(cache._reshape_and_cache_kernel,
                  dict(key_ptr=f"*{dt}", value_ptr=f"*{dt}", key_cache_ptr=cache_ptr, value_cache_ptr=cache_ptr,
                       slot_mapping_ptr="*i64", **SCALES),
                  dict(BLOCK_SIZE=block_size, BLOCK_H=triton.next_power_of_2(model.num_kv_heads),
                       BLOCK_D=triton.next_power_of_2(model.head_dim), QUANTIZE=KV[kv] is not None,
                       FP8_MAX=KV[kv][2] if KV[kv] else 0.0, FP8_BITS=fp8["FP8_BITS"], **scales),
                  1 if model.num_kv_heads * model.head_dim <= 256 else 4, 1, note=note)


def lora(kernel: str, dtype: torch.dtype, rank: int, cap: int) -> Launch:
    from kernels.triton import lora as lora_kernels
    dt = TRITON_TYPES[dtype]
    block_r = lora_kernels._block_r(rank)
    up = dtype == torch.float32
    fn = getattr(lora_kernels, f"_{kernel}_kernel")
    if kernel == "bgmv_shrink":
        types = dict(x_ptr=f"*{dt}", a_ptr=f"*{dt}", out_ptr="*fp32", row_slots_ptr="*i32")
        const = dict(BLOCK_K=lora_kernels.BLOCK_K, BLOCK_R=block_r)
    elif kernel == "bgmv_expand":
        types = dict(t_ptr="*fp32", b_ptr=f"*{dt}", y_ptr=f"*{dt}", scaling_ptr="*fp32", row_slots_ptr="*i32")
        const = dict(BLOCK_N=lora_kernels.BLOCK_N, BLOCK_R=block_r)
    elif kernel == "sgmv_shrink":
        block_k, _, warps = lora_kernels.sgmv_tiles((cap // 10, cap % 10))
        types = dict(x_ptr=f"*{dt}", a_ptr=f"*{dt}", out_ptr="*fp32", seg_starts_ptr="*i32", seg_slots_ptr="*i32")
        const = dict(BLOCK_M=lora_kernels.BLOCK_M, BLOCK_K=block_k, BLOCK_R=block_r, UPCAST=up)
        return Launch(fn, types, const, warps, 1)
    else:
        _, block_n, warps = lora_kernels.sgmv_tiles((cap // 10, cap % 10))
        types = dict(t_ptr="*fp32", b_ptr=f"*{dt}", y_ptr=f"*{dt}", scaling_ptr="*fp32", seg_starts_ptr="*i32",
                     seg_slots_ptr="*i32")
        const = dict(BLOCK_M=lora_kernels.BLOCK_M, BLOCK_N=block_n, BLOCK_R=block_r, UPCAST=up)
        return Launch(fn, types, const, warps, 1)
    return Launch(fn, types, const, 4, 1)


def w4a16(m: int, act: torch.dtype, perm: bool, float_zeros: bool, cap: int, n: int = QWEN3.hidden * 3,
          k: int = QWEN3.hidden, group_size: int = 128) -> Launch:
    from kernels.triton import w4a16 as w4a16_kernels
    from kernels.triton._gemm_tiles import gemm_tiles
    cfg, split, _ = gemm_tiles(m, n, k, w4a16_kernels.block_k_for(group_size), SMS[cap], False, max_block_n=64,
                               max_block_m=w4a16_kernels.max_block_m_for(cap // 10))
    dt = TRITON_TYPES[act]
    warps, stages = cfg.pop("num_warps"), cfg.pop("num_stages")
    return Launch(w4a16_kernels._w4a16_kernel,
                  dict(x_ptr=f"*{dt}", qweight_ptr="*i32", scales_ptr=f"*{dt}", zeros_ptr="*fp16" if float_zeros
                       else "*i32", perm_ptr="*i32", out_ptr="*fp32" if split > 1 else f"*{dt}"),
                  dict(cfg, GROUP_SIZE=group_size, HAS_PERM=perm, FLOAT_ZEROS=float_zeros, UPCAST=False),
                  warps, stages, note=f"split {split}" if split > 1 else "")


def fp8_gemm(m: int, per_token: bool, cap: int, n: int = QWEN3.hidden * 3, k: int = QWEN3.hidden) -> Launch | str:
    from kernels.triton import fp8_gemm as fp8_gemm_kernels
    from kernels.triton._gemm_tiles import gemm_tiles
    if reason := fp8_gemm_kernels.fp8_gemm_refusal((cap // 10, cap % 10)):
        return reason
    cfg, split, _ = gemm_tiles(m, n, k, 128, SMS[cap], False)
    warps, stages = cfg.pop("num_warps"), cfg.pop("num_stages")
    return Launch(fp8_gemm_kernels._fp8_gemm_kernel,
                  dict(a_ptr="*fp8e4nv", w_ptr="*fp8e4nv", a_scale_ptr="*fp32", w_scale_ptr="*fp32",
                       bias_ptr="*bf16", out_ptr="*fp32" if split > 1 else "*bf16"),
                  dict(cfg, A_PER_TOKEN=per_token, W_PER_CHANNEL=per_token, HAS_BIAS=per_token, UPCAST=False),
                  warps, stages, note=f"split {split}" if split > 1 else "")


# SMs of a typical GPU per target (the GEMMs' split-K count depends on it): T4, A100, A10G, L4, H100, B200, 5090
SMS = {75: 40, 80: 108, 86: 72, 89: 58, 90: 132, 100: 148, 120: 170}


def engine_cases() -> list[Case]:
    """The engine's launches, sampled so a cold run stays in minutes: each kernel x each dtype path x each cache
    format x split/unsplit appears on at least one model, the heavier shape (qwen3's head_dim 128) carries most."""
    bf16, fp16, fp32 = torch.bfloat16, torch.float16, torch.float32
    out = []
    for model, decodes, prefills, writes in (
            (SMOLLM2, ((fp32, "auto", 1), (bf16, "auto", 1), (bf16, "auto", 8), (bf16, "fp8_e4m3", 1),
                       (bf16, "fp8_e5m2", 8)),
             ((fp32, "auto"), (bf16, "auto"), (bf16, "fp8_e4m3")),
             ((bf16, "auto"), (bf16, "fp8_e4m3"), (bf16, "fp8_e5m2"))),
            (QWEN3, ((fp32, "auto", 1), (fp32, "auto", 8), (bf16, "auto", 1), (bf16, "auto", 8), (fp16, "auto", 1),
                     (bf16, "fp8_e4m3", 1), (bf16, "fp8_e4m3", 8), (fp32, "fp8_e4m3", 1), (bf16, "fp8_e5m2", 1)),
             ((fp32, "auto"), (bf16, "auto"), (bf16, "fp8_e4m3"), (bf16, "fp8_e5m2")),
             ((fp32, "fp8_e4m3"), (bf16, "auto"), (bf16, "fp8_e4m3"), (bf16, "fp8_e5m2")))):
        for dtype, kv, splits in decodes:
            out.append(Case(f"decode {model.name} {TRITON_TYPES[dtype]} kv={kv} splits={splits}", DECODE_REGISTERS,
                            partial(decode, model, dtype, kv, splits)))
        for dtype, kv in prefills:
            out.append(Case(f"prefill {model.name} {TRITON_TYPES[dtype]} kv={kv}", PREFILL_REGISTERS,
                            partial(prefill, model, dtype, kv)))
        for dtype, kv in writes:
            out.append(Case(f"cache_write {model.name} {TRITON_TYPES[dtype]} kv={kv}", CACHE_WRITE_REGISTERS,
                            partial(cache_write, model, dtype, kv)))
    out += [Case("merge qwen3-0.6b bf16 splits=8", MERGE_REGISTERS, partial(merge, QWEN3, bf16, 8)),
            Case("merge smollm2 fp32 splits=8", MERGE_REGISTERS, partial(merge, SMOLLM2, fp32, 8))]
    tests = f"{TESTS.name} fp16 kv=fp8_e4m3 per-head scales block=8"
    out += [Case(f"decode {tests} splits=4", DECODE_REGISTERS,
                 partial(decode, TESTS, fp16, "fp8_e4m3", 4, block_size=8, scales=PER_HEAD)),
            Case(f"prefill {tests}", PREFILL_REGISTERS,
                 partial(prefill, TESTS, fp16, "fp8_e4m3", block_size=8, scales=PER_HEAD)),
            Case(f"cache_write {tests}", CACHE_WRITE_REGISTERS,
                 partial(cache_write, TESTS, fp16, "fp8_e4m3", block_size=8, scales=PER_HEAD))]
    for kernel in ("bgmv_shrink", "bgmv_expand", "sgmv_shrink", "sgmv_expand"):
        for dtype, rank in ((fp32, 16), (bf16, 16), (bf16, 64)):
            out.append(Case(f"lora {kernel} {TRITON_TYPES[dtype]} rank={rank}", LORA_REGISTERS,
                            partial(lora, kernel, dtype, rank)))
    for m, act, perm, float_zeros in ((1, bf16, False, False), (1, fp16, True, False), (1, bf16, False, True),
                                      (16, bf16, False, False), (256, bf16, False, False)):
        out.append(Case(f"w4a16 M={m} {TRITON_TYPES[act]}{' act-order' if perm else ''}"
                        f"{' gguf-zeros' if float_zeros else ''}",
                        W4A16_REGISTERS if m <= 64 else W4A16_LARGE_M_REGISTERS,
                        partial(w4a16, m, act, perm, float_zeros)))
    for m, per_token in ((1, False), (256, True)):
        out.append(Case(f"fp8_gemm M={m} {'per-token' if per_token else 'per-tensor'}", FP8_GEMM_REGISTERS,
                        partial(fp8_gemm, m, per_token)))
    return out


# ---- the labs' learner kernels --------------------------------------------------------------------------------
LAB_NOTEBOOKS = {"06": "06_paged_attention_kernel", "07": "07_flash_decoding", "09": "09_multi_lora",
                 "18": "18_flash_attention"}


@lru_cache(maxsize=None)
def load_lab(lab: str, labs_dir: Path | None = None):
    """The lab's notebook as a module (grader.loader: its solution and setup cells), compiled kernels: the
    setup cell switches the interpreter on where there is no GPU, so that switch is held off here."""
    from triton import knobs

    from grader.loader import load_notebook
    folder = LAB_NOTEBOOKS[lab]
    path = (labs_dir or ROOT / "solutions") / folder / f"{folder}.ipynb"
    before = os.environ.get("TRITON_INTERPRET")
    try:
        with knobs.runtime.scope():
            knobs.runtime.interpret = False
            return load_notebook(path)
    finally:
        if before is None:
            os.environ.pop("TRITON_INTERPRET", None)


def lab_attention(lab: str, labs_dir: Path | None, model: Model, dtype: torch.dtype, cap: int) -> Launch:
    """Labs 06 and 07's decode kernels as their launchers run them on a GPU of `cap`: the notebook's own
    `decode_tiles` (64-token tiles over 4 warps in fp16/bf16, 16 on sm_75; fp32: 8 warps, 16 KiB K tiles)."""
    import triton
    nb = load_lab(lab, labs_dir)
    dt = TRITON_TYPES[dtype]
    group = model.num_heads // model.num_kv_heads
    tiles = nb.decode_tiles(dtype, model.head_dim, (cap // 10, cap % 10))
    const = dict(BLOCK_SIZE=16, GROUP=group, BLOCK_G=max(16, triton.next_power_of_2(group)),
                 BLOCK_D=_block_d(model.head_dim), UPCAST=dtype == torch.float32, BLOCK_N=tiles["BLOCK_N"])
    types = dict(q_ptr=f"*{dt}", k_cache_ptr=f"*{dt}", v_cache_ptr=f"*{dt}", block_tables_ptr="*i32",
                 seq_lens_ptr="*i32")
    if lab == "06":
        fn, types = nb.paged_decode_kernel, dict(types, out_ptr=f"*{dt}", scale="fp32")
    else:
        fn, types = nb.split_decode_kernel, dict(types, part_ptr="*fp32", lse_ptr="*fp32", scale_log2="fp32")
        const.update(NUM_SPLITS=8)
    return Launch(fn, types, const, tiles["num_warps"], tiles["num_stages"], frozenset({"stride_bt"}),
                  f"N={tiles['BLOCK_N']} w={tiles['num_warps']}")


def lab_lora(labs_dir: Path | None, dtype: torch.dtype, cap: int) -> Launch:
    """Lab 09's BGMV shrink as its solution launches it (BLOCK_K 32, the whole rank 16 in one tile, 4 warps)."""
    nb = load_lab("09", labs_dir)
    dt = TRITON_TYPES[dtype]
    return Launch(nb.bgmv_shrink_kernel, dict(x_ptr=f"*{dt}", a_ptr=f"*{dt}", out_ptr="*fp32",
                                              row_slots_ptr="*i32"), dict(BLOCK_K=32, BLOCK_R=16), 4, 1)


def lab_flash_attention(labs_dir: Path | None, model: Model, dtype: torch.dtype, cap: int) -> Launch:
    """Lab 18's FlashAttention-2 forward (one program per query tile, head and sequence) as its launcher runs it on
    a GPU of `cap`: the notebook's own `tile_config` (64 x 32 over 8 warps in fp16/bf16, 32 x 16 on sm_75, 16 x 16
    in fp32)."""
    nb = load_lab("18", labs_dir)
    dt = TRITON_TYPES[dtype]
    cfg = nb.tile_config(dtype, (cap // 10, cap % 10))
    types = dict(q_ptr=f"*{dt}", k_cache_ptr=f"*{dt}", v_cache_ptr=f"*{dt}", block_tables_ptr="*i32",
                 seq_lens_ptr="*i32", query_start_loc_ptr="*i32", out_ptr=f"*{dt}", scale_log2="fp32")
    const = dict(GROUP=model.num_heads // model.num_kv_heads, BLOCK_SIZE=16, BLOCK_M=cfg["BLOCK_M"],
                 BLOCK_N=cfg["BLOCK_N"], BLOCK_D=_block_d(model.head_dim), UPCAST=dtype == torch.float32)
    return Launch(nb.flash_attention_kernel, types, const, cfg["num_warps"], cfg["num_stages"],
                  frozenset({"stride_bt"}), f"{cfg['BLOCK_M']}x{cfg['BLOCK_N']}")


def lab_cases(labs_dir: Path | None = None) -> list[Case]:
    out = []
    for lab in ("06", "07"):
        for model, dtype in ((SMOLLM2, torch.bfloat16), (QWEN3, torch.bfloat16), (SMOLLM2, torch.float32),
                             (QWEN3, torch.float32)):
            out.append(Case(f"lab{lab} decode {model.name} {TRITON_TYPES[dtype]}", LAB_ATTENTION_REGISTERS,
                            partial(lab_attention, lab, labs_dir, model, dtype)))
    for dtype in (torch.float32, torch.bfloat16):
        out.append(Case(f"lab09 bgmv_shrink {TRITON_TYPES[dtype]} rank=16", LAB_LORA_REGISTERS,
                        partial(lab_lora, labs_dir, dtype)))
    for model, dtype in ((SMOLLM2, torch.bfloat16), (QWEN3, torch.bfloat16), (QWEN3, torch.float32)):
        out.append(Case(f"lab18 flash_attention {model.name} {TRITON_TYPES[dtype]}", PREFILL_REGISTERS,
                        partial(lab_flash_attention, labs_dir, model, dtype)))
    return out


# Open failures, each with its reason: (case-name prefix, capability) -> why. The check prints them and does
# not fail on them; it fails on any other problem, and on an entry here whose cell has become clean. None today.
OPEN: dict[tuple[str, int], str] = {}


def cases(labs_dir: Path | None = None) -> list[Case]:
    """Every case: the engine's kernels, then the labs', with their open failures."""
    out = []
    for case in engine_cases() + lab_cases(labs_dir):
        known = {cap: why for (prefix, cap), why in OPEN.items() if case.name.startswith(prefix)}
        out.append(Case(case.name, case.max_registers, case.launch, known) if known else case)
    return out
