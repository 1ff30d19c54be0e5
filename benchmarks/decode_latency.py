"""Batch-1 decode latency: one greedy request, its decode steps timed one by one (ms/step, tok/s).

    python -m benchmarks.decode_latency --model smollm2-135m-instruct --dtype float32 --threads 2 \
        --input-len 40 --output-len 128 --repeats 3 [--profile]

What a learner chatting with the real model waits on per token. Each run records the CPU time the
rest of the machine used meanwhile (`/proc/stat`'s busy time minus this process's own), so a loaded
round is told from a quiet one: on a shared machine compare builds by alternating runs, not by
absolute numbers. `--profile`: one more run under torch.profiler, the top ops of a decode step by
self CPU time.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from benchmarks.measure import busy_seconds
from engine_core.engine import LLMEngine
from engine_core.request import SamplingParams

def run_once(engine: LLMEngine, prompt: list[int], output_len: int, rid: str) -> tuple[list[float], list[int]]:
    """Decode-step wall times (s) of one request (the prefill step excluded) and its tokens."""
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    engine.add_request(rid, prompt, params)
    times, tokens = [], []
    first = True
    while engine.has_unfinished_requests():
        t = time.perf_counter()
        outs = engine.step()
        dt = time.perf_counter() - t
        if not first:
            times.append(dt)
        first = False
        for o in outs:
            if o.finished:
                tokens = list(o.outputs[0].token_ids)
    return times, tokens


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--input-len", type=int, default=40)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--profile", action="store_true")
    a = ap.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    engine = LLMEngine.from_kwargs(a.model, dtype=a.dtype)
    prompt = [(7 + 31 * i) % (engine.vocab_size - 3) + 3 for i in range(a.input_len)]
    run_once(engine, prompt, 8, "warm-up")
    for r in range(a.repeats):
        m0, s0 = busy_seconds()
        w0 = time.perf_counter()
        times, tokens = run_once(engine, prompt, a.output_len, f"r{r}")
        wall = time.perf_counter() - w0
        m1, s1 = busy_seconds()
        med = statistics.median(times)
        print(f"run {r}: decode median {1e3 * med:.2f} ms/step ({1 / med:.1f} tok/s), mean "
              f"{1e3 * statistics.fmean(times):.2f} ms; wall {wall:.2f} s; this process CPU {s1 - s0:.2f} s; "
              f"other processes CPU {max(0.0, (m1 - m0) - (s1 - s0)):.2f} s; tokens[:8] {tokens[:8]}", flush=True)
    if a.profile:
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            times, _ = run_once(engine, prompt, 33, "profiled")
        steps = len(times)
        print(f"profiled: {steps} decode steps, median {1e3 * statistics.median(times):.2f} ms/step (profiler on)")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30))


if __name__ == "__main__":
    main()
