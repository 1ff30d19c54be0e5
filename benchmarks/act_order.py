"""Act-order GPTQ on CPU (`make bench-act-order`): the K permutation against the per-column reference path.

An act-order checkpoint's g_idx puts its columns in groups that are not contiguous. Without the permutation the
layer dequantizes the whole weight through g_idx on every call and runs bf16 `F.linear` (the engine before
this change); with it (packed.py) the layer is stored with K in `argsort(g_idx)` order, holds torch's int4
kernel layout, and each call gathers x's columns (`index_select`) and runs `_weight_int4pack_mm_for_cpu`.
SmolLM2-135M's four projection shapes (q|k|v, o, gate|up, down; group 32 as its GGUF), bf16, M = 1, 16, 64,
one thread; both layers are built by the engine's own loader from the same checkpoint tensors, so the only
difference is the path. The two alternate within each repetition; medians; the other processes' CPU time over
the run is printed (label the round quiet only when it is near zero).
"""
from __future__ import annotations

import argparse
import statistics
import time
from unittest import mock

import torch

from benchmarks.measure import busy_seconds, cpu_line
from engine_core.config import QuantizationConfig
from engine_core.models.linear import Linear
from engine_core.models.quantization import PackedLinearMethod, packed
from engine_core.models.quantization.rtn import quantize_groupwise

SHAPES = {"q|k|v": (960, 576), "o": (576, 576), "gate|up": (3072, 576), "down": (576, 1536)}  # (N, K)
BATCHES = (1, 16, 64)
GROUP = 32


def act_order_layers(n: int, k: int, seed: int = 0) -> tuple[Linear, Linear]:
    """(permuted, per-column) bf16 layers of one random act-order checkpoint `[n, k]`."""
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(k, generator=g)
    q_p, scales, zeros = quantize_groupwise(torch.randn(n, k, generator=g)[:, perm], 4, GROUP)
    q = torch.empty_like(q_p)
    q[:, perm] = q_p
    g_idx = torch.empty(k, dtype=torch.int32)
    g_idx[perm] = torch.arange(k, dtype=torch.int32) // GROUP
    quant = QuantizationConfig("gptq", 4, GROUP, desc_act=True)
    tensors = (q, scales.half().float(), zeros, g_idx)
    fast = Linear(None, None, PackedLinearMethod(quant, tensors, torch.bfloat16))
    with mock.patch.object(packed, "act_order_permutation", lambda *_: None):  # the engine before the permutation
        slow = Linear(None, None, PackedLinearMethod(quant, tensors, torch.bfloat16))
    assert fast.perm is not None and fast.weight_int4pack is not None and slow.g_idx is not None
    return fast, slow


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=15, help="timed calls per path and shape (median)")
    args = parser.parse_args(argv)
    if args.reps < 1:
        parser.error(f"--reps must be >= 1, got {args.reps}")
    torch.set_num_threads(1)
    busy0, own0 = busy_seconds()
    wall0 = time.perf_counter()
    print(cpu_line())
    print(f"act-order GPTQ, bf16, group {GROUP}, one thread, median of {args.reps} (ms per call)")
    print(f"{'projection':10} {'N x K':>11} {'M':>4} {'per-column':>11} {'permuted':>9} {'speedup':>8} {'rel. diff':>10}")
    for name, (n, k) in SHAPES.items():
        fast, slow = act_order_layers(n, k)
        for m in BATCHES:
            x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).bfloat16()
            y = slow(x).float()
            diff = float((fast(x).float() - y).abs().max() / y.abs().max())  # bf16 rounding: a few 2^-8
            times = {"fast": [], "slow": []}
            for _ in range(args.reps):
                for key, layer in (("fast", fast), ("slow", slow)):
                    t0 = time.perf_counter()
                    layer(x)
                    times[key].append((time.perf_counter() - t0) * 1e3)
            f, s = statistics.median(times["fast"]), statistics.median(times["slow"])
            print(f"{name:10} {f'{n} x {k}':>11} {m:>4} {s:11.3f} {f:9.3f} {s / f:7.1f}x {diff:10.3g}")
    busy1, own1 = busy_seconds()
    others = (busy1 - busy0) - (own1 - own0)
    print(f"other processes' CPU time during the run: {others:.1f} s over {time.perf_counter() - wall0:.1f} s wall "
          f"({'quiet' if others < 0.1 * (time.perf_counter() - wall0) else 'loaded'})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
