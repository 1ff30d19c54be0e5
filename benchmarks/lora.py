"""Multi-LoRA throughput (S-LoRA's experiment, small): one workload served by the base model
alone, by the engine with 1 / 4 / 16 / 64 distinct adapters unmerged and batched (Zipf
popularity), and by merging each adapter into the weights and serving its requests one adapter
at a time (merge and unmerge included); plus adapter load times, disk -> host and host -> slot.

    python -m benchmarks.lora                      # CPU, small-llama (make bench-lora)
    python -m benchmarks.lora --device cuda --model qwen3-0.6b-shape --num-requests 256 \
        --input-len 64:512 --output-len 64:256     # GPU (make bench-lora-gpu)

Every side gets the same prompts, output lengths (greedy, ignore_eos) and adapter assignment;
output tokens/s = the sum of requested output lengths over wall time, with each side's ratio to
the base model by wall time and by this process's CPU time (steadier on a shared machine, with
one thread); `--repeats` takes medians. The unmerged rows use
max_loras = the number of adapters (capped by --max-loras), all adapters preloaded into the host
cache (`add_lora`), so the table measures serving, not disk reads; load times are measured apart.
"""
from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from functools import partial
from typing import Callable

import torch

from benchmarks.workload import Workload, add_requests, add_workload_args, workload_from_args
from engine_core.engine import LLMEngine
from engine_core.lora.adapter import LoRAAdapter, load_adapter, merge_adapter
from engine_core.lora.presets import adapter_path
from engine_core.lora.request import LoRARequest
from engine_core.models.config import ModelConfig
from engine_core.presets import resolve_model


def zipf_assignment(num_requests: int, num_adapters: int, alpha: float, seed: int) -> list[int]:
    """Adapter index of each request: P(k) proportional to 1 / (k + 1)^alpha (S-LoRA's power law)."""
    rng = random.Random(seed)
    return rng.choices(range(num_adapters), weights=[1 / (k + 1) ** alpha for k in range(num_adapters)], k=num_requests)


def serve(engine: LLMEngine, w: Workload, loras: list[LoRARequest | None], tag: str) -> tuple[float, float]:
    """Queue every request at t=0, step until done; (wall, this process's CPU) seconds."""
    sync = torch.cuda.synchronize if engine.config.device.type == "cuda" else (lambda: None)
    sync()
    start, cpu = time.perf_counter(), time.process_time()
    add_requests(engine, w, tag, loras)
    while engine.has_unfinished_requests():
        engine.step()
    sync()
    return time.perf_counter() - start, time.process_time() - cpu


