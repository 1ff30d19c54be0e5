"""Memory-pressure benchmark and cost-model numbers for docs/benchmarks_memory_pressure.md.

    python -m benchmarks.memory_pressure [--model small-llama] [--repeats 2]

Part 1 runs one workload four ways in one process (plenty of blocks, then too few with
preemption by recompute, swap, auto), alternating the order per repeat, and prints the best
wall time of each. Part 2 measures this machine's prefill FLOP/s and copy bandwidth and prints
memory.py's recompute-vs-swap costs and break-even points for the preset and two real models.
"""
from __future__ import annotations

import argparse
import random
import time

import torch

from engine_core import capacity_planner, memory
from engine_core.entrypoints.llm import LLM
from engine_core.models.loader import read_config
from engine_core.presets import resolve_model
from engine_core.request import SamplingParams

LLAMA3_8B = memory.ModelSpec(num_layers=32, hidden_size=4096, num_attention_heads=32, num_kv_heads=8, head_dim=128,
                             intermediate_size=14336, vocab_size=128256)
LLAMA2_70B = memory.ModelSpec(num_layers=80, hidden_size=8192, num_attention_heads=64, num_kv_heads=8, head_dim=128,
                              intermediate_size=28672, vocab_size=32000)


def workload(n: int, seed: int = 0) -> tuple[list[list[int]], list[SamplingParams]]:
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, 500) for _ in range(rng.randrange(32, 192))] for _ in range(n)]
    params = [SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True) for _ in prompts]
    return prompts, params


