"""This engine next to vLLM's CPU build and Hugging Face `generate`, on `make bench`'s workload.

    python -m benchmarks.vs_vllm --vllm-python .venv-vllm/bin/python --rounds 3 --dtypes float32,bfloat16 \
        --vllm-preloads both [--engine-formats fp32,bf16,gguf]

vLLM runs in its own process and virtual environment (`vllm_driver.py`, started once per dtype and kept
warm): with its documented CPU set-up (`LD_PRELOAD` of Debian's tcmalloc and of the `libiomp5.so` that the
`intel-openmp` wheel puts in vLLM's venv) and without it (`--vllm-preloads both`); the engine and Hugging
Face run in this process. One dtype at a time: its vLLM processes stop before the next dtype's start.
Each round runs every side once, in an order that rotates from round to round, so drifting machine load
favours no side. Every run records the CPU time other processes used meanwhile (the machine's busy time
from /proc/stat minus this process's and the vLLM processes' own), and a run is quiet when that is under
5% of the machine's CPU time over the run. Reported per side: median output tokens/s over all rounds, the
spread (min-max), the 1-minute load average read before each run (it lags, and counts the benchmark's own
threads: no quiet test), then the quiet and the loaded medians apart. Greedy with ignore_eos on every side,
so the outputs double as a check: the requests whose tokens match exactly, and the token agreement up to
each first difference. `--engine-formats` adds engine sides (fp32, bf16, gguf: the real model's Q4_1
GGUF as int4) for a side by side on the real model.
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

from benchmarks.measure import cpu_line, machine_busy_seconds, tree_cpu_seconds
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
    others: list[float] = field(default_factory=list)  # other processes' CPU seconds during each run


class VllmProcess:
    """The driver in vLLM's venv: sent the workload once, then asked for one timed run at a time."""

    def __init__(self, python: str, spec: dict[str, Any], env: dict[str, str], driver: Path = DRIVER) -> None:
        # -P: not the script's folder first on sys.path (benchmarks/kernels.py would shadow the `kernels` package)
        self.proc = subprocess.Popen([python, "-P", str(driver)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True, env=env)
        self._send(json.dumps(spec))
        self.start_s = self._read()["start_s"]

    @property
    def pid(self) -> int:
        return self.proc.pid

    def run(self) -> tuple[float, list[list[int]]]:
        """The driver's own timing of `LLM.generate` (the pipe transfer is not in it)."""
        self._send("run")
        reply = self._read()
        return reply["wall_s"], reply["token_ids"]

    def run_reply(self, line: str = "run") -> dict[str, Any]:
        """The driver's whole answer to `line` (a driver with more fields than wall time and tokens)."""
        self._send(line)
        return self._read()

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


TCMALLOC = Path("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4")  # Debian's libtcmalloc-minimal4
QUIET_SHARE = 0.05  # a run is quiet when other processes used less than this share of the machine's CPU time


def vllm_preloads(vllm_python: str) -> list[str]:
    """vLLM's documented CPU preloads: tcmalloc and the intel-openmp wheel's libiomp5.so in vLLM's venv.
    ValueError naming what is missing (the benchmark would otherwise measure another set-up silently)."""
    iomp = Path(vllm_python).parent.parent / "lib" / "libiomp5.so"
    missing = [str(p) for p in (TCMALLOC, iomp) if not p.is_file()]
    if missing:
        raise ValueError(f"--vllm-preloads: {', '.join(missing)} not found (tcmalloc: apt-get install "
                         f"libtcmalloc-minimal4; libiomp5.so: the intel-openmp wheel in vLLM's venv); use "
                         f"--vllm-preloads off to run vLLM without them")
    return [str(TCMALLOC), str(iomp)]


def vllm_env(preloads: list[str] | None = None) -> dict[str, str]:
    """Offline; both cores for vLLM's OpenMP threads unless the caller chose a binding; `preloads` as LD_PRELOAD."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{os.cpu_count() - 1}")
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB, as the engine's default CPU KV budget
    if preloads:
        env["LD_PRELOAD"] = ":".join(preloads + [p for p in [env.get("LD_PRELOAD")] if p])
    else:
        env.pop("LD_PRELOAD", None)
    return env


ENGINE_FORMATS = {"fp32": {"dtype": "float32"}, "bf16": {"dtype": "bfloat16"}}
DTYPE_FORMAT = {"float32": "fp32", "bfloat16": "bf16"}


def engine_format_kwargs(fmt: str) -> dict[str, Any]:
    if fmt in ENGINE_FORMATS:
        return ENGINE_FORMATS[fmt]
    if fmt == "gguf":  # the real model's own GGUF blocks, llama.cpp's arithmetic (int8 activations, bf16 elsewhere)
        from engine_core.presets_real import gguf_path
        return {"dtype": "bfloat16", "quantization": "gguf", "quantization_config": {"file": str(gguf_path())}}
    raise ValueError(f"--engine-formats: each must be fp32, bf16 or gguf, got {fmt!r}")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vllm-python", default=".venv-vllm/bin/python")
    add_workload_args(ap)
    ap.add_argument("--hf-batch-sizes", default="",
                    help="comma-separated; each is a side (32 is HF's best in `make bench` here); empty: skip HF")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dtypes", default="float32", help="comma-separated, run one after the other: float32, bfloat16")
    ap.add_argument("--vllm-preloads", default="both", choices=("both", "on", "off"),
                    help="vLLM with its documented LD_PRELOAD set-up (on), without it (off), or both as two sides")
    ap.add_argument("--engine-formats", default="",
                    help="engine sides, comma-separated (fp32, bf16, gguf); empty: the dtype's own")
    a = ap.parse_args(argv)
    results = {}
    for dtype in a.dtypes.split(","):
        if dtype not in DTYPE_FORMAT:
            raise ValueError(f"--dtypes: each must be float32 or bfloat16, got {dtype!r}")
        results[dtype] = run_dtype(a, dtype)
    return results if len(results) > 1 else results[a.dtypes]


def run_dtype(a: argparse.Namespace, dtype: str) -> dict[str, Any]:
    formats = [f for f in a.engine_formats.split(",") if f] or [DTYPE_FORMAT[dtype]]
    preload_sets = {"on": [True], "off": [False], "both": [True, False]}[a.vllm_preloads]
    preloads = vllm_preloads(a.vllm_python) if True in preload_sets else []
    engines = {f: LLMEngine.from_kwargs(a.model, max_num_seqs=a.max_num_seqs,
                                        max_num_batched_tokens=a.max_num_batched_tokens, **engine_format_kwargs(f))
               for f in formats}
    first = next(iter(engines.values()))
    w, warm_up = workload_from_args(a, first.vocab_size), warm_up_workload(first.vocab_size, a.seed)
    for engine in engines.values():
        run_engine(engine, warm_up)
    print(f"\n## {dtype}: model {a.model}, {a.num_requests} requests, input {a.input_len}, output {a.output_len} "
          f"({w.num_output_tokens} output tokens), greedy, ignore_eos; torch threads {torch.get_num_threads()}, "
          f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', '(unset)')}", flush=True)
    spec = dict(model=str(resolve_model(a.model)), dtype=dtype, max_num_seqs=a.max_num_seqs,
                max_num_batched_tokens=a.max_num_batched_tokens, prompts=w.prompts, output_lens=w.output_lens,
                warm_up_prompts=warm_up.prompts)
    vllms: list[tuple[str, VllmProcess]] = []
    try:
        for on in preload_sets:
            t = time.perf_counter()
            vllms.append(("vLLM CPU" if on else "vLLM CPU, no preloads",
                          VllmProcess(a.vllm_python, spec, vllm_env(preloads if on else None))))
            print(f"{vllms[-1][0]} started in {time.perf_counter() - t:.0f} s (its first start compiles)", flush=True)
        sides = [Side(vllms[0][0], vllms[0][1].run)]
        sides += [Side("engine" if len(engines) == 1 else f"engine {f}", _timer(lambda e=e: run_engine(e, w)))
                  for f, e in engines.items()]
        sides += [Side(name, proc.run) for name, proc in vllms[1:]]
        sizes = [int(x) for x in a.hf_batch_sizes.split(",") if x.strip()]
        if sizes:
            hf, pad = load_hf(a.model, getattr(torch, dtype), warm_up)
            sides += [Side(f"HF generate, batch {bs}", _timer(lambda bs=bs: run_hf(hf, w, bs, pad))) for bs in sizes]
        roots = [proc.pid for _, proc in vllms]
        for r in range(a.rounds):
            for side in sides[r % len(sides):] + sides[:r % len(sides)]:
                _timed(side, w, r, roots)
    finally:
        for _, proc in vllms:
            proc.close()
    return report(sides, w)


def _timer(fn: Callable[[], list[list[int]]]) -> Callable[[], tuple[float, list[list[int]]]]:
    def run() -> tuple[float, list[list[int]]]:
        t = time.perf_counter()
        out = fn()
        return time.perf_counter() - t, out
    return run


def _timed(side: Side, w: Workload, r: int, roots: list[int] | None = None) -> None:
    side.loads.append(load_average())
    m0, s0, w0 = machine_busy_seconds(), tree_cpu_seconds(roots or []), time.perf_counter()
    wall, side.outputs = side.run()
    other = max(0.0, (machine_busy_seconds() - m0) - (tree_cpu_seconds(roots or []) - s0))
    side.walls.append(wall)
    side.others.append(other)
    quiet = other < QUIET_SHARE * (time.perf_counter() - w0) * os.cpu_count()
    print(f"[round {r + 1}] {side.name:22s} {side.walls[-1]:7.2f} s {w.num_output_tokens / side.walls[-1]:7.1f} "
          f"output tok/s  (load {side.loads[-1]:.2f}; other processes {other:.1f} CPU s: "
          f"{'quiet' if quiet else 'loaded'})", flush=True)


def is_quiet(side: Side, i: int) -> bool:
    """Run i of `side`: other processes used under QUIET_SHARE of the machine's CPU time meanwhile."""
    return side.others[i] < QUIET_SHARE * side.walls[i] * os.cpu_count()


def report(sides: list[Side], w: Workload) -> dict[str, Any]:
    """The table; the returned dict has each side's median tok/s and the agreements. sides[0] is vLLM at its
    best set-up, sides[1] the (first) engine."""
    rates = {s.name: [w.num_output_tokens / x for x in s.walls] for s in sides}
    med = {name: statistics.median(r) for name, r in rates.items()}
    print(cpu_line())
    print("\n| side | median output tok/s | spread (min-max) | 1-min load average at each run |\n|---|---|---|---|")
    for s in sides:
        r = rates[s.name]
        print(f"| {s.name} | {med[s.name]:.1f} | {min(r):.1f}-{max(r):.1f} | {', '.join(f'{x:.2f}' for x in s.loads)} |")
    if any(s.others for s in sides):
        print("\n| side | quiet runs | quiet median tok/s | loaded runs | loaded median tok/s | other processes' CPU s "
              "per run |\n|---|---|---|---|---|---|")
        for s in sides:
            quiet = [x for i, x in enumerate(rates[s.name]) if is_quiet(s, i)]
            loaded = [x for i, x in enumerate(rates[s.name]) if not is_quiet(s, i)]
            print(f"| {s.name} | {len(quiet)} | {statistics.median(quiet) if quiet else float('nan'):.1f} | {len(loaded)} "
                  f"| {statistics.median(loaded) if loaded else float('nan'):.1f} | "
                  f"{', '.join(f'{x:.1f}' for x in s.others)} |")
    vllm, engine = sides[0], sides[1]
    exact = sum(x == y for x, y in zip(engine.outputs, vllm.outputs))
    print()
    for s in sides[1:]:
        if s.name.startswith("engine"):
            print(f"{s.name} / {vllm.name}: {med[s.name] / med[vllm.name]:.2f}x (medians)")
    print(f"greedy tokens, {engine.name} vs {vllm.name}: {exact}/{len(w.prompts)} requests identical, "
          f"{token_agreement(engine.outputs, vllm.outputs):.1%} of tokens agree up to each first difference")
    results: dict[str, Any] = {"tok_s": med, "vllm_identical_requests": exact}
    hf = [s for s in sides if s.name.startswith("HF")]
    if hf:
        best = max(hf, key=lambda s: med[s.name])
        print(f"{engine.name} / HF best ({best.name}): {med[engine.name] / med[best.name]:.2f}x (medians); "
              f"token agreement engine vs HF {token_agreement(engine.outputs, best.outputs):.1%}")
        results["hf_best"] = best.name
    return results


if __name__ == "__main__":
    main()
