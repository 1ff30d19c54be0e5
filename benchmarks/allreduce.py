"""`make bench-allreduce`: gloo all-reduce latency and bandwidth on loopback, fitted to lab 01's alpha-beta model.

Two processes (torch.multiprocessing spawn, gloo over 127.0.0.1, fp32) all-reduce messages from 4 B to 16 MiB
(`--backend nccl`: one process per GPU, the engine's CUDA backend, messages up to 256 MiB; `make gpu-check`'s line);
for each size rank 0 keeps the median of `--repeats` timed calls (after warm-up calls, each call ended by
the collective itself, both ranks entering together after a barrier). A least-squares line through
(2 (p - 1) / p x bytes, seconds) gives alpha (the intercept: the fixed cost of one all-reduce) and beta (the
slope: seconds per byte a rank sends; its inverse is the bus bandwidth). The last column is lab 01's model with
those two numbers, computed by `engine_core.capacity_planner.allreduce_seconds` itself (one layer of a model whose
hidden size is the message: that function counts two all-reduces per layer), so the table shows where one line
describes the collective and where it does not (small messages sit on alpha; on a shared 2-core machine the
points scatter). Loopback is no network: these alphas and betas are this machine's, not a NIC's.
On CUDA each timed call ends with `torch.cuda.synchronize()` (NCCL returns before the collective ends).
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from engine_core import capacity_planner, memory

DEFAULT_SIZES = tuple(4 * 4 ** k for k in range(12))  # 4 B .. 16 MiB
NCCL_SIZES = tuple(4 * 4 ** k for k in range(14))  # 4 B .. 256 MiB: NVLink needs big messages to show its rate


def fit_alpha_beta(world_size: int, sizes: list[int], seconds: list[float]) -> tuple[float, float]:
    """(alpha seconds, beta seconds per byte) of t = alpha + 2 (p - 1) / p x bytes x beta, least squares."""
    if len(sizes) != len(seconds) or len(sizes) < 2:
        raise ValueError(f"need at least two (size, seconds) points of equal count, got {len(sizes)} and {len(seconds)}")
    x = torch.tensor([2 * (world_size - 1) / world_size * b for b in sizes], dtype=torch.float64)
    y = torch.tensor(seconds, dtype=torch.float64)
    design = torch.stack([torch.ones_like(x), x], dim=1)
    alpha, beta = torch.linalg.lstsq(design, y[:, None]).solution[:, 0].tolist()
    return alpha, beta


def model_seconds(world_size: int, num_bytes: int, alpha: float, beta: float) -> float:
    """One fp32 all-reduce of `num_bytes` by lab 01's `allreduce_seconds` with this alpha and 1 / beta as the link."""
    link = dataclasses.replace(capacity_planner.GPUS["H100-80GB"], allreduce_latency_s=alpha, nvlink_bytes_per_s=1 / beta)
    spec = memory.ModelSpec(num_layers=1, hidden_size=max(1, num_bytes // 4), num_attention_heads=1, num_kv_heads=1,
                            head_dim=1, intermediate_size=1, vocab_size=1)
    return capacity_planner.allreduce_seconds(spec, torch.float32, 1, link, world_size) / 2  # two per layer


def _rank(rank: int, world_size: int, port: int, sizes: tuple[int, ...], repeats: int, warmup: int, queue,
          backend: str = "gloo") -> None:
    torch.set_num_threads(1)
    device = torch.device("cpu")
    if backend == "nccl":
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    medians = []
    for num_bytes in sizes:
        x = torch.ones(max(1, num_bytes // 4), dtype=torch.float32, device=device)
        for _ in range(warmup):
            dist.all_reduce(x)
        sync()
        times = []
        for _ in range(repeats):
            dist.barrier()
            sync()
            t0 = time.perf_counter()
            dist.all_reduce(x)
            sync()
            times.append(time.perf_counter() - t0)
        medians.append(statistics.median(times))
    if rank == 0:
        queue.put(medians)
    dist.barrier()
    dist.destroy_process_group()


def measure(world_size: int, sizes: tuple[int, ...], repeats: int, warmup: int, backend: str = "gloo") -> list[float]:
    """Rank 0's median seconds per size, from `world_size` spawned processes."""
    from engine_core.executor.multiproc_executor import free_port

    context = mp.get_context("spawn")
    queue = context.Queue()
    port = free_port()
    procs = [context.Process(target=_rank, args=(r, world_size, port, sizes, repeats, warmup, queue, backend))
             for r in range(world_size)]
    for p in procs:
        p.start()
    try:
        medians = queue.get(timeout=600)
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
                p.join()
    return medians


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--backend", choices=("gloo", "nccl"), default="gloo",
                        help="gloo: CPU processes on loopback; nccl: one process per CUDA device")
    parser.add_argument("--sizes", default=None, help="message bytes, comma-separated (default 4 B .. 16 MiB; "
                                                      "256 MiB with nccl)")
    parser.add_argument("--min-bandwidth-gbs", type=float, default=None,
                        help="exit 1 unless the fitted bus bandwidth reaches this (make gpu-check's acceptance)")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    args = parser.parse_args(argv)
    default = NCCL_SIZES if args.backend == "nccl" else DEFAULT_SIZES
    sizes = tuple(int(s) for s in args.sizes.split(",")) if args.sizes else default
    slots, unit = ((torch.cuda.device_count(), "GPU") if args.backend == "nccl" else (os.cpu_count() or 1, "core"))
    if args.backend == "nccl" and slots < 2:
        print(f"skipped: the NCCL all-reduce needs at least 2 CUDA devices, this machine has {slots}")
        return
    if args.world_size < 2 or args.world_size > slots:
        raise SystemExit(f"--world-size must be in 2..{slots} (one process per {unit}), got {args.world_size}")
    if len(sizes) < 2 or min(sizes) < 4 or args.repeats < 1 or args.warmup < 0:
        raise SystemExit("--sizes needs at least two sizes >= 4 bytes; --repeats >= 1; --warmup >= 0")
    medians = measure(args.world_size, sizes, args.repeats, args.warmup, args.backend)
    alpha, beta = fit_alpha_beta(args.world_size, list(sizes), medians)
    where = f"{args.world_size} GPUs" if args.backend == "nccl" else f"{args.world_size} processes on 127.0.0.1"
    print(f"{args.backend} all-reduce, {where}, fp32, median of {args.repeats} per size")
    print(f"{'bytes':>10} {'measured us':>12} {'alpha-beta us':>14}")
    for num_bytes, t in zip(sizes, medians):
        print(f"{num_bytes:>10} {1e6 * t:>12.1f} {1e6 * model_seconds(args.world_size, num_bytes, alpha, beta):>14.1f}")
    print(f"fit: alpha = {1e6 * alpha:.1f} us per all-reduce, bus bandwidth 1 / beta = {1 / beta / 1e9:.2f} GB/s "
          f"(lab 01's H100 NVLink figures: {1e6 * capacity_planner.GPUS['H100-80GB'].allreduce_latency_s:.0f} us, "
          f"{capacity_planner.GPUS['H100-80GB'].nvlink_bytes_per_s / 1e9:.0f} GB/s)")
    if args.min_bandwidth_gbs is not None:
        ok = 1 / beta / 1e9 >= args.min_bandwidth_gbs
        print(f"acceptance: bus bandwidth >= {args.min_bandwidth_gbs:g} GB/s: {'PASS' if ok else 'FAIL'}")
        if not ok:
            raise SystemExit(1)


if __name__ == "__main__":
    main()
