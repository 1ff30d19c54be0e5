"""`make bench`'s workload through the engine at 1 and 2 torch threads, alternating in one process.

    python -m benchmarks.thread_scaling --model small-llama --dtypes float32,bfloat16 --threads 1,2 --rounds 3

Each round runs the workload once per thread count, in an order that alternates from round to round.
Reported per dtype and thread count: median output tok/s, the process's CPU time over wall time (how many
cores the engine keeps busy; with libgomp's default wait policy an OpenMP thread spins a while between regions,
which counts here: run with OMP_WAIT_POLICY=PASSIVE to count only work, at the cost of a wake-up per region), the other
processes' CPU seconds during the runs (0 on a quiet machine), and the speedup of each thread count over the
first.
"""
from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict

import torch

from benchmarks.measure import busy_seconds, cpu_line
from benchmarks.workload import add_workload_args, run_engine, warm_up_workload, workload_from_args
from engine_core.engine import LLMEngine


def main(argv: list[str] | None = None) -> dict[tuple[str, int], float]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_workload_args(ap)
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args(argv)
    counts = [int(t) for t in a.threads.split(",")]
    rows: dict[tuple[str, int], float] = {}
    print(cpu_line())
    print("| dtype | threads | median output tok/s | CPU / wall | other processes' CPU s per run | speedup |\n"
          "|---|---|---|---|---|---|")
    for dtype in a.dtypes.split(","):
        engine = LLMEngine.from_kwargs(a.model, max_num_seqs=a.max_num_seqs,
                                       max_num_batched_tokens=a.max_num_batched_tokens, dtype=dtype)
        w = workload_from_args(a, engine.vocab_size)
        run_engine(engine, warm_up_workload(engine.vocab_size, a.seed))
        rates, cpu_wall, others = defaultdict(list), defaultdict(list), defaultdict(list)
        tokens = {}
        for r in range(a.rounds):
            for t in (counts if r % 2 == 0 else counts[::-1]):
                torch.set_num_threads(t)
                m0, s0 = busy_seconds()
                w0 = time.perf_counter()
                tokens[t] = run_engine(engine, w)
                wall = time.perf_counter() - w0
                m1, s1 = busy_seconds()
                rates[t].append(w.num_output_tokens / wall)
                cpu_wall[t].append((s1 - s0) / wall)
                others[t].append(max(0.0, (m1 - m0) - (s1 - s0)))
        if len({str(v) for v in tokens.values()}) != 1:
            print(f"note: {dtype} greedy tokens differ between thread counts (reduction order)")
        base = statistics.median(rates[counts[0]])
        for t in counts:
            rows[dtype, t] = statistics.median(rates[t])
            print(f"| {dtype} | {t} | {rows[dtype, t]:.1f} | {statistics.median(cpu_wall[t]):.2f} | "
                  f"{', '.join(f'{x:.0f}' for x in others[t])} | {rows[dtype, t] / base:.2f}x |", flush=True)
        del engine
    return rows


if __name__ == "__main__":
    main()
