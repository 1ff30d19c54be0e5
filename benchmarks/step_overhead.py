"""Batch-1 decode steps on the real model: where the time goes, and the fused attention block on vs off.

    python -m benchmarks.step_overhead --model smollm2-135m-instruct --formats fp32,bf16,gguf --threads 1,2 \
        --rounds 5 --output-len 64 --phases --machine

Per format (fp32, bf16, gguf: the wheel's Q4_1 blocks as int4 with bf16 activations) one engine serves one
greedy request at a time. Each round runs both variants of a decode step, in an order that alternates from
round to round, in this process:
- `separate ops`: RoPE, the K/V write and decode attention as three kernel calls per layer (the engine
  before `kernels.cpu.DecodeAttentionBlock`: `AttentionPlan.decode_block` patched to None);
- `fused block`: one C call per layer (the engine's default).
Reported per variant and thread count: the median decode-step wall time, the median CPU time of the main
thread per step (the step's own work: on a loaded machine the wall time also counts the time other
processes held the core), the process's CPU time over wall (how many cores the step keeps busy), and the
CPU time other processes used during the variant's runs (`measure.busy_seconds`: 0 on a quiet
machine). Greedy tokens must be identical across variants. `--phases` then times each phase of a step
(the layers' GEMMs, the LM head, each C kernel, what is left: Python and dispatch) by wrapping each one: main
thread CPU and process CPU per step, so the second thread's share per phase shows. `--machine`: where the step
stands against the machine: the bytes a step reads (weights as stored + the K/V) over the measured read
bandwidth (a 512 MB sum), and the step's linears alone (the GEMM floor at batch 1) over the step's time.
"""
from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch

from benchmarks.measure import busy_seconds, cpu_line
from engine_core.engine import LLMEngine
from engine_core.models.attention import AttentionPlan
from engine_core.models.linear import Linear
from engine_core.models.llama import RMSNorm
from engine_core.request import SamplingParams

FORMATS = ("fp32", "bf16", "gguf")


def engine_kwargs(fmt: str) -> dict[str, Any]:
    if fmt == "fp32":
        return {"dtype": "float32"}
    if fmt == "bf16":
        return {"dtype": "bfloat16"}
    if fmt == "gguf":
        from engine_core.presets_real import gguf_path
        return {"dtype": "bfloat16", "quantization": "gguf", "quantization_config": {"file": str(gguf_path())}}
    raise ValueError(f"--formats: each must be one of {FORMATS}, got {fmt!r}")


@contextmanager
def separate_ops() -> Iterator[None]:
    """The engine as it ran before the fused block: three kernel calls per layer."""
    fused = AttentionPlan.decode_block
    AttentionPlan.decode_block = lambda self, *a: None
    try:
        yield
    finally:
        AttentionPlan.decode_block = fused


VARIANTS: dict[str, Callable[[], Any]] = {"separate ops": separate_ops, "fused block": nullcontext}


def decode_steps(engine: LLMEngine, prompt: list[int], output_len: int, rid: str
                 ) -> tuple[list[float], list[float], float, float, list[int]]:
    """One greedy request: each decode step's wall and main-thread CPU seconds (the prefill step left out),
    the run's process CPU seconds and wall seconds, and its tokens."""
    engine.add_request(rid, prompt, SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True))
    walls, cpus, tokens, first = [], [], [], True
    p0, w0 = time.process_time(), time.perf_counter()
    while engine.has_unfinished_requests():
        c, t = time.thread_time(), time.perf_counter()
        outs = engine.step()
        if not first:
            walls.append(time.perf_counter() - t)
            cpus.append(time.thread_time() - c)
        first = False
        tokens = next((list(o.outputs[0].token_ids) for o in outs if o.finished), tokens)
    return walls, cpus, time.process_time() - p0, time.perf_counter() - w0, tokens


