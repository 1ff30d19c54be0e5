"""Kernel benchmark (`make bench-kernels`, `python -m benchmarks.kernels [--json OUT] [--acceptance]`): CUDA only.

Measures the device's ceilings first (device-to-device copy bandwidth, bf16 matmul TFLOP/s),
then each Triton kernel next to the PyTorch reference op on the same inputs: median time,
achieved GB/s (Q, K, V and O bytes as stored, each counted once) and its share of the copy
bandwidth. Decode runs at batch 1/16/64/256 x context 512/4k/32k (bf16, 32 query heads, 8 KV
heads, head_dim 128, block size 16, block tables shuffled like a long-running server's), with
num_splits=1, the engine's policy (`choose_num_splits`) and the best of a sweep, and once more
at batch 64 x 4k from an fp8 e4m3 cache; prefill at a few sizes. Three acceptance lines end the
report: bf16 decode at batch 64 x 4k reaches >= 70% of the copy bandwidth; the policy's split
count beats num_splits=1 at batch 1 x 32k; the fp8 cache, half the KV bytes, makes that batch
64 x 4k decode >= 1.5x faster. Exit status 1 if any fails. `--acceptance` times only the shapes
those lines need, without the whole table, prefill and the tile sweep (`make gpu-check`). `--quant` runs the
weight-quantized GEMMs instead (benchmarks/quant_kernels.py: W4A16 and fp8 against bf16, two more lines).
"""
from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from typing import Callable
from unittest import mock

import torch

from kernels import reference

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16
DTYPE = torch.bfloat16
BATCHES, CONTEXTS = (1, 16, 64, 256), (512, 4096, 32768)
SPLITS = (1, 2, 4, 8, 16, 32, 64)
PREFILL = ((1, 2048, 0), (4, 2048, 0), (1, 8192, 0), (16, 512, 0), (4, 512, 3584))  # (seqs, q_len, cached prefix)
ACCEPT_BANDWIDTH_SHARE = 0.70
# fp8 halves the KV bytes (Q and O stay bf16): ~2x if both run at the same share of the copy bandwidth;
# 1.5x means fp8 reaches at least 3/4 of bf16's share.
ACCEPT_FP8_SPEEDUP = 1.5
FP8 = torch.float8_e4m3fn
# Decode tile configs tried on the acceptance shapes, to retune decode_attention._config() from one run.
SWEEP = [dict(BLOCK_N=n, num_warps=w, num_stages=st)
         for n, w, st in itertools.product((32, 64, 128), (2, 4, 8), (2, 3, 4))]


@dataclass
class Row:
    kernel: str
    shape: str
    num_splits: int | None
    heuristic_splits: int | None  # choose_num_splits' pick for this shape (decode only)
    triton_us: float
    torch_us: float | None  # None: the reference would not fit in memory
    gbytes: float
    tflop: float
    kv_cache: str = "bf16"

    @property
    def gbps(self) -> float:
        return self.gbytes / (self.triton_us * 1e-6)


class Timer:
    """Median of `repeats` single calls timed with CUDA events, after `warmup` calls; L2 is
    flushed (a 256 MiB write) before every timed call so small problems are not served from cache."""

    def __init__(self, repeats: int, warmup: int = 3) -> None:
        self.repeats, self.warmup = repeats, warmup
        self.flush = torch.empty(256 * 2**20, dtype=torch.uint8, device="cuda")

    def __call__(self, fn: Callable[[], object]) -> float:
        for _ in range(self.warmup):
            fn()
        times = []
        for _ in range(self.repeats):
            self.flush.zero_()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e3)  # us
        return statistics.median(times)


