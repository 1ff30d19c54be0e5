"""Where a quantized CPU GEMM should hand over to the bf16 GEMM (`python -m benchmarks.cpu_gemm_rows [--rows
1,2,4,...] [--threads 1] [--repeats 40]`): on SmolLM2-135M's projection shapes, per row count M, the bf16 weight's
own GEMMs (F.linear; oneDNN's inner product on the weight reordered once, the engine's bf16 path where AMX
runs it; the packed vdpbf16ps kernel `bf16_packed_gemm`, the engine's path on AVX512-BF16 without AMX) beside each
format's paths: fp8 weight-only (the packed AVX512-BF16 kernel
`fp8_w8a16_packed_gemm` the engine runs for bf16 where the CPU has it, the row-major fp32 C kernel `fp8_w8a16_gemm`,
the weight dequantized to bf16 then F.linear) and GGUF Q4_1 (llama.cpp's int8 arithmetic `ggml_mul_mat_a8` vs
dequantized to bf16 then F.linear). The smallest time of `--repeats` calls each, the paths in turn (a loaded
machine inflates medians, the minimum is what the code costs); the rows at which engine_core/models/quantization's
fp8.py and gguf_q4_1.py switch paths come from this table (docs/benchmarks.md).
"""
from __future__ import annotations

import argparse
import time
from typing import Callable

import torch
import torch.nn.functional as F

from benchmarks.measure import busy_seconds, cpu_line
from engine_core.models.quantization.unquantized import PACK_BATCH_HINT, onednn_bf16_available
from kernels.cpu.fp8_gemm import fp8_dequantize, fp8_pack, fp8_w8a16_gemm, fp8_w8a16_packed_gemm
from kernels.cpu.ggml_a8 import ggml_mul_mat_a8, pack_q4_1
from kernels.cpu.packed_gemm import bf16_pack, bf16_packed_gemm, packed_gemm_native

SHAPES = "3072x576,576x1536"  # SmolLM2: gate|up [2 x 1536, 576], down [576, 1536]


def fastest(fns: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    best = {name: float("inf") for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            t = time.perf_counter()
            fn()
            best[name] = min(best[name], time.perf_counter() - t)
    return best


def paths(n: int, k: int, m: int) -> dict[str, Callable[[], object]]:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(n, k, generator=g) / k**0.5
    wb, x = w.bfloat16(), torch.randn(m, k, generator=g).bfloat16()
    scale = torch.full((n,), float(w.abs().max()) / 448)
    q8 = (w / scale[:, None]).to(torch.float8_e4m3fn)
    fp8_packed = fp8_pack(q8)
    q4 = torch.randint(0, 16, (n, k), generator=g)
    d, mn = (torch.rand(n, k // 32, generator=g) * 0.01).half(), (-torch.rand(n, k // 32, generator=g) * 0.08).half()
    packed = pack_q4_1(q4, d, mn)
    q4_w = (q4.float() * d.float().repeat_interleave(32, 1) + mn.float().repeat_interleave(32, 1))
    onednn = torch.ops.mkldnn._reorder_linear_weight(wb, PACK_BATCH_HINT) if onednn_bf16_available() else None
    bf16_packed = bf16_pack(wb)
    return {"bf16": lambda: F.linear(x, wb),
            **({"bf16 oneDNN": lambda: torch.ops.mkldnn._linear_pointwise(x, onednn, None, "none", [], "")}
               if onednn is not None else {}),
            **({"bf16 packed": lambda: bf16_packed_gemm(x, bf16_packed, n, check=False)}
               if packed_gemm_native() else {}),  # AVX512-BF16 only
            **({"fp8 packed": lambda: fp8_w8a16_packed_gemm(x, fp8_packed, scale, check=False)}
               if packed_gemm_native() else {}),  # AVX512-BF16 only
            "fp8 kernel": lambda: fp8_w8a16_gemm(x, q8, scale, check=False),
            "fp8 deq+bf16": lambda: F.linear(x, fp8_dequantize(q8, scale, torch.bfloat16)),
            "q4_1 kernel": lambda: ggml_mul_mat_a8(x, packed),
            "q4_1 deq+bf16": lambda: F.linear(x, q4_w.bfloat16())}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", default="1,2,4,8,12,16,24,32,64")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=40)
    ap.add_argument("--shapes", default=SHAPES, help="weights NxK, comma-separated (small-llama: 1024x512,3072x512)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    busy0, own0 = busy_seconds()
    wall0 = time.perf_counter()
    lines = []
    for n, k in ([int(d) for d in shape.split("x")] for shape in args.shapes.split(",")):
        for m in (int(r) for r in args.rows.split(",")):
            t = fastest(paths(n, k, m), args.repeats)
            lines.append(f"| {n}x{k} | {m} | " + " | ".join(f"{1e6 * v:.0f}" for v in t.values()) + " |")
    busy1, own1 = busy_seconds()
    wall = time.perf_counter() - wall0
    other = max(0.0, (busy1 - busy0) - (own1 - own0))
    print(cpu_line())
    print(f"{args.threads} threads, fastest of {args.repeats} (us); other processes' CPU time {other:.1f} s over "
          f"{wall:.1f} s")
    print("| weight | M | " + " | ".join(paths(8, 32, 1)) + " |\n|---|---|" + "---|" * len(paths(8, 32, 1)))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
