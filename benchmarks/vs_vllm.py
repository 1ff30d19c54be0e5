"""This engine next to vLLM's CPU build and Hugging Face `generate`, on `make bench`'s workload.

    python -m benchmarks.vs_vllm --vllm-python .venv-vllm/bin/python --rounds 3

vLLM runs in its own process and virtual environment (`vllm_driver.py`, started once and kept
warm); the engine and Hugging Face run in this process. Each round runs every side once, in an
order that rotates from round to round, so drifting machine load favours no side. Reported per
side: median output tokens/s over the rounds, the spread (min-max), and the 1-minute load average
read before each run. Greedy with ignore_eos on every side, so the outputs double as a check:
the requests whose tokens match exactly, and the token agreement up to each first difference.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from benchmarks.throughput import load_hf, run_hf
from benchmarks.workload import (Workload, add_workload_args, run_engine, token_agreement, warm_up_workload,
                                 workload_from_args)
from engine_core.engine import LLMEngine
from engine_core.presets import resolve_model

DRIVER = Path(__file__).with_name("vllm_driver.py")


@dataclass
class Side:
    name: str
    run: Callable[[], tuple[float, list[list[int]]]]  # one timed run: (wall seconds, output token ids)
    walls: list[float] = field(default_factory=list)
    loads: list[float] = field(default_factory=list)
    outputs: list[list[int]] = field(default_factory=list)


class VllmProcess:
    """The driver in vLLM's venv: sent the workload once, then asked for one timed run at a time."""

    def __init__(self, python: str, spec: dict[str, Any], env: dict[str, str], driver: Path = DRIVER) -> None:
        self.proc = subprocess.Popen([python, str(driver)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True, env=env)
        self._send(json.dumps(spec))
        self.start_s = self._read()["start_s"]

    def run(self) -> tuple[float, list[list[int]]]:
        """The driver's own timing of `LLM.generate` (the pipe transfer is not in it)."""
        self._send("run")
        reply = self._read()
        return reply["wall_s"], reply["token_ids"]

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=120)

    def _send(self, line: str) -> None:
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def _read(self) -> dict[str, Any]:
        for line in self.proc.stdout:
            if line.startswith("@@"):
                return json.loads(line[2:])
            sys.stderr.write(line)  # vLLM's own prints
        raise RuntimeError(f"the vLLM driver exited with status {self.proc.wait()} before answering")


def load_average() -> float:
    return float(Path("/proc/loadavg").read_text().split()[0])


def vllm_env() -> dict[str, str]:
    """Offline; both cores for vLLM's OpenMP threads unless the caller chose a binding."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{os.cpu_count() - 1}")
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB, as the engine's default CPU KV budget
    return env


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vllm-python", default=".venv-vllm/bin/python")
    add_workload_args(ap)
    ap.add_argument("--hf-batch-sizes", default="32",
                    help="comma-separated; each is a side (32 is HF's best in `make bench` here); empty: skip HF")
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args(argv)
    engine = LLMEngine.from_kwargs(a.model, max_num_seqs=a.max_num_seqs, max_num_batched_tokens=a.max_num_batched_tokens,
                                   dtype="float32")
    w, warm_up = workload_from_args(a, engine.vocab_size), warm_up_workload(engine.vocab_size, a.seed)
    run_engine(engine, warm_up)
    print(f"model {a.model}, {a.num_requests} requests, input {a.input_len}, output {a.output_len} "
          f"({w.num_output_tokens} output tokens), fp32, greedy, ignore_eos; torch threads {torch.get_num_threads()}, "
          f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', '(unset)')}", flush=True)
    t = time.perf_counter()
    spec = dict(model=str(resolve_model(a.model)), dtype="float32", max_num_seqs=a.max_num_seqs,
                max_num_batched_tokens=a.max_num_batched_tokens, prompts=w.prompts, output_lens=w.output_lens,
                warm_up_prompts=warm_up.prompts)
    vllm = VllmProcess(a.vllm_python, spec, vllm_env())
    print(f"vLLM started in {time.perf_counter() - t:.0f} s (includes its first-start compile when not cached)",
          flush=True)
    sides = [Side("vLLM CPU", vllm.run), Side("engine", _timer(lambda: run_engine(engine, w)))]
    sizes = [int(s) for s in a.hf_batch_sizes.split(",") if s.strip()]
    if sizes:
        hf, pad = load_hf(a.model, torch.float32, warm_up)
        sides += [Side(f"HF generate, batch {bs}", _timer(lambda bs=bs: run_hf(hf, w, bs, pad))) for bs in sizes]
    try:
        for r in range(a.rounds):
            for side in sides[r % len(sides):] + sides[:r % len(sides)]:
                _timed(side, w, r)
    finally:
        vllm.close()
    return report(sides, w)


def _timer(fn: Callable[[], list[list[int]]]) -> Callable[[], tuple[float, list[list[int]]]]:
    def run() -> tuple[float, list[list[int]]]:
        t = time.perf_counter()
        out = fn()
        return time.perf_counter() - t, out
    return run


def _timed(side: Side, w: Workload, r: int) -> None:
    side.loads.append(load_average())
    wall, side.outputs = side.run()
    side.walls.append(wall)
    load = side.loads[-1]
    print(f"[round {r + 1}] {side.name:22s} {side.walls[-1]:7.2f} s {w.num_output_tokens / side.walls[-1]:7.1f} "
          f"output tok/s  (load {load:.2f})", flush=True)


def report(sides: list[Side], w: Workload) -> dict[str, Any]:
    """The table; the returned dict has each side's median tok/s and the agreements."""
    rates = {s.name: [w.num_output_tokens / x for x in s.walls] for s in sides}
    med = {name: statistics.median(r) for name, r in rates.items()}
    print("\n| side | median output tok/s | spread (min-max) | 1-min load average at each run |\n|---|---|---|---|")
    for s in sides:
        r = rates[s.name]
        print(f"| {s.name} | {med[s.name]:.1f} | {min(r):.1f}-{max(r):.1f} | {', '.join(f'{x:.2f}' for x in s.loads)} |")
    vllm, engine = sides[0], sides[1]
    exact = sum(x == y for x, y in zip(engine.outputs, vllm.outputs))
    print(f"\nengine / vLLM CPU: {med['engine'] / med['vLLM CPU']:.2f}x (medians)")
    print(f"greedy tokens, engine vs vLLM: {exact}/{len(w.prompts)} requests identical, "
          f"{token_agreement(engine.outputs, vllm.outputs):.1%} of tokens agree up to each first difference")
    results: dict[str, Any] = {"tok_s": med, "vllm_identical_requests": exact}
    hf = sides[2:]
    if hf:
        best = max(hf, key=lambda s: med[s.name])
        print(f"engine / HF best ({best.name}): {med['engine'] / med[best.name]:.2f}x (medians); "
              f"token agreement engine vs HF {token_agreement(engine.outputs, best.outputs):.1%}")
        results["hf_best"] = best.name
    return results


if __name__ == "__main__":
    main()
