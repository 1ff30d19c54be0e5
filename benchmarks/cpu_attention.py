"""The CPU attention kernels against the reference ops (`make bench-cpu-attention`).

    python -m benchmarks.cpu_attention [--repeats 30] [--threads 2]

`kernels.cpu.paged_attention_decode` and `kernels.cpu.paged_attention` (prefill) next to
`kernels.reference`'s ops on the same paged batches, at `make bench`'s shapes (small-llama: 8 query heads on
4 KV heads of 64) and SmolLM2's (9 on 3), fp32 and bf16, block size 16, physical blocks shuffled through a
cache larger than the last-level cache (a decode step's K/V come from memory, as in the engine, where each
layer's are read once a step). The two sides alternate call by call; medians. Decode reports K/V bytes read
per second; prefill the (query row, key) pairs per second. Each C result is checked against the reference
first (a wrong kernel is not timed). Each row prints the CPU time other processes took while it ran (/proc/stat
busy time minus this process's): quiet under a tenth of its wall time, loaded otherwise.
"""
from __future__ import annotations

import argparse
import time

import torch

from benchmarks.measure import alternate, busy_seconds, cpu_line
from kernels import cpu, reference

SHAPES = {"small-llama": (8, 4, 64), "smollm2": (9, 3, 64)}  # query heads, KV heads, head_dim
DECODE = ((1, 512), (34, 340), (64, 400))  # (sequences, context): batch 1, the workload's mean, its busiest
PREFILL = ((1, 64), (1, 264), (1, 512), (7, 264))  # (sequences, prompt): whole prompts, no cached prefix
BLOCK_SIZE, CACHE_MB = 16, 256


def _batch(gen: torch.Generator, dtype: torch.dtype, kv_heads: int, head_dim: int, lens: list[int]
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """K/V caches of CACHE_MB each and the sequences' tables, blocks drawn at random from the whole cache."""
    num_blocks = CACHE_MB * 2**20 // (BLOCK_SIZE * kv_heads * head_dim * torch.finfo(dtype).bits // 8)
    shape = (num_blocks, BLOCK_SIZE, kv_heads, head_dim)
    k, v = (torch.randn(shape, generator=gen).to(dtype) for _ in range(2))
    width = -(-max(lens) // BLOCK_SIZE)
    tables = torch.randperm(num_blocks, generator=gen)[:len(lens) * width].view(len(lens), width).to(torch.int32)
    return k, v, tables, torch.tensor(lens, dtype=torch.int32)


def _close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    err = float((got.double() - want.double()).abs().max())
    tol = 2.0**-7 if got.dtype == torch.bfloat16 else 1e-5  # one bf16 rounding; fp32 summation order
    if err > tol * max(1.0, float(want.abs().max())):
        raise AssertionError(f"{what}: the C kernel is {err:.3g} off the reference")


def bench_decode(gen: torch.Generator, dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int, seqs: int,
                 context: int, repeats: int) -> tuple[float, float, float]:
    """(C ms, reference ms, C GB/s of K/V)."""
    lens = torch.randint(context // 2, context * 3 // 2 + 1, (seqs,), generator=gen).tolist() if seqs > 1 else [context]
    k, v, tables, seq_lens = _batch(gen, dtype, kv_heads, head_dim, lens)
    q = torch.randn(seqs, heads, head_dim, generator=gen).to(dtype)
    args = (q, k, v, tables, seq_lens, head_dim ** -0.5)
    _close(cpu.paged_attention_decode(*args), reference.paged_attention_decode(*args), "decode")
    t = alternate({"c": lambda: cpu.paged_attention_decode(*args),
                   "ref": lambda: reference.paged_attention_decode(*args)}, repeats)
    kv_bytes = 2 * sum(lens) * kv_heads * head_dim * k.element_size()
    return t["c"] * 1e3, t["ref"] * 1e3, kv_bytes / t["c"] / 1e9


def bench_prefill(gen: torch.Generator, dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int, seqs: int,
                  prompt: int, repeats: int) -> tuple[float, float, float]:
    """(C ms, reference ms, C millions of (query row, key) pairs per second, every head)."""
    k, v, tables, seq_lens = _batch(gen, dtype, kv_heads, head_dim, [prompt] * seqs)
    q = torch.randn(seqs * prompt, heads, head_dim, generator=gen).to(dtype)
    starts = torch.arange(seqs + 1, dtype=torch.int32) * prompt
    args = (q, k, v, tables, seq_lens, starts, head_dim ** -0.5)
    _close(cpu.paged_attention(*args), reference.paged_attention(*args), "prefill")
    t = alternate({"c": lambda: cpu.paged_attention(*args), "ref": lambda: reference.paged_attention(*args)}, repeats)
    pairs = seqs * heads * prompt * (prompt + 1) / 2
    return t["c"] * 1e3, t["ref"] * 1e3, pairs / t["c"] / 1e6


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=30, help="timed calls per side (median)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--shapes", default="small-llama,smollm2", help=f"comma-separated, of {sorted(SHAPES)}")
    a = ap.parse_args(argv)
    if cpu.load() is None:
        raise SystemExit(f"the C kernels did not build: {cpu.load_error()}")
    if a.threads:
        torch.set_num_threads(a.threads)
    gen = torch.Generator().manual_seed(0)
    print(f"threads {torch.get_num_threads()}, block size {BLOCK_SIZE}, caches of {CACHE_MB} MB, {a.repeats} "
          "alternating calls per side, medians")
    print(cpu_line())
    print("| op | model shape | dtype | batch | C ms | reference ms | C / reference | C rate | other processes |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name in a.shapes.split(","):
        heads, kv_heads, head_dim = SHAPES[name]
        for dtype in (torch.float32, torch.bfloat16):
            dt = str(dtype).removeprefix("torch.")
            cases = [("decode", bench_decode, seqs, n, "GB/s of K/V", 1) for seqs, n in DECODE]
            cases += [("prefill", bench_prefill, seqs, n, "M pairs/s", 0) for seqs, n in PREFILL]
            for op, bench, seqs, n, unit, digits in cases:
                wall, (busy0, own0) = time.perf_counter(), busy_seconds()
                c, r, rate = bench(gen, dtype, heads, kv_heads, head_dim, seqs, n, a.repeats)
                busy1, own1 = busy_seconds()
                others, wall = (busy1 - busy0) - (own1 - own0), time.perf_counter() - wall
                print(f"| {op} | {name} | {dt} | {seqs} x {n} | {c:.3f} | {r:.3f} | {r / c:.2f}x faster | "
                      f"{rate:.{digits}f} {unit} | {others:.1f} CPU s: {'quiet' if others < 0.1 * wall else 'loaded'} |")


if __name__ == "__main__":
    main()