def copy_bandwidth_gbps(timer: Timer) -> float:
    """A 1 GiB device-to-device copy: bytes read + written over the median time."""
    src = torch.empty(2**30, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    us = timer(lambda: dst.copy_(src))
    return 2 * src.numel() / (us * 1e-6) / 1e9


def matmul_tflops(timer: Timer) -> float:
    a = torch.randn(8192, 8192, dtype=DTYPE, device="cuda")
    b = torch.randn(8192, 8192, dtype=DTYPE, device="cuda")
    return 2 * 8192**3 / (timer(lambda: a @ b) * 1e-6) / 1e12


def _paged_cache(num_seqs: int, seq_len: int, kv_dtype: torch.dtype = DTYPE
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """K/V caches holding exactly these sequences, physical blocks in shuffled order; an fp8 cache
    holds the codes of N(0, 1) values (scale 1: they fit e4m3 as they are)."""
    blocks_per_seq = -(-seq_len // BLOCK_SIZE)
    num_blocks = num_seqs * blocks_per_seq
    shape = (num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    k = torch.empty(shape, dtype=DTYPE, device="cuda").normal_().to(kv_dtype)
    v = torch.empty(shape, dtype=DTYPE, device="cuda").normal_().to(kv_dtype)
    tables = torch.randperm(num_blocks, device="cuda").view(num_seqs, blocks_per_seq).to(torch.int32)
    return k, v, tables


def _time_reference(timer: Timer, fn: Callable[[], object], elements: int) -> float | None:
    """Time a reference op, or None where it would not fit: it gathers K and V to padded fp32
    copies and SDPA's GQA path may expand them per query head (~48 bytes per cached element)."""
    free, _ = torch.cuda.mem_get_info()
    if 48 * elements > 0.6 * free:
        return None
    try:
        return timer(fn)
    except torch.cuda.OutOfMemoryError:
        torch.cuda.empty_cache()
        return None


def bench_decode(timer: Timer, batch: int, context: int, kv_dtype: torch.dtype = DTYPE,
                 splits: tuple[int, ...] = SPLITS) -> list[Row]:
    """Decode at num_splits=1, at the engine's policy's pick and at the fastest of `splits`: one row
    each (fewer when they coincide). An fp8 cache is read with per-tensor scales, as the engine's default."""
    k, v, tables = _paged_cache(batch, context, kv_dtype)
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
    query = torch.randn(batch, NUM_HEADS, HEAD_DIM, dtype=DTYPE, device="cuda")
    scale = HEAD_DIM**-0.5
    k_scale = v_scale = torch.ones((), device="cuda") if kv_dtype == FP8 else 1.0
    gbytes = (2 * query.numel() * query.element_size() + 2 * k.numel() * k.element_size()) / 1e9
    tflop = 4 * batch * NUM_HEADS * context * HEAD_DIM / 1e12
    from kernels.split_policy import choose_num_splits
    from kernels.triton.decode_attention import paged_attention_decode as triton_decode

    def run(splits: int) -> Callable[[], object]:
        return lambda: triton_decode(query, k, v, tables, seq_lens, scale, k_scale, v_scale, num_splits=splits)

    torch_us = _time_reference(timer, lambda: reference.paged_attention_decode(query, k, v, tables, seq_lens, scale,
                                                                               k_scale, v_scale),
                               batch * context * NUM_KV_HEADS * HEAD_DIM)
    shape, kv = f"B={batch} ctx={context}", "bf16" if kv_dtype == DTYPE else "fp8_e4m3"
    pick = choose_num_splits(batch, NUM_KV_HEADS, context, torch.cuda.get_device_properties().multi_processor_count)
    tried = sorted({1, pick, *splits})
    times = {s: timer(run(s)) for s in tried if s == 1 or -(-context // 64) >= s}  # every split owns a tile
    best = min(times, key=times.get)
    return [Row("decode", shape, s, pick, times[s], torch_us, gbytes, tflop, kv) for s in sorted({1, pick, best})
            if s in times]


def sweep_decode(timer: Timer, batch: int, context: int, num_splits: int) -> list[tuple[dict, float]]:
    """(config, us) for every SWEEP config at one decode shape, fastest first; the shipped
    config is whatever `_config()` returns, the sweep only reports what else would do."""
    from kernels.triton import decode_attention
    k, v, tables = _paged_cache(batch, context)
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
    query = torch.randn(batch, NUM_HEADS, HEAD_DIM, dtype=DTYPE, device="cuda")
    results = []
    for cfg in SWEEP:
        with mock.patch.object(decode_attention, "_config", lambda *_, cfg=cfg: cfg):
            try:
                us = timer(lambda: decode_attention.paged_attention_decode(query, k, v, tables, seq_lens, 0.1,
                                                                           num_splits=num_splits))
            except Exception as e:  # e.g. out of shared memory: report and go on
                print(f"  sweep {cfg}: failed ({type(e).__name__})")
                continue
        results.append((cfg, us))
    return sorted(results, key=lambda r: r[1])


def report_sweeps(timer: Timer, rows: list[Row]) -> dict[str, list[tuple[dict, float]]]:
    """Sweep the decode configs on the two acceptance shapes, each at its best num_splits; print the top 5."""
    sweeps = {}
    for batch, context in ((64, 4096), (1, 32768)):
        shape = f"B={batch} ctx={context}"
        best = min(_decode_rows(rows, shape).values(), key=lambda r: r.triton_us)
        sweeps[f"{shape} splits={best.num_splits}"] = sweep = sweep_decode(timer, batch, context, best.num_splits)
        print(f"decode config sweep, {shape} num_splits={best.num_splits} (fastest 5 of {len(sweep)}):")
        for cfg, us in sweep[:5]:
            print(f"  {cfg}: {us:.1f} us, {best.gbytes / (us * 1e-6):.0f} GB/s")
    return sweeps


def bench_prefill(timer: Timer, num_seqs: int, q_len: int, prefix: int) -> Row:
    seq_len = prefix + q_len
    k, v, tables = _paged_cache(num_seqs, seq_len)
    seq_lens = torch.full((num_seqs,), seq_len, dtype=torch.int32, device="cuda")
    qsl = torch.arange(num_seqs + 1, dtype=torch.int32, device="cuda") * q_len
    query = torch.randn(num_seqs * q_len, NUM_HEADS, HEAD_DIM, dtype=DTYPE, device="cuda")
    scale = HEAD_DIM**-0.5
    elem = query.element_size()
    gbytes = (2 * query.numel() + 2 * num_seqs * seq_len * NUM_KV_HEADS * HEAD_DIM) * elem / 1e9
    keys_attended = num_seqs * (q_len * prefix + q_len * (q_len + 1) // 2)  # causal: row j sees prefix + j + 1 keys
    tflop = 4 * NUM_HEADS * HEAD_DIM * keys_attended / 1e12
    from kernels.triton.prefill_attention import paged_attention as triton_prefill
    triton_us = timer(lambda: triton_prefill(query, k, v, tables, seq_lens, qsl, scale))
    torch_us = _time_reference(timer, lambda: reference.paged_attention(query, k, v, tables, seq_lens, qsl, scale),
                               max(num_seqs * seq_len * NUM_KV_HEADS * HEAD_DIM, NUM_HEADS * q_len * seq_len))
    return Row("prefill", f"seqs={num_seqs} q={q_len} prefix={prefix}", None, None, triton_us, torch_us, gbytes, tflop)


def check_correctness() -> float:
    """Max |triton - reference| on a small decode (bf16 and fp8 caches) and prefill batch: timing a wrong
    kernel is pointless."""
    from kernels.triton.decode_attention import paged_attention_decode as triton_decode
    from kernels.triton.prefill_attention import paged_attention as triton_prefill
    k, v, tables = _paged_cache(4, 1000)
    seq_lens = torch.tensor([1000, 1, 517, 64], dtype=torch.int32, device="cuda")
    q = torch.randn(4, NUM_HEADS, HEAD_DIM, dtype=DTYPE, device="cuda")
    one = torch.ones((), device="cuda")
    err = max((triton_decode(q, kc, vc, tables, seq_lens, 0.1, one, one, num_splits=s).float()
               - reference.paged_attention_decode(q, kc, vc, tables, seq_lens, 0.1, one, one).float()).abs().max().item()
              for s in (1, 8) for kc, vc in ((k, v), (k.to(FP8), v.to(FP8))))
    qsl = torch.tensor([0, 100, 101, 150, 214], dtype=torch.int32, device="cuda")
    q = torch.randn(214, NUM_HEADS, HEAD_DIM, dtype=DTYPE, device="cuda")
    return max(err, (triton_prefill(q, k, v, tables, seq_lens, qsl, 0.1).float()
                     - reference.paged_attention(q, k, v, tables, seq_lens, qsl, 0.1).float()).abs().max().item())


def _print_table(rows: list[Row], copy_gbps: float) -> None:
    print(f"{'kernel':8} {'KV':8} {'shape':28} {'splits':>6} {'heur.':>5} {'triton us':>10} {'torch us':>10} "
          f"{'speedup':>8} {'GB/s':>8} {'% copy':>7} {'TFLOP/s':>8}")
    for r in rows:
        torch_us = f"{r.torch_us:10.1f}" if r.torch_us else f"{'n/a':>10}"
        speedup = f"{r.torch_us / r.triton_us:7.1f}x" if r.torch_us else f"{'':>8}"
        print(f"{r.kernel:8} {r.kv_cache:8} {r.shape:28} {str(r.num_splits or '-'):>6} {str(r.heuristic_splits or '-'):>5} "
              f"{r.triton_us:10.1f} {torch_us} {speedup} "
              f"{r.gbps:8.0f} {100 * r.gbps / copy_gbps:6.0f}% {r.tflop / (r.triton_us * 1e-6):8.1f}")


def _decode_rows(rows: list[Row], shape: str, kv_cache: str = "bf16") -> dict[int, Row]:
    """One shape's decode rows by num_splits."""
    return {r.num_splits: r for r in rows if r.kernel == "decode" and r.shape == shape and r.kv_cache == kv_cache}


def _at_policy(by_splits: dict[int, Row]) -> Row:
    """The row timed at the split policy's pick (every row of a shape records the same pick)."""
    return by_splits[next(iter(by_splits.values())).heuristic_splits]


def acceptance(rows: list[Row], copy_gbps: float) -> list[tuple[str, bool]]:
    """The GPU acceptance lines as (text, passed): bf16 decode bandwidth at B=64 x 4k, the split
    policy at B=1 x 32k, fp8 against bf16 at B=64 x 4k (each at the policy's split count)."""
    b64 = _decode_rows(rows, "B=64 ctx=4096")
    best = max(b64.values(), key=lambda r: r.gbps)
    share = best.gbps / copy_gbps
    b1 = _decode_rows(rows, "B=1 ctx=32768")
    pick, fastest = _at_policy(b1), min(b1.values(), key=lambda r: r.triton_us)
    bf16, fp8 = _at_policy(b64), _at_policy(_decode_rows(rows, "B=64 ctx=4096", "fp8_e4m3"))
    speedup = bf16.triton_us / fp8.triton_us
    return [
        (f"decode B=64 ctx=4k bf16 (num_splits={best.num_splits}): {best.gbps:.0f} GB/s = {100 * share:.0f}% of the "
         f"{copy_gbps:.0f} GB/s copy bandwidth (target >= {100 * ACCEPT_BANDWIDTH_SHARE:.0f}%)",
         share >= ACCEPT_BANDWIDTH_SHARE),
        (f"flash-decoding B=1 ctx=32k: the policy's num_splits={pick.num_splits} {pick.triton_us:.1f} us vs "
         f"num_splits=1 {b1[1].triton_us:.1f} us (fastest: num_splits={fastest.num_splits} {fastest.triton_us:.1f} us)",
         pick.num_splits != 1 and pick.triton_us < b1[1].triton_us),
        (f"fp8 KV decode B=64 ctx=4k (num_splits={fp8.num_splits}): {fp8.triton_us:.1f} us, {fp8.gbps:.0f} GB/s = "
         f"{100 * fp8.gbps / copy_gbps:.0f}% of copy, vs bf16 {bf16.triton_us:.1f} us = {100 * bf16.gbps / copy_gbps:.0f}%"
         f" of copy: {speedup:.2f}x the bf16 speed on {fp8.gbytes / bf16.gbytes:.2f}x the bytes (target >= "
         f"{ACCEPT_FP8_SPEEDUP:g}x)", speedup >= ACCEPT_FP8_SPEEDUP),
    ]


NO_CUDA = ("benchmarks.kernels needs a CUDA device (the Triton kernels are timed on the GPU); none is visible. "
           "On CPU the kernels are tested, not benchmarked: pytest tests/kernels")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", metavar="OUT", help="also write the results to this JSON file")
    parser.add_argument("--repeats", type=int, default=20, help="timed calls per measurement (median)")
    parser.add_argument("--acceptance", action="store_true",
                        help="time only the shapes the acceptance lines need (no full table, no prefill, no tile sweep)")
    parser.add_argument("--quant", action="store_true",
                        help="only the weight-quantized GEMMs (Triton W4A16 and fp8 vs cuBLAS bf16 at M = 1, 16, 64, 256) "
                             "and their acceptance lines (benchmarks/quant_kernels.py)")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error(f"--repeats must be >= 1, got {args.repeats}")
    if not torch.cuda.is_available():
        print(NO_CUDA, file=sys.stderr)
        return 2
    if args.quant:
        from benchmarks import quant_kernels
        print(f"{torch.cuda.get_device_name()}, {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC, torch {torch.__version__}")
        return quant_kernels.main(Timer(args.repeats))
    torch.manual_seed(0)
    timer = Timer(args.repeats)
    device = torch.cuda.get_device_name()
    copy_gbps, mm_tflops = copy_bandwidth_gbps(timer), matmul_tflops(timer)
    print(f"{device}, {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC, torch {torch.__version__}")
    print(f"copy bandwidth {copy_gbps:.0f} GB/s (read + write), bf16 matmul {mm_tflops:.0f} TFLOP/s")
    err = check_correctness()
    print(f"correctness: max |triton - reference| = {err:.3g} (bf16)")
    if not err < 0.05:  # bf16 outputs of size ~1: a few bf16 ulps, not a wrong kernel
        print("FAIL: the kernels disagree with the reference; not timing them")
        return 1
    rows: list[Row] = []
    shapes = ((64, 4096), (1, 32768)) if args.acceptance else itertools.product(BATCHES, CONTEXTS)
    for batch, context in shapes:
        rows += bench_decode(timer, batch, context)
        torch.cuda.empty_cache()
    rows += bench_decode(timer, 64, 4096, FP8, splits=())
    for num_seqs, q_len, prefix in () if args.acceptance else PREFILL:
        rows.append(bench_prefill(timer, num_seqs, q_len, prefix))
        torch.cuda.empty_cache()
    _print_table(rows, copy_gbps)
    sweeps = {} if args.acceptance else report_sweeps(timer, rows)
    checks = acceptance(rows, copy_gbps)
    for text, ok in checks:
        print(f"{'PASS' if ok else 'FAIL'}: {text}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=device, date=f"{datetime.now(timezone.utc):%Y-%m-%d}", torch=torch.__version__,
                           copy_gbps=copy_gbps, matmul_tflops=mm_tflops, max_abs_err=err,
                           rows=[asdict(r) | {"gbps": r.gbps} for r in rows],
                           sweeps={k: [dict(cfg, us=us) for cfg, us in v] for k, v in sweeps.items()},
                           acceptance=[dict(check=t, passed=ok) for t, ok in checks]), f, indent=1)
    return 0 if all(ok for _, ok in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
