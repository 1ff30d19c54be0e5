"""Batch-1 decode against the machine's floor: the bytes a step must read over the measured read bandwidth.

    python -m benchmarks.decode_floor --formats fp32,bf16,gguf,fp8 --threads 1,2 --rounds 3 --output-len 64

A batch-1 decode step multiplies one row by every weight: it is a read of the weights (as stored: fp32, bf16,
fp8 bytes, or the GGUF file's Q4_1 / Q8_0 blocks, scales included), the LM head and the K/V cache of the
context, so bytes / bandwidth is the least time a step can take on this machine. Per thread count, the formats'
engines (all loaded in this process) serve one greedy request each in turn, the order rotating from round to
round. Printed per format and thread count: the read bandwidth (a large fp32 `sum`, best of several, before and
after the rounds), the step's bytes (counted from the loaded model's parameter storage: `step_bytes`), the floor,
the median decode step (median over the rounds of each run's median), floor / step, and where a step's time goes
(each phase wrapped and timed by wall clock: the layers' GEMMs, the LM head, attention, norms and activation,
input preparation, sampling, and the rest: Python, module calls and the scheduler), with the CPU time other
processes took meanwhile (0 on a quiet machine) and the CPU's line.
"""
from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict
from typing import Any, Callable

import torch

from benchmarks.measure import busy_seconds, cpu_line
from benchmarks.step_overhead import decode_steps, read_bandwidth, step_bytes
from benchmarks.step_overhead import engine_kwargs as dense_or_gguf_kwargs
from engine_core.engine import LLMEngine
from engine_core.models.linear import Linear
from engine_core.request import SamplingParams

FORMATS = ("fp32", "bf16", "gguf", "fp8")


def engine_kwargs(fmt: str) -> dict[str, Any]:
    """The engine arguments of a format of FORMATS (fp8: per-tensor e4m3 weights, weight-only on CPU)."""
    if fmt == "fp8":
        return {"dtype": "bfloat16", "quantization": "fp8"}
    if fmt not in FORMATS:
        raise ValueError(f"--formats: each must be one of {FORMATS}, got {fmt!r}")
    return dense_or_gguf_kwargs(fmt)


def median_step_ms(engine: LLMEngine, prompt: list[int], output_len: int, rid: str) -> float:
    """The median decode step (prefill left out) of one greedy request, in ms."""
    return 1e3 * statistics.median(decode_steps(engine, prompt, output_len, rid)[0])


PHASES = ("GEMMs of the layers", "LM head (GEMM, fp32 logits)", "attention (RoPE, K/V write, decode)",
          "norms and activation", "input preparation", "sampling")
REST = "rest: Python, module calls, scheduler"