def run_pressure(model: str, repeats: int, num_requests: int, tight_blocks: int) -> None:
    prompts, params = workload(num_requests)
    configs = {"plenty": dict(num_gpu_blocks=4096), "recompute": dict(num_gpu_blocks=tight_blocks,
               preemption_mode="recompute"), "swap": dict(num_gpu_blocks=tight_blocks, preemption_mode="swap"),
               "auto": dict(num_gpu_blocks=tight_blocks, preemption_mode="auto")}
    common = dict(block_size=16, max_model_len=512, max_num_batched_tokens=512)
    LLM(model, **common, **configs["plenty"]).generate(prompts[:2], params[:2], use_tqdm=False)  # warm-up
    best: dict[str, float] = {}
    best_cpu: dict[str, float] = {}
    results = {}
    for r in range(repeats):
        order = list(configs) if r % 2 == 0 else list(reversed(configs))
        for k in order:
            llm = LLM(model, **common, **configs[k])
            t0, c0 = time.perf_counter(), time.process_time()
            outs = llm.generate(prompts, params, use_tqdm=False)
            dt, dc = time.perf_counter() - t0, time.process_time() - c0
            best[k] = min(best.get(k, float("inf")), dt)
            best_cpu[k] = min(best_cpu.get(k, float("inf")), dc)
            results[k] = ([o.outputs[0].token_ids for o in outs], llm.engine.stats())
    ref = results["plenty"][0]
    n_out = sum(len(t) for t in ref)
    print("CPU time is process time (all threads); the machine was shared, so wall time is noisy.")
    print(f"workload: {num_requests} requests, prompts 32-191 tokens, 64 output tokens each, block 16, "
          f"budget 512; tight = {tight_blocks} blocks ({tight_blocks * 16} tokens)")
    print("| run | best wall s | best CPU s | output tok/s (CPU time) | vs plenty (CPU time) | preempt recompute | preempt swap | blocks out/in "
          "| prefill tokens | same tokens |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for k in configs:
        toks, s = results[k]
        print(f"| {k} | {best[k]:.2f} | {best_cpu[k]:.2f} | {n_out / best_cpu[k]:.0f} | "
              f"{best_cpu['plenty'] / best_cpu[k]:.2f}x | "
              f"{s['num_preemptions_recompute']} | {s['num_preemptions_swap']} | {s['num_blocks_swapped_out']}/"
              f"{s['num_blocks_swapped_in']} | {s['num_prefill_tokens']} | {toks == ref} |")


def measure_cpu_rates(spec: memory.ModelSpec) -> tuple[float, float]:
    """Prefill FLOP/s of a real forward (LLM, one 256-token prompt, max_tokens 1) and copy B/s."""
    llm = LLM("small-llama", num_gpu_blocks=64, max_model_len=512)
    prompt = list(range(3, 259))
    sp = SamplingParams(max_tokens=1, temperature=0.0)
    llm.generate([prompt], sp, use_tqdm=False)
    times = []  # the least-disturbed of 5 runs (wall time)
    for _ in range(5):
        t0 = time.perf_counter()
        llm.generate([prompt], sp, use_tqdm=False)
        times.append(time.perf_counter() - t0)
    flops = memory.prefill_flops(spec, len(prompt)) / min(times)
    src = torch.randn(64 * 2**20 // 4)
    dst = torch.empty_like(src)
    dst.copy_(src)
    t0 = time.perf_counter()
    for _ in range(5):
        dst.copy_(src)
    bw = 5 * src.numel() * 4 / (time.perf_counter() - t0)
    return flops, bw


def crossover(spec: memory.ModelSpec, dtype: str, flops: float, bw: float, max_len: int = 1 << 20) -> int | None:
    """Smallest length at which swap is cheaper than recompute under memory.py's model, or None."""
    for n in range(1, max_len):
        if memory.swap_seconds(spec, n, dtype, bw) < memory.recompute_seconds(spec, n, flops):
            return n
    return None


def report_cost_model(spec_small: memory.ModelSpec) -> None:
    flops, bw = measure_cpu_rates(spec_small)
    print(f"this CPU: small-llama prefill {flops / 1e9:.1f} GFLOP/s (memory.DEFAULT_RATES['cpu']: "
          f"{memory.DEFAULT_RATES['cpu'][0] / 1e9:.0f}), copy {bw / 1e9:.1f} GB/s "
          f"(default {memory.DEFAULT_RATES['cpu'][1] / 1e9:.0f})")
    h100 = capacity_planner.GPUS["H100-80GB"]
    cases = [("small-llama fp32, this CPU (measured)", spec_small, "fp32", flops, bw),
             ("small-llama fp32, CPU defaults", spec_small, "fp32", *memory.DEFAULT_RATES["cpu"]),
             ("Llama-3-8B bf16, H100 PCIe Gen5", LLAMA3_8B, "bf16", *memory.DEFAULT_RATES["cuda"]),
             ("Llama-2-70B bf16, H100 PCIe Gen5", LLAMA2_70B, "bf16", *memory.DEFAULT_RATES["cuda"])]
    print(f"H100 rates: prefill {memory.DEFAULT_RATES['cuda'][0] / 1e12:.1f} TFLOP/s (50% of "
          f"{h100.bf16_flops / 1e12:.0f}), PCIe {h100.pcie_bytes_per_s / 1e9:.0f} GB/s one way")
    print("| case | KV B/token | recompute ms @1k | swap ms @1k | recompute/swap @1 | @1k | @8k "
          "| crossover length | break-even link GB/s @1k |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, spec, dtype, f, b in cases:
        kv = memory.kv_cache_bytes_per_token(spec, dtype)
        r = {n: memory.recompute_seconds(spec, n, f) / memory.swap_seconds(spec, n, dtype, b) for n in (1, 1024, 8192)}
        even_bw = 2 * 1024 * kv / memory.recompute_seconds(spec, 1024, f)
        n_x = crossover(spec, dtype, f, b)
        print(f"| {name} | {kv} | {memory.recompute_seconds(spec, 1024, f) * 1e3:.2f} | "
              f"{memory.swap_seconds(spec, 1024, dtype, b) * 1e3:.3f} | {r[1]:.1f} | {r[1024]:.1f} | {r[8192]:.1f} | "
              f"{'swap from 1 token' if n_x == 1 else n_x} | {even_bw / 1e9:.3g} |")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="small-llama")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--num-requests", type=int, default=16)
    ap.add_argument("--tight-blocks", type=int, default=32)
    ap.add_argument("--cost-model-only", action="store_true")
    args = ap.parse_args(argv)
    if not args.cost_model_only:
        run_pressure(args.model, args.repeats, args.num_requests, args.tight_blocks)
    report_cost_model(memory.ModelSpec.of(read_config(resolve_model("small-llama"))))


if __name__ == "__main__":
    main()
