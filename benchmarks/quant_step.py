"""Whole-step decode time vs batch of each weight scheme on CPU (`make quant-step`, `python -m benchmarks.quant_step
[--model smollm2-135m-instruct --batches 1,2,...,256 --steps 5 --threads 2 --bandwidth GBPS --json OUT]`).

One engine per scheme, all loaded at once: fp32 and bf16 (dense), W8A8 int8, W4A16 (the real model's Q4_1 blocks
in llama.cpp's arithmetic, `gguf`, and round-to-nearest group 32, `rtn`) and fp8 (per-tensor e4m3 weights,
weight-only on CPU: with AVX512-BF16 the packed kernel `fp8_w8a16_packed_gemm` at every batch, else
`fp8_w8a16_gemm` up to 8 rows and the weight dequantized to bf16 above). The quantized
schemes run with the bf16 model (embedding, LM head, norms, attention and activations in bf16), so bf16 is their
baseline. For each batch M every engine gets M requests of
8 prompt tokens, prefills them (not timed), then the engines take one decode step each in turn, `--steps` times
(a drift in the machine's load hits every scheme alike); the table shows the median step in ms. SmolLM2's weights
(the smallest, W4A16: about 100 MiB with the dense tied embedding) are larger than the L3, so every step streams
them from DRAM. The other processes' CPU time over the run (/proc/stat's busy time minus this process's) is
printed: the numbers are "loaded" when it is not near zero.

The roofline of a step: t(M) = max(bytes / BW, 2 M P / R), bytes = the weights as stored (`stats()`;
the tied embedding is the LM head, read whole every step), P the matmul parameters (projections and the LM
head), BW a streaming read's rate (benchmarks/quant_gemm.py), R the scheme's own rate at the largest M.
Its crossover with bf16 and fp32 (the M from which on a scheme is no faster) is printed beside the measured one.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.measure import busy_seconds, cpu_line, crossover, l3_bytes, stream_bandwidth
from engine_core import LLMEngine, SamplingParams
from engine_core.models.linear import Linear

BATCHES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
PROMPT_LEN = 8
BLOCK_SIZE = 16


def scheme_kwargs(name: str) -> dict[str, Any]:
    """The engine arguments of a scheme of SCHEMES."""
    if name == "fp32":
        return dict(dtype="float32")
    if name == "W4A16 gguf":
        from engine_core.presets_real import gguf_path
        return dict(dtype="bfloat16", quantization="gguf", quantization_config={"file": str(gguf_path())})
    quant = {"bf16": {}, "int8 W8A8": dict(quantization="int8"), "fp8": dict(quantization="fp8"),
             "W4A16 rtn": dict(quantization="rtn", quantization_config={"bits": 4, "group_size": 32})}[name]
    return dict(dtype="bfloat16", **quant)


SCHEMES = ("fp32", "bf16", "int8 W8A8", "W4A16 gguf", "W4A16 rtn", "fp8")


def matmul_params(engine: LLMEngine) -> int:
    """Weights a decode row multiplies by: every projection and the LM head (in x out)."""
    return sum(m.input_size * m.output_size for m in engine.runner.model.modules() if isinstance(m, Linear))


def build(model: str, scheme: str, max_batch: int, steps: int) -> LLMEngine:
    per_request = -(-(PROMPT_LEN + steps + 2) // BLOCK_SIZE)
    return LLMEngine.from_kwargs(model, block_size=BLOCK_SIZE, num_gpu_blocks=max_batch * per_request + 1,
                                 max_num_seqs=max_batch, max_num_batched_tokens=max(2048, max_batch * PROMPT_LEN),
                                 swap_space=0, device="cpu", **scheme_kwargs(scheme))


def start(engine: LLMEngine, m: int, steps: int, tag: str) -> list[str]:
    """M requests added and prefilled (every one has its first token): the next steps are pure decode."""
    vocab = engine.model_config.args.vocab_size
    g = torch.Generator().manual_seed(m)
    ids = [f"{tag}-{m}-{i}" for i in range(m)]
    params = SamplingParams(max_tokens=steps + 2, temperature=0.0, ignore_eos=True)
    for rid in ids:
        engine.add_request(rid, torch.randint(3, vocab, (PROMPT_LEN,), generator=g).tolist(), params)
    while engine.scheduler.waiting or any(not r.output_token_ids for r in engine.scheduler.running):
        engine.step()
    return ids


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--schemes", default=",".join(SCHEMES), help=f"comma-separated, of {list(SCHEMES)}")
    ap.add_argument("--batches", default=",".join(map(str, BATCHES)))
    ap.add_argument("--steps", type=int, default=5, help="timed decode steps per scheme and batch")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--bandwidth", type=float, help="the DRAM read rate in GB/s for the roofline (default: measured)")
    ap.add_argument("--json", help="write the medians and the roofline here")
    args = ap.parse_args(argv)
    schemes = [s.strip() for s in args.schemes.split(",") if s.strip()]
    bad = [s for s in schemes if s not in SCHEMES]
    if bad or not schemes:
        ap.error(f"--schemes must be a comma-separated subset of {list(SCHEMES)}, got {args.schemes!r}")
    batches = [int(b) for b in args.batches.split(",")]
    if args.steps < 1 or not batches or min(batches) < 1:
        ap.error("--steps and every batch must be >= 1")
    torch.set_num_threads(args.threads)
    engines = {s: build(args.model, s, max(batches), args.steps) for s in schemes}
    weight_bytes = {s: e.stats()["weight_bytes"] for s, e in engines.items()}
    params = matmul_params(engines[schemes[0]])
    l3 = l3_bytes()
    bw = stream_bandwidth(l3) if args.bandwidth is None else args.bandwidth * 1e9
    times: dict[str, dict[int, list[float]]] = {s: {m: [] for m in batches} for s in schemes}
    busy0, own0 = busy_seconds()
    wall0 = time.perf_counter()
    for m in batches:
        ids = {s: start(e, m, args.steps, s) for s, e in engines.items()}
        for _ in range(args.steps):
            for s, e in engines.items():
                t = time.perf_counter()
                e.step()
                times[s][m].append(time.perf_counter() - t)
        for s, e in engines.items():
            e.abort_request(ids[s])
            while e.has_unfinished_requests():
                e.step()
    wall = time.perf_counter() - wall0
    busy1, own1 = busy_seconds()
    other = max(0.0, (busy1 - busy0) - (own1 - own0))
    med = {s: {m: statistics.median(v) for m, v in per.items()} for s, per in times.items()}
    flops = {m: 2 * m * params for m in batches}
    rate = {s: flops[max(batches)] / med[s][max(batches)] for s in schemes}
    roof = {s: {m: max(weight_bytes[s] / bw, flops[m] / rate[s]) for m in batches} for s in schemes}

    print(f"{args.model}: whole decode step, {args.threads} threads, {args.steps} steps per point (medians, ms); "
          f"L3 {l3 / 2**20:.0f} MiB; streaming read {bw / 1e9:.1f} GB/s; other processes' CPU time {other:.2f} s "
          f"over {wall:.1f} s ({other / wall:.2f} CPUs busy besides this one{': loaded' if other / wall > 0.1 else ''})")
    print(cpu_line())
    print("| M | " + " | ".join(schemes) + " |\n|---|" + "---|" * len(schemes))
    for m in batches:
        print(f"| {m} | " + " | ".join(f"{1e3 * med[s][m]:.1f}" for s in schemes) + " |")
    print("roofline (ms): " + "; ".join(f"M = {m}: " + ", ".join(f"{s} {1e3 * roof[s][m]:.1f}" for s in schemes)
                                        for m in batches))
    print("weight MiB: " + ", ".join(f"{s} {b / 2**20:.0f}" for s, b in weight_bytes.items()))
    print(f"matmul parameters {params / 1e6:.1f} M; rate at the largest M (GFLOP/s): "
          + ", ".join(f"{s} {r / 1e9:.1f}" for s, r in rate.items()))
    cross: dict[str, dict] = {}
    first = min(batches)
    for base in ("bf16", "fp32"):
        if base not in schemes:
            continue
        for s in schemes:
            if s in ("fp32", "bf16"):
                continue
            c = {"measured": crossover(med[s], med[base]), "roofline": crossover(roof[s], roof[base])}
            cross[f"{s} vs {base}"] = c
            said = {how: "faster at the largest M" if m is None else f"no faster from M = {m} on"
                    for how, m in c.items()}
            print(f"{s} vs {base}: {said['measured']} (roofline: {said['roofline']}); at M = {first} "
                  f"{med[base][first] / med[s][first]:.2f}x (roofline {roof[base][first] / roof[s][first]:.2f}x)")
    result = {"model": args.model, "cpu": cpu_line(), "threads": args.threads, "steps": args.steps, "l3_bytes": l3,
              "stream_bytes_per_s": bw, "other_cpu_s": other, "wall_s": wall, "median_s": med, "roofline_s": roof,
              "weight_bytes": weight_bytes, "matmul_params": params, "crossover": cross}
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
