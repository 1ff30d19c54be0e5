"""`make demo`: the engine on a built-in preset with a mixed workload.

Short and long prompts, short and long outputs, arriving at once into a deliberately small KV
cache, so the picture shows what continuous batching does: early steps are mostly prefill
chunks under the token budget, later ones mostly decodes; KV usage climbs, and when it hits
the ceiling the scheduler preempts. Prints a metrics table and writes a PNG (matplotlib Agg)
of batch composition and KV usage per step.
"""
from __future__ import annotations

import argparse
import math
import random
import statistics
from pathlib import Path

from engine_core.engine import LLMEngine
from engine_core.request import RequestOutput, SamplingParams


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100) of a non-empty list."""
    s = sorted(values)
    return s[min(len(s) - 1, max(0, math.ceil(q / 100 * len(s)) - 1))]


def mixed_workload(n: int, vocab_size: int, seed: int) -> list[tuple[list[int], SamplingParams]]:
    """A quarter long prompts with short answers (summaries), the rest short prompts with long answers (chat)."""
    rng = random.Random(seed)
    work = []
    for i in range(n):
        long_prompt = i % 4 == 0
        plen = rng.randint(200, 600) if long_prompt else rng.randint(4, 40)
        olen = rng.randint(4, 16) if long_prompt else rng.randint(32, 128)
        prompt = [rng.randrange(3, vocab_size) for _ in range(plen)]
        work.append((prompt, SamplingParams(max_tokens=olen, temperature=0.8, top_p=0.95, seed=i, ignore_eos=True)))
    return work


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="engine demo: metrics table and a plot")
    ap.add_argument("--model", default="tiny-llama")
    ap.add_argument("--num-requests", type=int, default=48)
    ap.add_argument("--num-gpu-blocks", type=int, default=160, help="small on purpose: shows preemption")
    ap.add_argument("--max-num-batched-tokens", type=int, default=512)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="build/engine_demo.png")
    a = ap.parse_args(argv)
    engine = LLMEngine.from_kwargs(a.model, num_gpu_blocks=a.num_gpu_blocks,
                                   max_num_batched_tokens=a.max_num_batched_tokens, seed=a.seed)
    for i, (prompt, params) in enumerate(mixed_workload(a.num_requests, engine.vocab_size, a.seed)):
        engine.add_request(f"req-{i}", prompt, params)
    steps, finished = [], []
    while engine.has_unfinished_requests():
        finished += [o for o in engine.step() if o.finished]
        steps.append(engine.last_step)
    print_table(engine, finished, steps)
    plot(steps, engine.config.max_num_batched_tokens, Path(a.out))
    print(f"plot written to {a.out}")


def print_table(engine: LLMEngine, finished: list[RequestOutput], steps: list) -> None:
    wall = sum(s.duration_s for s in steps)
    out_tokens = sum(len(o.outputs[0].token_ids) for o in finished)
    ttft = [o.metrics.ttft * 1e3 for o in finished]
    tpot = [t * 1e3 for o in finished if (t := o.metrics.mean_tpot(len(o.outputs[0].token_ids))) is not None]
    usage = [s.kv_cache_usage for s in steps]
    stats = engine.stats()
    rows = [
        ("requests", f"{len(finished)}"),
        ("steps", f"{len(steps)}"),
        ("output throughput", f"{out_tokens / wall:.1f} tok/s"),
        ("total throughput", f"{(out_tokens + stats['num_prefill_tokens']) / wall:.1f} tok/s (prefill + output)"),
        ("TTFT p50 / p90 / p99", " / ".join(f"{percentile(ttft, q):.1f}" for q in (50, 90, 99)) + " ms"),
        ("TPOT p50 / p90 / p99", " / ".join(f"{percentile(tpot, q):.2f}" for q in (50, 90, 99)) + " ms"),
        ("KV usage mean / peak", f"{statistics.mean(usage):.0%} / {max(usage):.0%} of "
                                 f"{engine.scheduler.kv_cache_manager.num_gpu_blocks} blocks"),
        ("preemptions (recompute / swap)", f"{stats['num_preemptions_recompute']} / {stats['num_preemptions_swap']}"),
    ]
    width = max(len(k) for k, _ in rows)
    print(f"engine demo: {engine.config.engine.model}, block_size {engine.config.engine.block_size}, "
          f"max_num_batched_tokens {engine.config.max_num_batched_tokens}")
    for k, v in rows:
        print(f"  {k:<{width}}  {v}")


def plot(steps: list, budget: int, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x = range(len(steps))
    prefill = [s.num_prefill_tokens for s in steps]
    decode = [s.num_decode_tokens for s in steps]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(10, 6), sharex=True)
    top.bar(x, prefill, width=1.0, label="prefill tokens", color="tab:orange")
    top.bar(x, decode, width=1.0, bottom=prefill, label="decode tokens", color="tab:blue")
    top.axhline(budget, color="gray", ls="--", lw=1, label="max_num_batched_tokens")
    top.set_ylim(0, budget * 1.15)
    top.set_ylabel("tokens in the step")
    top.legend(loc="upper right")
    top.set_title("batch composition per step (one flat batch mixes prefill chunks and decodes)")
    bottom.plot(x, [100 * s.kv_cache_usage for s in steps], color="tab:green")
    bottom.set_ylabel("KV cache usage (%)")
    bottom.set_xlabel("engine step")
    bottom.set_ylim(0, 105)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    main()