def compare(engine: LLMEngine, prompt: list[int], output_len: int, rounds: int) -> dict[str, dict[str, float]]:
    names = list(VARIANTS)
    walls: dict[str, list[float]] = defaultdict(list)
    cpus: dict[str, list[float]] = defaultdict(list)
    proc = defaultdict(float)
    wall_total = defaultdict(float)
    other = defaultdict(float)
    tokens: dict[str, list[int]] = {}
    for r in range(rounds):
        for name in names[r % 2:] + names[:r % 2]:
            with VARIANTS[name]():
                m0, s0 = busy_seconds()
                w, c, p, wt, tokens[name] = decode_steps(engine, prompt, output_len, f"{name}-{r}")
                m1, s1 = busy_seconds()
            walls[name].append(statistics.median(w))
            cpus[name].append(statistics.median(c))
            proc[name] += p
            wall_total[name] += wt
            other[name] += max(0.0, (m1 - m0) - (s1 - s0))
    if len({tuple(t) for t in tokens.values()}) != 1:
        raise AssertionError(f"greedy tokens differ between the variants: {tokens}")
    return {n: {"wall_ms": 1e3 * statistics.median(walls[n]), "cpu_ms": 1e3 * statistics.median(cpus[n]),
                "cpu_per_wall": proc[n] / wall_total[n], "other_cpu_s": other[n]} for n in names}


def phases(engine: LLMEngine, prompt: list[int], output_len: int) -> dict[str, tuple[float, float, int]]:
    """Per phase of a decode step: (main-thread CPU ms, process CPU ms, calls) per step, by wrapping each."""
    import kernels.cpu as kc
    main_cpu: dict[str, float] = defaultdict(float)
    proc_cpu: dict[str, float] = defaultdict(float)
    calls: dict[str, int] = defaultdict(int)

    def timed(key: str, f: Callable[..., Any]) -> Callable[..., Any]:
        def g(*a: Any, **k: Any) -> Any:
            c, p = time.thread_time(), time.process_time()
            out = f(*a, **k)
            main_cpu[key] += time.thread_time() - c
            proc_cpu[key] += time.process_time() - p
            calls[key] += 1
            return out
        return g

    model, undo = engine.runner.model, []
    for layer in model.layers:
        for lin in (layer.attn.qkv_proj, layer.attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
            lin.forward = timed("GEMMs of the layers", lin.forward)
            undo.append(lin)
    model.compute_logits = timed("LM head", model.compute_logits)
    saved = {n: getattr(kc, n) for n in ("rms_norm", "silu_and_mul")}
    for n, f in saved.items():
        setattr(kc, n, timed(f"C {n}", f))
    block_call = kc.DecodeAttentionBlock.__call__
    kc.DecodeAttentionBlock.__call__ = timed("C decode_attention_block", block_call)
    engine.add_request("phases", prompt, SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True))
    engine.step()  # the prefill, untimed
    main_cpu.clear(), proc_cpu.clear(), calls.clear()
    step = engine.step
    engine.step = timed("whole step", step)
    try:
        while engine.has_unfinished_requests():
            engine.step()
    finally:
        engine.step = step
        kc.DecodeAttentionBlock.__call__ = block_call
        for n, f in saved.items():
            setattr(kc, n, f)
        for lin in undo:
            del lin.forward
        del model.compute_logits
    n = calls["whole step"]
    out = {k: (1e3 * main_cpu[k] / n, 1e3 * proc_cpu[k] / n, round(calls[k] / n)) for k in main_cpu}
    named = sum(v[0] for k, v in out.items() if k != "whole step")
    named_p = sum(v[1] for k, v in out.items() if k != "whole step")
    whole = out["whole step"]
    out["rest (Python, dispatch, scheduler, sampler)"] = (whole[0] - named, whole[1] - named_p, 0)
    return out


def _best(fn: Callable[[], Any], repeats: int) -> tuple[float, float]:
    """(best wall seconds, best process CPU seconds per thread) of `repeats` calls: on a loaded machine the CPU
    time per thread is what the work took on the cores it got, the wall time also counts waiting for them."""
    wall = cpu = float("inf")
    for _ in range(repeats):
        t, c = time.perf_counter(), time.process_time()
        fn()
        wall = min(wall, time.perf_counter() - t)
        cpu = min(cpu, (time.process_time() - c) / torch.get_num_threads())
    return wall, cpu