def serve_merged(engine: LLMEngine, w: Workload, assignment: list[int],
                 adapters: list[LoRAAdapter]) -> tuple[float, float]:
    """Each adapter in turn: merge it, serve its requests as one batch, unmerge. (wall, CPU) seconds."""
    model = engine.runner.model
    saved = [p.detach().clone() for p in model.parameters()]
    start, cpu = time.perf_counter(), time.process_time()
    for k in sorted(set(assignment)):
        rows = [i for i, a in enumerate(assignment) if a == k]
        merge_adapter(model, adapters[k])
        serve(engine, Workload([w.prompts[i] for i in rows], [w.output_lens[i] for i in rows]), [None] * len(rows),
              f"merged{k}")
        with torch.no_grad():
            for p, s in zip(model.parameters(), saved):
                p.copy_(s)  # unmerge exactly (W - delta would drift by rounding)
    if engine.config.device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start, time.process_time() - cpu


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_workload_args(ap, num_requests=32, input_len="8:64", output_len="8:32", timing=True)
    ap.add_argument("--adapter", default="r8-attn", help="adapter preset (engine_core.lora.presets); seeds 0..N-1")
    ap.add_argument("--num-adapters", default="1,4,16,64")
    ap.add_argument("--zipf-alpha", type=float, default=1.0)
    ap.add_argument("--max-loras", type=int, default=64, help="cap on GPU slots (max_loras = min(adapters, this))")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    a = ap.parse_args(argv)
    if a.device == "cuda" and not torch.cuda.is_available():
        print("skipped: --device cuda but this machine has no CUDA device (run it where a GPU is lent)")
        return []
    if a.threads:
        torch.set_num_threads(a.threads)
    counts = [int(n) for n in a.num_adapters.split(",")]
    vocab_size = ModelConfig.load(resolve_model(a.model)).args.vocab_size
    w = workload_from_args(a, vocab_size)
    # KV blocks for the whole workload at once, sized explicitly: several engines share the device
    blocks = sum(-(-(len(p) + n) // 16) for p, n in zip(w.prompts, w.output_lens)) + 64
    common = dict(device=a.device, max_num_seqs=a.max_num_seqs, max_num_batched_tokens=a.max_num_batched_tokens,
                  block_size=16, num_gpu_blocks=blocks)
    base = LLMEngine.from_kwargs(a.model, **common)
    folders = [str(adapter_path(a.model, a.adapter, seed)) for seed in range(max(counts))]
    requests = [LoRARequest(f"{a.adapter}-s{k}", k + 1, f) for k, f in enumerate(folders)]
    serve(base, w, [None] * len(w.prompts), "warm")  # untimed: first-use costs (allocator, kernels) out
    print(f"model {a.model} on {a.device}, adapter {a.adapter}, {a.num_requests} requests, input {a.input_len}, "
          f"output {a.output_len} ({w.num_output_tokens} output tokens), Zipf alpha {a.zipf_alpha}, "
          f"threads {torch.get_num_threads()}", flush=True)
    tokens = w.num_output_tokens
    base_s = _median(a.repeats, lambda: serve(base, w, [None] * len(w.prompts), "base"))
    rows = [dict(adapters=0, base=base_s)]
    print(f"base model alone: {_rate(tokens, base_s)}", flush=True)
    adapters: list[LoRAAdapter] = []
    disk_ms = []
    for r in requests:
        t0 = time.perf_counter()
        adapters.append(load_adapter(r, base.model_config.args, 64, base.config.dtype))
        disk_ms.append((time.perf_counter() - t0) * 1e3)
    slot_ms = 0.0
    for n in counts:
        assignment = zipf_assignment(len(w.prompts), n, a.zipf_alpha, a.seed)
        engine = LLMEngine.from_kwargs(a.model, enable_lora=True, max_loras=min(n, a.max_loras), max_cpu_loras=n,
                                       max_lora_rank=max(ad.rank for ad in adapters), **common)
        for r in requests[:n]:
            engine.add_lora(r)
        serve(engine, w, [requests[k] for k in assignment], "warm")
        unmerged_s = _median(a.repeats, partial(serve, engine, w, [requests[k] for k in assignment], f"lora{n}"))
        merged_s = _median(a.repeats, partial(serve_merged, base, w, assignment, adapters))
        rows.append(dict(adapters=n, distinct=len(set(assignment)), unmerged=unmerged_s, merged=merged_s))
        print(f"{n:3d} adapters ({len(set(assignment))} used): unmerged {_rate(tokens, unmerged_s)}; "
              f"merged one at a time {_rate(tokens, merged_s)}", flush=True)
        slot_ms = _slot_load_ms(engine, adapters[: min(8, n)])
        del engine  # free its device memory before the next one
    print(_markdown(rows, tokens, statistics.median(disk_ms), slot_ms, adapters[0]))
    return rows


def _median(repeats: int, run: Callable[[], tuple[float, float]]) -> tuple[float, float]:
    """Medians of wall and CPU seconds over `repeats` runs."""
    times = [run() for _ in range(repeats)]
    return statistics.median(t[0] for t in times), statistics.median(t[1] for t in times)


def _rate(tokens: int, seconds: tuple[float, float]) -> str:
    return f"{tokens / seconds[0]:8.1f} tok/s (CPU time {seconds[1]:6.2f} s)"


def _slot_load_ms(engine: LLMEngine, adapters: list[LoRAAdapter]) -> float:
    """Median time to copy one adapter from the host cache into a GPU slot (every layer's stacks)."""
    times = []
    for ad in adapters:
        if engine.config.device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        engine.runner.lora.load_slot(0, ad)
        if engine.config.device.type == "cuda":
            torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def _markdown(rows: list[dict], tokens: int, disk_ms: float, slot_ms: float, adapter: LoRAAdapter) -> str:
    """The table: output tok/s by wall time, and each side's ratio to the base model by wall time and,
    as a cross-check on a shared machine, by this process's CPU time."""
    wall, cpu = rows[0]["base"]
    lines = ["| adapters (used) | unmerged, batched: tok/s | vs base (CPU-time ratio) "
             "| merged, one adapter at a time: tok/s | vs base (CPU-time ratio) |",
             "|---|---|---|---|---|",
             f"| base model only | {tokens / wall:.1f} | 1.00 | | |"]
    for r in rows[1:]:
        cells = [f"{tokens / r[k][0]:.1f} | {wall / r[k][0]:.2f} ({cpu / r[k][1]:.2f})" for k in ("unmerged", "merged")]
        lines.append(f"| {r['adapters']} ({r['distinct']}) | {cells[0]} | {cells[1]} |")
    lines.append(f"\nadapter load ({adapter.nbytes / 2**20:.2f} MiB, rank {adapter.rank}, "
                 f"{', '.join(adapter.target_modules)}): disk -> host {disk_ms:.1f} ms, host -> slot {slot_ms:.2f} ms "
                 f"(medians)")
    return "\n".join(lines)


if __name__ == "__main__":
    main(sys.argv[1:])