def phases(engine: LLMEngine, prompt: list[int], output_len: int) -> dict[str, float]:
    """Wall ms per decode step of each of PHASES (every call wrapped and timed; the wrapping makes the step a
    little slower) and of the whole step, and the rest: what the wrapped calls leave of the whole."""
    import kernels.cpu as kc
    import engine_core.worker.model_runner as mr
    spent: dict[str, float] = defaultdict(float)

    def timed(key: str, f: Callable[..., Any]) -> Callable[..., Any]:
        def g(*a: Any, **k: Any) -> Any:
            t = time.perf_counter()
            try:
                return f(*a, **k)
            finally:
                spent[key] += time.perf_counter() - t
        return g

    runner, model = engine.runner, engine.runner.model
    lins = [m for layer in model.layers for m in layer.modules() if isinstance(m, Linear)]
    for lin in lins:
        lin.forward = timed(PHASES[0], lin.forward)
    model.compute_logits = timed(PHASES[1], model.compute_logits)
    patched = {(kc, "rms_norm"): PHASES[3], (kc, "silu_and_mul"): PHASES[3], (kc, "rotary_embedding"): PHASES[2],
               (kc, "paged_attention_decode"): PHASES[2], (kc, "reshape_and_cache"): PHASES[2],
               (kc.DecodeAttentionBlock, "__call__"): PHASES[2], (mr, "build_model_input"): PHASES[4]}
    saved = {k: getattr(*k) for k in patched}
    for (obj, name), key in patched.items():
        setattr(obj, name, timed(key, saved[obj, name]))
    sampler = runner.sampler
    runner.sampler = timed(PHASES[5], sampler)
    engine.add_request("phases", prompt, SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True))
    engine.step()  # the prefill, untimed
    spent.clear()
    steps = 0
    try:
        while engine.has_unfinished_requests():
            t = time.perf_counter()
            engine.step()
            spent["whole step"] += time.perf_counter() - t
            steps += 1
    finally:
        for (obj, name), f in saved.items():
            setattr(obj, name, f)
        runner.sampler = sampler
        del model.compute_logits
        for lin in lins:
            del lin.forward
    out = {k: 1e3 * spent[k] / steps for k in (*PHASES, "whole step")}
    out[REST] = out["whole step"] - sum(out[k] for k in PHASES)
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--formats", default=",".join(FORMATS))
    ap.add_argument("--threads", default="1,2", help="comma-separated torch thread counts")
    ap.add_argument("--input-len", type=int, default=40)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--bandwidth-mb", type=int, default=512, help="the fp32 array the read bandwidth sums")
    a = ap.parse_args(argv)
    formats, threads = a.formats.split(","), [int(t) for t in a.threads.split(",")]
    if a.rounds < 1 or a.output_len < 2 or a.input_len < 1 or min(threads) < 1:
        raise ValueError("--rounds, --input-len and --threads must be >= 1 and --output-len >= 2")
    for fmt in formats:
        engine_kwargs(fmt)  # an unknown format fails before any model loads
    engines = {fmt: LLMEngine.from_kwargs(a.model, **engine_kwargs(fmt)) for fmt in formats}
    vocab = next(iter(engines.values())).vocab_size
    prompt = [(7 + 31 * i) % (vocab - 3) + 3 for i in range(a.input_len)]
    context = a.input_len + a.output_len // 2  # the median decode step's cached tokens
    sizes = {fmt: step_bytes(e, context) for fmt, e in engines.items()}
    rows, phase_rows, other, wall = [], {}, 0.0, 0.0
    for t in threads:
        torch.set_num_threads(t)
        bandwidth = read_bandwidth(a.bandwidth_mb)[0]
        for fmt, e in engines.items():
            decode_steps(e, prompt, 8, f"warm-up-{t}-{fmt}")
        ms: dict[str, list[float]] = defaultdict(list)
        m0, s0 = busy_seconds()
        w0 = time.perf_counter()
        for r in range(a.rounds):
            for fmt in formats[r % len(formats):] + formats[:r % len(formats)]:
                ms[fmt].append(median_step_ms(engines[fmt], prompt, a.output_len, f"{fmt}-{t}-{r}"))
        m1, s1 = busy_seconds()
        other += max(0.0, (m1 - m0) - (s1 - s0))
        wall += time.perf_counter() - w0
        bandwidth = max(bandwidth, read_bandwidth(a.bandwidth_mb)[0])
        for fmt, e in engines.items():
            rows.append((fmt, t, bandwidth, sizes[fmt], statistics.median(ms[fmt])))
            phase_rows[fmt, t] = phases(e, prompt, a.output_len)
    print(f"\n{a.model} batch-1 decode, {a.input_len}-token prompt, {a.output_len} greedy tokens (K/V of {context} "
          f"tokens: the median step's), medians of {a.rounds} rounds alternating the formats; other processes used "
          f"{other:.1f} CPU s during the rounds' {wall:.0f} s ({'quiet' if other < 0.02 * wall else 'LOADED'})")
    print(cpu_line() + "\n")
    print("| format | threads | read GB/s | MB a step (layers + LM head + K/V) | floor ms | decode step ms | tok/s | "
          "floor / step |\n|---|---|---|---|---|---|---|---|")
    for fmt, t, bw, b, step in rows:
        floor = b.total / bw / 1e6
        print(f"| {fmt} | {t} | {bw:.1f} | {b.total / 1e6:.1f} ({b.layers / 1e6:.1f} + {b.lm_head / 1e6:.1f} + "
              f"{b.kv / 1e6:.1f}) | {floor:.2f} | {step:.2f} | {1e3 / step:.1f} | {floor / step:.0%} |")
    print("\nWhere a decode step's time goes (wall ms per step, each phase wrapped, so the whole is a little slower):\n")
    keys = [*PHASES, REST, "whole step"]
    print("| format | threads | " + " | ".join(keys) + " |\n|" + "---|" * (len(keys) + 2))
    for (fmt, t), ph in phase_rows.items():
        print(f"| {fmt} | {t} | " + " | ".join(f"{ph[k]:.2f}" for k in keys) + " |")


if __name__ == "__main__":
    main()
