"""The skinny GEMM against oneDNN's packed inner product at decode row counts (`make bench-skinny-gemm`).

    python -m benchmarks.skinny_gemm [--rows 1,2,3,4,8] [--repeats 15] [--threads 2]

One batch-1 decode step's linears of SmolLM2-135M (30 layers of QKV 960x576, O 576x576, gate|up 3072x576,
down 576x1536: 106 M weights, their own tensors as in the engine, so every step reads them from memory) and
its LM head (49152x576), random weights: `kernels.cpu.skinny_gemm` on the unpacked weights against
`torch.ops.mkldnn._linear_pointwise` on weights packed as `UnquantizedLinearMethod` packs them, fp32 and
bf16, at each row count. The two sides alternate pass by pass; medians; weight bytes read per second. Each
skinny result is checked against oneDNN's first (a wrong kernel is not timed). Each row prints the CPU time
other processes took while it ran (/proc/stat busy time minus this process's): quiet under a tenth of its wall
time, loaded otherwise. `SKINNY_MAX_ROWS` (kernels/cpu/skinny_gemm.py) is where the kernel stops winning.
"""
from __future__ import annotations

import argparse
import time

import torch

from benchmarks.measure import alternate, busy_seconds, cpu_line
from engine_core.models.quantization.unquantized import PACK_BATCH_HINT, onednn_available, onednn_bf16_available
from kernels import cpu
from kernels.cpu.skinny_gemm import SKINNY_MAX_ROWS, skinny_gemm

LAYER = ((960, 576), (576, 576), (3072, 576), (576, 1536))  # SmolLM2's (n, k) per layer
LAYERS, LM_HEAD = 30, (49152, 576)


def _weights(gen: torch.Generator, dtype: torch.dtype, layers: int) -> list[torch.Tensor]:
    shapes = [s for _ in range(layers) for s in LAYER] + [LM_HEAD]
    return [(torch.randn(n, k, generator=gen) / k**0.5).to(dtype) for n, k in shapes]


def bench(gen: torch.Generator, dtype: torch.dtype, rows: int, weights: list[torch.Tensor],
          packed: list[torch.Tensor], repeats: int) -> tuple[float, float]:
    """Median seconds of one pass over every weight: skinny, oneDNN."""
    xs = {w.shape[1]: torch.randn(rows, w.shape[1], generator=gen).to(dtype) for w in weights}
    for w, p in zip(weights[:4], packed[:4]):
        x = xs[w.shape[1]]
        want = torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], "").double()
        err = (skinny_gemm(x, w).double() - want).abs().max().item()
        bound = 2.0**-7 * (want.abs().max().item() + 1)
        assert err <= bound, f"skinny_gemm is {err:.3g} off oneDNN at {tuple(w.shape)}"
    t = alternate({
        "skinny": lambda: [skinny_gemm(xs[w.shape[1]], w) for w in weights],
        "onednn": lambda: [torch.ops.mkldnn._linear_pointwise(xs[w.shape[1]], p, None, "none", [], "")
                           for w, p in zip(weights, packed)]}, repeats)
    return t["skinny"], t["onednn"]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="1,2,3,4,8", help="comma-separated row counts")
    ap.add_argument("--repeats", type=int, default=15, help="timed passes per side (median)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--layers", type=int, default=LAYERS, help="decoder layers' weights (SmolLM2: 30)")
    a = ap.parse_args(argv)
    if cpu.load() is None:
        raise SystemExit(f"the C kernels did not build: {cpu.load_error()}")
    if not onednn_available():
        raise SystemExit("oneDNN is unavailable in this torch build: nothing to compare against")
    if a.threads:
        torch.set_num_threads(a.threads)
    gen = torch.Generator().manual_seed(0)
    print(f"threads {torch.get_num_threads()}, SmolLM2's linears ({a.layers} layers and the LM head), "
          f"{a.repeats} alternating passes per side, medians; SKINNY_MAX_ROWS "
          f"{ {str(d).removeprefix('torch.'): r for d, r in SKINNY_MAX_ROWS.items()} }")
    print(cpu_line())
    print("| dtype | rows | skinny ms | oneDNN ms | oneDNN / skinny | skinny GB/s | oneDNN GB/s | other processes |")
    print("|---|---|---|---|---|---|---|---|")
    for dtype in (torch.float32, torch.bfloat16):
        if dtype == torch.bfloat16 and not onednn_bf16_available():
            print("| bfloat16 | | | | oneDNN has no native bf16 here: skipped | | | |")
            continue
        weights = _weights(gen, dtype, a.layers)
        packed = [torch.ops.mkldnn._reorder_linear_weight(w, PACK_BATCH_HINT) for w in weights]
        nbytes = sum(w.nbytes for w in weights)
        for rows in map(int, a.rows.split(",")):
            wall, (busy0, own0) = time.perf_counter(), busy_seconds()
            s, o = bench(gen, dtype, rows, weights, packed, a.repeats)
            busy1, own1 = busy_seconds()
            others, wall = (busy1 - busy0) - (own1 - own0), time.perf_counter() - wall
            print(f"| {str(dtype).removeprefix('torch.')} | {rows} | {1e3 * s:.2f} | {1e3 * o:.2f} | {o / s:.2f}x | "
                  f"{nbytes / s / 1e9:.1f} | {nbytes / o / 1e9:.1f} | "
                  f"{others:.1f} CPU s: {'quiet' if others < 0.1 * wall else 'loaded'} |")


if __name__ == "__main__":
    main()
