"""Offline throughput: the same random workload through the engine and through Hugging Face
`generate`, in one process, same dtype, same threads.

    python -m benchmarks.throughput --model small-llama --num-requests 64 --input-len 16:512 \
        --output-len 16:256 --seed 0

The baseline is what a user without an engine would write (the strongest baseline a user could
reasonably write): prompts in arrival order, static batches of up to B, left padding, max_new_tokens = the batch's longest
output, each output cut to its own length; every B in --hf-batch-sizes is tried and the best
reported. Both sides count output tokens/s the same way: the sum of requested output lengths
over wall time (and, as a cross-check on a shared machine, over this process's CPU time).
With --repeats, the sides alternate and medians are reported. Greedy decoding with ignore_eos on both sides, so the token agreement printed
at the end doubles as a correctness check (left padding can flip near-ties, so it may be < 100%).
"""
from __future__ import annotations

import argparse
import statistics
import time
from typing import Any, Callable, TypeVar

import torch

from benchmarks.workload import (Workload, add_workload_args, run_engine, token_agreement, warm_up_workload,
                                 workload_from_args)
from engine_core.engine import LLMEngine
from engine_core.presets import resolve_model

T = TypeVar("T")


def timed(fn: Callable[..., T], *args: Any) -> tuple[float, float, T]:
    """(wall seconds, this process's CPU seconds, result). CPU time is the cross-check on a shared
    machine: other processes stretch wall time, much less the CPU time this one consumes."""
    wall, cpu = time.perf_counter(), time.process_time()
    result = fn(*args)
    return time.perf_counter() - wall, time.process_time() - cpu, result


@torch.inference_mode()
def run_hf(model: Any, w: Workload, batch_size: int, pad_id: int) -> list[list[int]]:
    """Static left-padded batches of `batch_size` in arrival order; each output cut to its length."""
    outputs: list[list[int]] = []
    for b in range(0, len(w.prompts), batch_size):
        prompts, lens = w.prompts[b:b + batch_size], w.output_lens[b:b + batch_size]
        width = max(len(p) for p in prompts)
        ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        new = max(lens)
        seqs = model.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                              pad_token_id=pad_id)
        outputs += [seqs[i, width:width + n].tolist() for i, n in enumerate(lens)]
    return outputs


def load_hf(model: str, dtype: torch.dtype, warm_up: Workload) -> tuple[Any, int]:
    """The Hugging Face model of a preset or folder, in `dtype`, run once on `warm_up`; (model, pad id)."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(resolve_model(model), dtype=dtype).eval()
    pad = hf.config.pad_token_id if hf.config.pad_token_id is not None else 0
    run_hf(hf, warm_up, 4, pad)
    return hf, pad


def main(argv: list[str] | None = None) -> dict[str, float]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_workload_args(ap, timing=True)  # both sides run with --threads; with --repeats they alternate
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--hf-batch-sizes", default="8,16,32,64", help="comma-separated; empty: skip Hugging Face")
    a = ap.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)  # this benchmark process only
    engine = LLMEngine.from_kwargs(a.model, max_num_seqs=a.max_num_seqs,
                                   max_num_batched_tokens=a.max_num_batched_tokens, dtype=a.dtype)
    w, warm_up = workload_from_args(a, engine.vocab_size), warm_up_workload(engine.vocab_size, a.seed)
    print(f"model {a.model}, {a.num_requests} requests, input {a.input_len}, output {a.output_len} "
          f"({w.num_output_tokens} output tokens), dtype {engine.config.dtype}, threads {torch.get_num_threads()}")
    sizes = [int(s) for s in a.hf_batch_sizes.split(",") if s.strip()]
    hf, pad = load_hf(a.model, engine.config.dtype, warm_up) if sizes else (None, 0)
    run_engine(engine, warm_up)
    runs: dict[str, list[tuple[float, float]]] = {}  # side -> [(wall, cpu)] per repeat
    for r in range(a.repeats):
        wall, cpu, engine_out = timed(run_engine, engine, w)
        runs.setdefault("engine", []).append((wall, cpu))
        print(f"[run {r + 1}] engine                {_rate(w, wall, cpu)}")
        for bs in sizes:
            wall, cpu, hf_out = timed(run_hf, hf, w, bs, pad)
            runs.setdefault(f"hf{bs}", []).append((wall, cpu))
            print(f"[run {r + 1}] HF generate, batch {bs:3d} {_rate(w, wall, cpu)}  "
                  f"(token agreement with the engine {token_agreement(engine_out, hf_out):.1%})")
    med = {side: (statistics.median(x for x, _ in v), statistics.median(c for _, c in v)) for side, v in runs.items()}
    results = {"engine_tok_s": w.num_output_tokens / med["engine"][0], "engine_s": med["engine"][0]}
    print(f"median of {a.repeats}: engine {_rate(w, *med['engine'])}")
    if sizes:
        best = min(sizes, key=lambda bs: med[f"hf{bs}"][0])
        results.update(hf_best_batch_size=best, hf_tok_s=w.num_output_tokens / med[f"hf{best}"][0],
                       ratio=med[f"hf{best}"][0] / med["engine"][0],
                       cpu_time_ratio=med[f"hf{best}"][1] / med["engine"][1])
        print(f"median of {a.repeats}: HF best, batch {best}: {_rate(w, *med[f'hf{best}'])}")
        print(f"engine / HF best: {results['ratio']:.2f}x output tok/s "
              f"(by CPU time: {results['cpu_time_ratio']:.2f}x)")
    return results


def _rate(w: Workload, wall: float, cpu: float) -> str:
    return (f"{wall:8.2f} s  {w.num_output_tokens / wall:8.1f} output tok/s  "
            f"(CPU time {cpu:7.2f} s: {w.num_output_tokens / cpu:7.1f} tok/s)")


if __name__ == "__main__":
    main()