def read_bandwidth(mb: int = 512, repeats: int = 3) -> tuple[float, float]:
    """GB/s of an `mb` MB fp32 sum at the current thread count, best of `repeats` (512: far past the 32 MiB L3),
    by wall time and by CPU time per thread."""
    x = torch.ones(mb * 2**18)
    wall, cpu = _best(x.sum, repeats)
    return x.nbytes / wall / 1e9, x.nbytes / cpu / 1e9


@torch.inference_mode()
def linears_alone_ms(engine: LLMEngine, repeats: int = 5) -> tuple[float, float]:
    """One batch-1 decode step's linears (every layer's four, then the LM head), the model's own modules on
    random rows, back to back: best of `repeats`, ms by wall and by CPU per thread. The GEMM floor of a step at
    this batch size."""
    model = engine.runner.model
    lins = [m for layer in model.layers for m in (layer.attn.qkv_proj, layer.attn.o_proj, layer.mlp.gate_up_proj,
                                                 layer.mlp.down_proj)] + [model.lm_head_proj]
    dtype = model.cos.dtype
    xs = [torch.randn(1, getattr(m, "input_size", None) or m.weight.shape[1]).to(dtype) for m in lins]
    wall, cpu = _best(lambda: [m(x) for m, x in zip(lins, xs)], repeats)
    return 1e3 * wall, 1e3 * cpu


@dataclass(frozen=True)
class StepBytes:
    """What one batch-1 decode step reads, in bytes."""
    layers: int  # every layer's projections as stored (scales, zero points, biases) and its norms
    lm_head: int  # the LM head as stored, the final norm, and the embedding row the step's token looks up
    kv: int  # the K and V of `context` tokens in every layer, in the cache's dtype

    @property
    def total(self) -> int:
        return self.layers + self.lm_head + self.kv


