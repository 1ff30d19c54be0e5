"""Where a step's time goes, and how close decode steps get to the machine's fp32 GEMM rate.

    python -m benchmarks.profile_steps --model small-llama --num-requests 64 --input-len 16:512 \
        --output-len 16:256 --seed 0

Runs `make bench`'s workload through the engine one step at a time. A window of decode-only
steps runs under torch.profiler; each op's self time on the main thread goes to a category
(GEMM, decode attention, KV write, ...), and what the ops do not cover is Python and dispatch.
Then, in the same process, the machine's GEMM rate is measured at the decode steps' row count:
one decode step's linear layers (the model's own modules, so the same oneDNN packed weights),
and F.linear (MKL) on the same shapes, best of several repeats. The engine's rate is the decode
steps' linear-layer FLOPs over their whole wall time.
"""
from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

from benchmarks.workload import add_requests, add_workload_args, workload_from_args
from engine_core.engine import LLMEngine
from engine_core.models.linear import Linear

CATEGORIES = {  # profiler event name -> category; anything else is "other ATen ops"
    "GEMM (linear layers)": ("mkldnn::_linear_pointwise", "aten::mm", "aten::addmm", "aten::bmm"),
    "decode attention": ("kernels.cpu.paged_attention_decode", "aten::_scaled_dot_product_flash_attention_for_cpu",
                         "aten::index_select"),
    "KV cache write": ("kernels.cpu.reshape_and_cache", "aten::_index_put_impl_"),
    "elementwise (norms, RoPE, SiLU, adds)": ("kernels.cpu.rms_norm", "kernels.cpu.silu_and_mul",
                                              "kernels.cpu.rotary_embedding", "aten::mul", "aten::add", "aten::sub",
                                              "aten::silu", "aten::rsqrt", "aten::pow", "aten::mean", "aten::cat",
                                              "aten::embedding", "aten::index", "aten::copy_"),
    "sampling": ("aten::argmax", "aten::softmax", "aten::_softmax", "aten::topk", "aten::multinomial"),
}


def decode_step_linears(engine: LLMEngine) -> list[Linear]:
    """The linear layers one decode step runs, in order (the LM head last)."""
    m = engine.runner.model
    per_layer = [[l.attn.qkv_proj, l.attn.o_proj, l.mlp.gate_up_proj, l.mlp.down_proj] for l in m.layers]
    return [lin for layer in per_layer for lin in layer] + [m.lm_head_proj]


def linear_flops(linears: list[Linear], rows: int) -> float:
    return sum(2.0 * rows * lin.weight.shape[0] * lin.weight.shape[1] for lin in linears)


@torch.inference_mode()
def gemm_rate(linears: list[Linear], rows: int, repeats: int = 20) -> dict[str, float]:
    """GFLOP/s of one decode step's linears at `rows` rows: the engine's modules and F.linear; best of `repeats`."""
    xs = [torch.randn(rows, lin.weight.shape[1]) for lin in linears]
    flops = linear_flops(linears, rows)
    out = {}
    for name, fn in (("oneDNN packed (engine)", lambda lin, x: lin(x)),
                     ("F.linear (MKL)", lambda lin, x: F.linear(x, lin.weight))):
        best = float("inf")
        for _ in range(repeats):
            t = time.perf_counter()
            for lin, x in zip(linears, xs):
                fn(lin, x)
            best = min(best, time.perf_counter() - t)
        out[name] = flops / best / 1e9
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_workload_args(ap)
    ap.add_argument("--profile-steps", type=int, default=20, help="decode-only steps under the profiler")
    a = ap.parse_args(argv)
    engine = LLMEngine.from_kwargs(a.model, max_num_seqs=a.max_num_seqs, max_num_batched_tokens=a.max_num_batched_tokens,
                                   dtype="float32")
    add_requests(engine, workload_from_args(a, engine.vocab_size))
    steps: list[tuple[float, int, int]] = []  # (wall s, tokens, sequences)
    prof, events, profiled, profiled_wall, profiled_rows = None, None, 0, 0.0, 0
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        if prof is None and profiled == 0 and steps and steps[-1][1] == steps[-1][2] > 1:  # decode-only from here
            prof = profile(activities=[ProfilerActivity.CPU])
            prof.__enter__()
        t = time.perf_counter()
        engine.step()
        dt = time.perf_counter() - t
        s = engine.last_step
        tokens = s.num_prefill_tokens + s.num_decode_tokens
        if prof is not None:
            profiled += 1
            profiled_wall += dt
            if profiled == a.profile_steps or tokens != s.num_seqs:
                prof.__exit__(None, None, None)
                events, prof = prof.key_averages(), None
                profiled_rows = s.num_seqs
            continue  # profiled steps run slower: keep them out of the rates
        steps.append((dt, tokens, s.num_seqs))
    total = time.perf_counter() - start
    if prof is not None:  # the run ended inside the window
        prof.__exit__(None, None, None)
        events, profiled_rows = prof.key_averages(), engine.last_step.num_seqs
    decode = [x for x in steps if x[1] == x[2]]
    print(f"{len(steps) + profiled} steps in {total:.2f} s; {len(decode)} decode-only steps (unprofiled) take "
          f"{sum(x[0] for x in decode):.2f} s, {100 * sum(x[0] for x in decode) / total:.0f}% of the run")
    if events is None:
        raise SystemExit("no decode-only step with more than one sequence to profile: use more requests")
    _print_split(events, profiled, profiled_wall, profiled_rows)
    linears = decode_step_linears(engine)
    rows = int(statistics.median(x[2] for x in decode))
    engine_rate = sum(linear_flops(linears, x[2]) for x in decode) / sum(x[0] for x in decode) / 1e9
    rates = gemm_rate(linears, rows)
    best = max(rates.values())
    print(f"\nGEMM rate, one decode step's linear layers at {rows} rows (the decode steps' median), this process:")
    for name, r in rates.items():
        print(f"  {name}: {r:.1f} GFLOP/s")
    big = gemm_rate(linears, 2048, repeats=3)
    print("  at 2048 rows (prefill chunks): " + ", ".join(f"{k} {v:.1f}" for k, v in big.items()) + " GFLOP/s")
    print(f"engine in decode-only steps: {engine_rate:.1f} GFLOP/s of linear-layer work over their wall time = "
          f"{100 * engine_rate / best:.0f}% of the machine's best rate at {rows} rows")
    print(f"load average {open('/proc/loadavg').read().split()[0]}")


def _print_split(events, steps: int, wall: float, rows: int) -> None:
    cat_of = {name: cat for cat, names in CATEGORIES.items() for name in names}
    times: dict[str, float] = defaultdict(float)
    calls = 0
    for e in events:
        times[cat_of.get(e.key, "other ATen ops")] += e.self_cpu_time_total / 1e6
        calls += e.count
    times["Python and dispatch (outside ops)"] = wall - sum(times.values())
    print(f"\nper-step split, {steps} decode-only steps of ~{rows} sequences under torch.profiler "
          f"({1e3 * wall / steps:.1f} ms per step, {calls / steps:.0f} ops per step):")
    print("| category | ms per step | share |\n|---|---|---|")
    for cat, t in sorted(times.items(), key=lambda kv: -kv[1]):
        print(f"| {cat} | {1e3 * t / steps:.2f} | {100 * t / wall:.0f}% |")


if __name__ == "__main__":
    main()
