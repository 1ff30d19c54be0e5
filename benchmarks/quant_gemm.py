"""Speed vs batch of each weight scheme's CPU GEMM (`make quant-gemm`, `python -m benchmarks.quant_gemm
[--k 2048 --n 2048 --threads 2 --reps 25 --json OUT]`).

y = x @ W.T with x `[M, K]`, W `[N, K]`, M = 1 .. 256, for: fp32 and bf16 (`F.linear`), W8A8 (per-token int8
quantization of x, `torch._int_mm`, the fp32 scale epilogue: Int8LinearMethod's arithmetic), W8A16
(`aten._weight_int8pack_mm`, bf16 x, per-channel scales), W4A16 (`aten._weight_int4pack_mm_for_cpu`,
bf16 x, group 128 scale and zero) and Q4_1 A8 (the GGUF path's `kernels.cpu.ggml_a8.ggml_mul_mat_a8`: Q4_1
blocks of 32, bf16 x rounded to int8 per 32, integer dots). Each scheme holds enough distinct copies of its weight that one pass
over them is 4x the L3 (read from sysfs), and each call takes the next copy: every call reads its weight
from DRAM, as a model's layers do in a decode step. The schemes alternate within each repetition (a
drift in machine load hits all of them alike); the table shows medians. The other processes' CPU time
over the run (/proc/stat's busy time minus this process's) is printed: on a shared machine the numbers
are "loaded" when it is not near zero.

The roofline next to it: t(M) = max(weight bytes / BW, 2 M K N / P), BW from a streaming read of a
buffer 8x the L3, P each scheme's own compute rate at the largest M (where it is compute-bound). Its
crossover with fp32 and with bf16 (the M from which on the scheme is no faster) is printed beside the
measured one.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

from benchmarks.measure import busy_seconds, cpu_line, crossover, l3_bytes, stream_bandwidth
from kernels.cpu.ggml_a8 import ggml_a8_applies, ggml_mul_mat_a8, pack_q4_1

BATCHES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
GROUP = 128
Gemm = Callable[[torch.Tensor], torch.Tensor]


def schemes(k: int, n: int, copies: Callable[[int], int]) -> dict[str, tuple[int, Callable[[int], Gemm]]]:
    """name -> (weight bytes of one copy, make(m) -> a GEMM on x `[m, K]` cycling through its copies)."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(n, k, generator=g) * 0.02

    def cycling(weights: list, call: Callable[[torch.Tensor, object], torch.Tensor]) -> Callable[[torch.Tensor], torch.Tensor]:
        state = {"i": 0}

        def gemm(x: torch.Tensor) -> torch.Tensor:
            state["i"] = (state["i"] + 1) % len(weights)
            return call(x, weights[state["i"]])
        return gemm

    out: dict[str, tuple[int, Callable[[torch.Tensor], torch.Tensor]]] = {}
    for dtype, name in ((torch.float32, "fp32"), (torch.bfloat16, "bf16")):
        one = w.to(dtype)
        out[name] = (one.nbytes, cycling([one.clone() for _ in range(copies(one.nbytes))], lambda x, wc: F.linear(x, wc)))
    s_w = w.abs().amax(dim=1).clamp(min=1e-12) / 127
    q8 = torch.round(w / s_w[:, None]).clamp(-127, 127).to(torch.int8)
    w8a8 = [(q8.t().contiguous().clone(), s_w) for _ in range(copies(q8.nbytes))]

    def int8_mm(x: torch.Tensor, held: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        s_x = x.abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / 127
        qx = torch.round(x / s_x).clamp(-127, 127).to(torch.int8)
        return torch._int_mm(qx, held[0]).float() * s_x * held[1]
    out["int8 W8A8"] = (q8.nbytes + 4 * n, cycling(w8a8, int8_mm))
    s16 = s_w.bfloat16()
    out["W8A16"] = (q8.nbytes + 2 * n, cycling([(q8.clone(), s16) for _ in range(copies(q8.nbytes))],
                                             lambda x, h: torch.ops.aten._weight_int8pack_mm(x, h[0], h[1])))
    groups = w.reshape(n, k // GROUP, GROUP)
    lo, hi = groups.amin(-1).clamp(max=0), groups.amax(-1).clamp(min=0)
    scale = ((hi - lo) / 15).clamp(min=1e-12)
    zero = torch.round(-lo / scale)
    q4 = (torch.round(groups / scale[..., None]) + zero[..., None]).clamp(0, 15).reshape(n, k).to(torch.int32)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q4, 1)
    sz = torch.stack([scale.t(), ((8 - zero) * scale).t()], dim=-1).bfloat16().contiguous()
    bytes4 = packed.nbytes + sz.nbytes
    out["W4A16"] = (bytes4, cycling([(packed.clone(), sz) for _ in range(copies(bytes4))],
                                    lambda x, h: torch.ops.aten._weight_int4pack_mm_for_cpu(x, h[0], GROUP, h[1])))
    if ggml_a8_applies(torch.device("cpu"), torch.bfloat16):  # needs the C kernels
        blocks = w.reshape(n, k // 32, 32)
        m1 = blocks.amin(-1)
        d1 = ((blocks.amax(-1) - m1) / 15).clamp(min=1e-8).half()
        q41 = torch.round((blocks - m1.half().float()[..., None]) / d1.float()[..., None]).clamp(0, 15).reshape(n, k)
        one = pack_q4_1(q41, d1, m1.half())
        out["Q4_1 A8"] = (one.nbytes, cycling([pack_q4_1(q41, d1, m1.half()) for _ in range(copies(one.nbytes))],
                                              ggml_mul_mat_a8))
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--k", type=int, default=2048)
    ap.add_argument("--n", type=int, default=2048)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=25)
    ap.add_argument("--batches", default=",".join(map(str, BATCHES)))
    ap.add_argument("--json", help="write the medians and the roofline here")
    args = ap.parse_args(argv)
    if args.k % GROUP or args.n % 16:
        raise ValueError(f"--k must be a multiple of {GROUP} and --n of 16 (the int4 kernel's), got {args.k}, {args.n}")
    torch.set_num_threads(args.threads)
    batches = [int(b) for b in args.batches.split(",")]
    l3 = l3_bytes()
    made = schemes(args.k, args.n, lambda nbytes: max(2, -(-4 * l3 // nbytes)))
    bw = stream_bandwidth(l3)
    times: dict[str, dict[int, list[float]]] = {s: {m: [] for m in batches} for s in made}
    busy0, own0 = busy_seconds()
    wall0 = time.perf_counter()
    with torch.inference_mode():
        for m in batches:
            x32 = torch.randn(m, args.k)
            inputs = {s: x32 if s in ("fp32", "int8 W8A8") else x32.bfloat16() for s in made}
            for s, (_, gemm) in made.items():  # warm-up: the first call allocates
                gemm(inputs[s])
            for _ in range(args.reps):
                for s, (_, gemm) in made.items():
                    t = time.perf_counter()
                    gemm(inputs[s])
                    times[s][m].append(time.perf_counter() - t)
    wall = time.perf_counter() - wall0
    busy1, own1 = busy_seconds()
    other = max(0.0, (busy1 - busy0) - (own1 - own0))
    med = {s: {m: statistics.median(v) for m, v in per.items()} for s, per in times.items()}
    flops = {m: 2 * m * args.k * args.n for m in batches}
    peak = {s: flops[max(batches)] / med[s][max(batches)] for s in made}
    roof = {s: {m: max(made[s][0] / bw, flops[m] / peak[s]) for m in batches} for s in made}

    print(cpu_line())
    print(f"K = N = {args.k} x {args.n}, {args.threads} threads, {args.reps} reps (medians, ms); L3 {l3 / 2**20:.0f} MiB; "
          f"streaming read {bw / 1e9:.1f} GB/s; other processes' CPU time {other:.2f} s over {wall:.1f} s "
          f"({other / wall:.2f} CPUs busy besides this one{': loaded' if other / wall > 0.1 else ''})")
    print(f"{'M':>5} " + " ".join(f"{s:>11}" for s in made))
    for m in batches:
        print(f"{m:>5} " + " ".join(f"{1e3 * med[s][m]:>11.3f}" for s in made))
    print(f"{'':>5} " + " ".join(f"{'roofline':>11}" for _ in made))
    for m in batches:
        print(f"{m:>5} " + " ".join(f"{1e3 * roof[s][m]:>11.3f}" for s in made))
    print("weight MiB per copy: " + ", ".join(f"{s} {b / 2**20:.2f}" for s, (b, _) in made.items()))
    print("compute rate at the largest M (GFLOP/s): " + ", ".join(f"{s} {p / 1e9:.1f}" for s, p in peak.items()))
    cross: dict[str, dict] = {}
    first = min(batches)
    for base in ("fp32", "bf16"):  # bf16: the activations' dtype of the weight-only schemes
        for s in made:
            if s == base:
                continue
            c = {"measured": crossover(med[s], med[base]), "roofline": crossover(roof[s], roof[base])}
            cross[f"{s} vs {base}"] = c
            said = {how: "faster at the largest M" if m is None else f"no faster from M = {m} on"
                    for how, m in c.items()}
            print(f"{s} vs {base}: {said['measured']} (roofline: {said['roofline']}); at M = {first} "
                  f"{med[base][first] / med[s][first]:.2f}x (roofline {roof[base][first] / roof[s][first]:.2f}x)")
    result = {"k": args.k, "n": args.n, "threads": args.threads, "reps": args.reps, "l3_bytes": l3,
              "stream_bytes_per_s": bw, "other_cpu_s": other, "wall_s": wall, "median_s": med, "roofline_s": roof,
              "weight_bytes": {s: b for s, (b, _) in made.items()}, "crossover": cross}
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