def step_bytes(engine: LLMEngine, context: int) -> StepBytes:
    """The bytes a batch-1 decode step at `context` cached tokens reads, from the loaded model's own storage:
    each Linear's `weight_bytes` (its scheme's bytes) plus its bias, the norms' weights, the K/V of `context`
    tokens per layer. The embedding counts one row, or nothing when the LM head is the same tensor (tied and
    dense: the head reads every row anyway)."""
    model, cache = engine.runner.model, engine.runner.kv_cache
    head = model.lm_head_proj

    def linear_bytes(lin: Linear) -> int:
        bias = getattr(lin, "bias", None)
        return lin.weight_bytes() + (0 if bias is None else bias.nbytes)

    def norm_bytes(module: torch.nn.Module) -> int:
        return sum(m.weight.nbytes for m in module.modules() if isinstance(m, RMSNorm))

    layers = sum(linear_bytes(m) for layer in model.layers for m in layer.modules() if isinstance(m, Linear))
    layers += sum(norm_bytes(layer) for layer in model.layers)
    embed_row = 0 if getattr(head, "weight", None) is model.embed else model.embed[0].nbytes
    key = cache.key[0]  # [num_blocks, block_size, kv_heads, head_dim]
    kv = 2 * len(model.layers) * context * key.shape[2] * key.shape[3] * key.element_size()
    return StepBytes(layers, linear_bytes(head) + norm_bytes(model.norm) + embed_row, kv)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--formats", default=",".join(FORMATS))
    ap.add_argument("--threads", default="1,2", help="comma-separated torch thread counts")
    ap.add_argument("--input-len", type=int, default=40)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--phases", action="store_true", help="then a per-phase breakdown of one run per thread count")
    ap.add_argument("--machine", action="store_true",
                    help="then the machine's floors: read bandwidth, the step's linears alone, bytes per step")
    ap.add_argument("--bandwidth-mb", type=int, default=512, help="the array the read bandwidth sums")
    a = ap.parse_args(argv)
    threads = [int(t) for t in a.threads.split(",")]
    rows, phase_rows, machine_rows = [], [], []
    for fmt in a.formats.split(","):
        engine = LLMEngine.from_kwargs(a.model, **engine_kwargs(fmt))
        prompt = [(7 + 31 * i) % (engine.vocab_size - 3) + 3 for i in range(a.input_len)]
        for t in threads:
            torch.set_num_threads(t)
            decode_steps(engine, prompt, 8, f"warm-up-{t}")
            for name, r in compare(engine, prompt, a.output_len, a.rounds).items():
                rows.append((fmt, t, name, r))
                print(f"{fmt} {t} thread(s) {name}: {r}", flush=True)
            if a.phases:
                phase_rows.append((fmt, t, phases(engine, prompt, a.output_len)))
            if a.machine:
                fused = next(r for f, tt, n, r in rows if f == fmt and tt == t and n == "fused block")
                machine_rows.append((fmt, t, step_bytes(engine, a.input_len + a.output_len // 2).total,
                                     *read_bandwidth(a.bandwidth_mb), *linears_alone_ms(engine), fused["wall_ms"],
                                     fused["cpu_ms"]))
        del engine
    other = sum(r["other_cpu_s"] for *_, r in rows)
    print(f"\nSmolLM2 batch-1 decode, {a.input_len}-token prompt, {a.output_len} tokens, medians of {a.rounds} "
          f"alternating rounds; other processes used {other:.0f} CPU s meanwhile "
          f"({'quiet' if other < 0.05 * sum(r['wall_ms'] for *_, r in rows) else 'LOADED'})\n")
    print(cpu_line())
    print("| format | threads | decode step | wall ms/step | tok/s | main-thread CPU ms/step | CPU / wall | "
          "other processes' CPU s |\n|---|---|---|---|---|---|---|---|")
    for fmt, t, name, r in rows:
        print(f"| {fmt} | {t} | {name} | {r['wall_ms']:.1f} | {1e3 / r['wall_ms']:.1f} | {r['cpu_ms']:.1f} | "
              f"{r['cpu_per_wall']:.2f} | {r['other_cpu_s']:.0f} |")
    if machine_rows:
        print("\nAgainst the machine (same process, right after each format's rounds; the linears alone: the model's "
              "modules on random rows, best of 5; the bandwidth: a 512 MB fp32 sum, best of 3). By wall time, then by "
              "CPU time (per thread; the step: its main thread's), which a loaded machine inflates less:\n\n"
              "| format | threads | MB read per decode step | read GB/s | floor ms (bytes / bandwidth) | linears alone ms | "
              "decode step ms | floor / step | linears alone / step |\n|---|---|---|---|---|---|---|---|---|")
        for fmt, t, b, bw, bw_cpu, lin, lin_cpu, step, step_cpu in machine_rows:
            f, fc = b / bw / 1e6, b / bw_cpu / 1e6
            print(f"| {fmt} | {t} | {b / 1e6:.0f} | {bw:.1f} (CPU {bw_cpu:.1f}) | {f:.1f} (CPU {fc:.1f}) | {lin:.1f} "
                  f"(CPU {lin_cpu:.1f}) | {step:.1f} (CPU {step_cpu:.1f}) | {f / step:.0%} (CPU {fc / step_cpu:.0%}) | "
                  f"{lin / step:.0%} (CPU {lin_cpu / step_cpu:.0%}) |")
    for fmt, t, ph in phase_rows:
        print(f"\n{fmt}, {t} thread(s), per decode step (wrapped, so a little slower):\n\n"
              "| phase | calls | main-thread CPU ms | process CPU ms (all threads) |\n|---|---|---|---|")
        for k, (mc, pc, c) in ph.items():
            print(f"| {k} | {c or ''} | {mc:.2f} | {pc:.2f} |")


if __name__ == "__main__":
    main()
