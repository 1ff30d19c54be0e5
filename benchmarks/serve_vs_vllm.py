"""The load generator against this engine's OpenAI server and `vllm serve` (vLLM's CPU build), side by side.

    python -m benchmarks.serve_vs_vllm --vllm-python .venv-vllm/bin/python --model small-llama \\
        --num-prompts 32 --input-len 32:256 --output-len 16:64 --sweep 1,2,4,8,16,inf \\
        --goodput ttft:1000 tpot:100 --plot docs/images/serve_vs_vllm.png

Both servers run at once on free 127.0.0.1 ports, each in its own session (benchmarks/server_procs.py),
loading the same Hugging Face folder with the same dtype, batch limits and KV budget, prefix caching
off; vLLM gets its documented CPU set-up (LD_PRELOAD of tcmalloc and the intel-openmp wheel's
libiomp5.so when present). The same `benchmarks.serve` client then sends the same streamed workload
at each offered rate of the sweep to one server after the other, the order rotating from point to
point so a drift in the machine's load favours neither. Per point: achieved throughput, TTFT / TPOT
/ ITL P50, P90, P99, goodput under the SLOs, and the CPU time other processes took meanwhile
(/proc/stat's busy time minus this client and both servers' sessions), labelled quiet or loaded.
Before the sweep both servers answer the same greedy prompts: the sanity line says whether they agree.
A time limit (`--time-limit-s`) skips the points that would not fit; Ctrl-C, SIGTERM or an error tears
both servers down with every process they forked.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Sequence

from benchmarks import serve
from benchmarks.measure import busy_seconds
from benchmarks.server_procs import ServerProcess, free_port

ROOT = Path(__file__).resolve().parent.parent
TCMALLOC = Path("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4")  # Debian's libtcmalloc-minimal4
QUIET_SHARE = 0.10  # a point is quiet when other processes took at most this share of the machine's CPU
DTYPES = ("float32", "bfloat16")


@dataclass
class Point:
    """One server at one offered rate: the load generator's summary and where the CPU time went."""

    server: str
    request_rate: float
    summary: dict[str, Any]
    wall_s: float
    client_cpu_s: float
    server_cpu_s: dict[str, float]
    other_cpu_s: float
    label: str


@dataclass
class Accounting:
    """CPU seconds over one timed stretch: the machine's busy time, this process's, each server's."""

    machine: float = 0.0
    client: float = 0.0
    servers: dict[str, float] = field(default_factory=dict)

    @staticmethod
    def read(servers: Sequence[ServerProcess]) -> "Accounting":
        machine, client = busy_seconds()
        return Accounting(machine, client, {s.name: s.cpu_seconds() for s in servers})

    def __sub__(self, before: "Accounting") -> "Accounting":
        return Accounting(self.machine - before.machine, self.client - before.client,
                          {k: v - before.servers[k] for k, v in self.servers.items()})

    @property
    def others(self) -> float:
        """What neither this client nor the servers used (clipped at 0: the counters tick separately)."""
        return max(0.0, self.machine - self.client - sum(self.servers.values()))


def load_label(other_cpu_s: float, wall_s: float, num_cpus: int, quiet_share: float = QUIET_SHARE) -> str:
    """'quiet' when other processes used at most `quiet_share` of the machine's CPU over `wall_s`."""
    if wall_s <= 0 or num_cpus < 1:
        raise ValueError(f"wall_s must be > 0 and num_cpus >= 1, got {wall_s} and {num_cpus}")
    return "quiet" if other_cpu_s <= quiet_share * wall_s * num_cpus else "loaded"


def rotation(names: Sequence[str], index: int) -> list[str]:
    """The order in which the servers take point `index`: rotated by one each point."""
    k = index % len(names)
    return list(names[k:]) + list(names[:k])


def schedule(names: Sequence[str], rates: Sequence[float]) -> list[tuple[str, float]]:
    """Every (server, rate) of the sweep in the order they run."""
    return [(name, rate) for i, rate in enumerate(rates) for name in rotation(names, i)]


def preloads(vllm_python: str) -> list[str]:
    """vLLM's documented CPU preloads that exist here: tcmalloc, then the intel-openmp wheel's libiomp5."""
    venv_lib = Path(vllm_python).parent.parent / "lib" / "libiomp5.so"
    return [str(p) for p in (TCMALLOC, venv_lib) if p.exists()]


def vllm_server(vllm_python: str, model_dir: Path, name: str, a: argparse.Namespace) -> ServerProcess:
    port = free_port()
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", VLLM_CPU_KVCACHE_SPACE=str(a.kv_cache_gib),
               VLLM_CPU_OMP_THREADS_BIND=os.environ.get("VLLM_CPU_OMP_THREADS_BIND", f"0-{os.cpu_count() - 1}"))
    if preloads(vllm_python):
        env["LD_PRELOAD"] = ":".join(preloads(vllm_python) + [p for p in [os.environ.get("LD_PRELOAD")] if p])
    # `vllm serve`'s server (run_server) through its module: the `vllm` CLI asks the package metadata for
    # "vllm", and this distribution is named vllm-cpu, so the CLI exits with PackageNotFoundError
    argv = [vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
            "--served-model-name", name, "--host", "127.0.0.1", "--port", str(port), "--dtype", a.dtype,
            "--max-num-seqs", str(a.max_num_seqs), "--max-num-batched-tokens", str(a.max_num_batched_tokens),
            "--no-enable-prefix-caching", "--seed", "0", "--disable-uvicorn-access-log"]
    return ServerProcess("vllm serve", argv, port, env=env, cwd=ROOT)


def engine_server(model_dir: Path, name: str, a: argparse.Namespace) -> ServerProcess:
    port = free_port()
    env = dict(os.environ)
    argv = [sys.executable, "-m", "engine_core.entrypoints.openai", "--model", str(model_dir),
            "--served-model-name", name, "--host", "127.0.0.1", "--port", str(port), "--device", "cpu",
            "--dtype", a.dtype, "--max-num-seqs", str(a.max_num_seqs),
            "--max-num-batched-tokens", str(a.max_num_batched_tokens),
            "--kv-cache-memory-bytes", str(int(a.kv_cache_gib * 2**30)), "--no-enable-prefix-caching",
            "--max-waiting-requests", str(max(256, a.num_prompts))]
    return ServerProcess("engine", argv, port, env=env, cwd=ROOT)


async def greedy_outputs(url: str, name: str, prompts: list[list[int]], max_tokens: int) -> list[dict[str, Any]]:
    """Each prompt's greedy completion (not streamed): its text and, where the server returns them, token ids."""
    import httpx2

    async with httpx2.AsyncClient(timeout=120.0) as client:
        outs = []
        for p in prompts:
            r = await client.post(f"{url}/v1/completions", json={
                "model": name, "prompt": p, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
                "return_token_ids": True})
            r.raise_for_status()
            choice = r.json()["choices"][0]
            outs.append({"text": choice["text"], "token_ids": choice.get("token_ids")})
        return outs


def common_prefix(a: Sequence[Any], b: Sequence[Any]) -> int:
    """How many leading items a and b share."""
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def greedy_check(outputs: dict[str, list[dict[str, Any]]]) -> str:
    """The sanity line: how many prompts got the same greedy output from every server, and (by token ids) the
    share of the first server's tokens every other one matched up to its first difference (bf16 rounds
    differently in two implementations, and one flipped argmax changes the rest of a greedy sequence)."""
    names = list(outputs)
    per_prompt = list(zip(*outputs.values()))
    with_ids = all(o["token_ids"] is not None for outs in per_prompt for o in outs)
    key = "token_ids" if with_ids else "text"
    same = sum(all(o[key] == outs[0][key] for o in outs) for outs in per_prompt)
    what = "token ids" if with_ids else "text (a server returned no token ids)"
    verdict = "OK" if same == len(per_prompt) else "MISMATCH"
    line = f"greedy sanity ({' vs '.join(names)}): {same}/{len(per_prompt)} prompts identical, compared by {what}"
    if with_ids:
        total = sum(len(outs[0]["token_ids"]) for outs in per_prompt)
        agree = sum(min(common_prefix(outs[0]["token_ids"], o["token_ids"]) for o in outs[1:]) for outs in per_prompt)
        line += f", {agree / max(total, 1):.1%} of tokens agree up to each first difference"
    return f"{line}: {verdict}"


def measure(server: ServerProcess, servers: Sequence[ServerProcess], name: str, w: tuple[list[list[int]], list[int]],
            rate: float, a: argparse.Namespace, slos: dict[str, float]) -> Point:
    before, t = Accounting.read(servers), time.perf_counter()
    results, duration = asyncio.run(serve.run(server.url, name, w[0], w[1], rate, a.max_concurrency,
                                              a.burstiness, a.seed, timeout_s=a.request_timeout_s))
    wall, used = time.perf_counter() - t, Accounting.read(servers) - before
    summary = serve.summarize(results, duration, slos)
    errors = sorted({r.error for r in results if not r.success})
    if errors:
        summary["errors"] = errors[:3]
    return Point(server.name, rate, summary, wall, used.client, used.servers, used.others,
                 load_label(used.others, wall, os.cpu_count() or 1))


def _ms(d: dict[str, float]) -> str:
    return " / ".join(f"{d[f'p{p}_ms']:.0f}" for p in serve.PERCENTILES)


def format_table(points: list[Point], num_cpus: int) -> str:
    """The markdown table docs/benchmarks.md takes, one row per (rate, server), in the order they ran; the
    label column adds the others' share of the machine's CPU over the point."""
    lines = ["| offered req/s | server | achieved req/s | output tok/s | TTFT P50 / P90 / P99 ms | "
             "TPOT P50 / P90 / P99 ms | ITL P50 / P90 / P99 ms | goodput req/s | failed | "
             "CPU s: this server / other server / client / others | quiet/loaded (others' share) |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for p in points:
        s = p.summary
        mine = p.server_cpu_s[p.server]
        other = sum(v for k, v in p.server_cpu_s.items() if k != p.server)
        goodput = f"{s['goodput']:.2f}" if "goodput" in s else "-"
        lines.append(f"| {p.request_rate:g} | {p.server} | {s['request_throughput']:.2f} | "
                     f"{s['output_throughput']:.1f} | {_ms(s['ttft'])} | {_ms(s['tpot'])} | {_ms(s['itl'])} | "
                     f"{goodput} | {s['failed']} | {mine:.1f} / {other:.1f} / {p.client_cpu_s:.1f} / "
                     f"{p.other_cpu_s:.1f} | {p.label} ({p.other_cpu_s / (p.wall_s * num_cpus):.0%}) |")
    return "\n".join(lines)


def run_summary(points: list[Point], num_cpus: int) -> str:
    """The run's line: wall time of the timed points, other processes' CPU over them, the label."""
    wall = sum(p.wall_s for p in points)
    others = sum(p.other_cpu_s for p in points)
    loaded = sum(p.label == "loaded" for p in points)
    label = load_label(others, wall, num_cpus) if wall > 0 else "none (no point ran)"
    return (f"run: {len(points)} timed points, {wall:.0f} s; other processes took {others:.0f} CPU s "
            f"({others / max(wall * num_cpus, 1e-9):.0%} of {num_cpus} cores); {loaded} of {len(points)} points "
            f"loaded (quiet: others <= {QUIET_SHARE:.0%}); this run is {label.upper()}")


def knee(points: list[Point], server: str, slos: dict[str, float]) -> str:
    """Where a server's goodput peaked (the highest throughput that still met the SLOs)."""
    mine = [p for p in points if p.server == server]
    if not mine or not slos:
        return f"{server}: -"
    best = max(mine, key=lambda p: p.summary["goodput"])
    return (f"{server}: goodput peaks at {best.summary['goodput']:.2f} req/s (offered {best.request_rate:g}/s, "
            f"achieved {best.summary['request_throughput']:.2f}); max achieved "
            f"{max(p.summary['request_throughput'] for p in mine):.2f} req/s")


class _Terminated(Exception):
    pass


def _on_sigterm(signum: int, frame: Any) -> None:
    raise _Terminated(f"signal {signum}")


@contextmanager
def torn_down() -> Iterator[list[ServerProcess]]:
    """A list for the servers as they start: every one is stopped, with every process of its session, on
    leaving, on an error, on Ctrl-C and on SIGTERM (`timeout`'s; raised as an exception so this runs).
    A second signal during the teardown is ignored rather than cutting it short."""
    servers: list[ServerProcess] = []
    previous = signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        yield servers
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        interrupt = signal.signal(signal.SIGINT, signal.SIG_IGN)
        for s in servers:
            try:
                s.stop()
            except Exception as e:  # the next server still gets its stop
                print(f"stopping {s.name} failed: {type(e).__name__}: {e}", file=sys.stderr)
        signal.signal(signal.SIGINT, interrupt)
        signal.signal(signal.SIGTERM, previous)


def main(argv: list[str] | None = None) -> list[Point]:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.serve_vs_vllm", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vllm-python", default=".venv-vllm/bin/python")
    ap.add_argument("--model", default="small-llama", help="a preset or an HF folder: both servers load its folder")
    ap.add_argument("--dtype", default="float32", choices=DTYPES)
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--input-len", default="32:256")
    ap.add_argument("--output-len", default="16:64")
    ap.add_argument("--vocab-size", type=int, default=256, help="prompt ids are drawn from [3, this)")
    ap.add_argument("--sweep", default="1,2,4,8,16,inf", help="offered request rates, one point each")
    ap.add_argument("--max-concurrency", type=int, default=None)
    ap.add_argument("--burstiness", type=float, default=1.0)
    ap.add_argument("--goodput", nargs="*", default=["ttft:1000", "tpot:100"], metavar="KEY:MS")
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--kv-cache-gib", type=int, default=1, help="KV cache GiB on each side (vLLM takes whole GiB)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--greedy-prompts", type=int, default=4, help="prompts of the greedy sanity check")
    ap.add_argument("--greedy-tokens", type=int, default=32)
    ap.add_argument("--startup-timeout-s", type=float, default=420.0, help="vLLM's first start compiles")
    ap.add_argument("--request-timeout-s", type=float, default=120.0)
    ap.add_argument("--time-limit-s", type=float, default=640.0,
                    help="seconds from the start: skip the points that would end past this")
    ap.add_argument("--plot", default=None, metavar="FILE.png")
    ap.add_argument("--result-file", default=None, metavar="FILE.json")
    a = ap.parse_args(argv)
    try:
        slos, rates = serve.parse_goodput(a.goodput), serve.parse_rates(a.sweep)
        prompts = serve.synthetic_workload(a.num_prompts, serve.parse_range(a.input_len),
                                           serve.parse_range(a.output_len), a.vocab_size, a.seed)
    except ValueError as e:
        ap.error(str(e))
    if not Path(a.vllm_python).exists():
        ap.error(f"--vllm-python {a.vllm_python!r} does not exist (make bench-serve-vllm builds .venv-vllm)")
    from engine_core.presets import resolve_model

    model_dir, name = resolve_model(a.model), "model"
    t0 = time.monotonic()
    points: list[Point] = []
    with torn_down() as servers:
        servers.append(engine_server(model_dir, name, a))
        servers.append(vllm_server(a.vllm_python, model_dir, name, a))
        for s in servers:
            print(f"{s.name}: healthy after {s.wait_healthy(a.startup_timeout_s):.0f} s on {s.url}", flush=True)
        print(f"model {a.model} ({model_dir}), {a.dtype}, max_num_seqs {a.max_num_seqs}, max_num_batched_tokens "
              f"{a.max_num_batched_tokens}, KV {a.kv_cache_gib} GiB, prefix caching off; vLLM preloads: "
              f"{', '.join(Path(p).name for p in preloads(a.vllm_python)) or 'none'}; {a.num_prompts} prompts, "
              f"input {a.input_len}, output {a.output_len}, sweep {a.sweep}, SLOs {' '.join(a.goodput)}", flush=True)
        check = [p[:64] for p in prompts[0][:a.greedy_prompts]]
        outs = {s.name: asyncio.run(greedy_outputs(s.url, name, check, a.greedy_tokens)) for s in servers}
        print(greedy_check(outs), flush=True)
        warm = serve.synthetic_workload(8, (8, 64), (4, 16), a.vocab_size, a.seed + 1)
        for s in servers:  # untimed: first-use costs out of the first point
            asyncio.run(serve.run(s.url, name, warm[0], warm[1], float("inf"), timeout_s=a.request_timeout_s))
        by_name = {s.name: s for s in servers}
        order = schedule([s.name for s in servers], rates)
        for k, (server, rate) in enumerate(order):
            elapsed = time.monotonic() - t0
            done = [p.wall_s for p in points]
            estimate = max(done[-len(servers):]) if done else 0.0
            if elapsed + estimate > a.time_limit_s:
                print(f"time limit {a.time_limit_s:.0f} s: skipped the last {len(order) - k} points", flush=True)
                break
            p = measure(by_name[server], servers, name, prompts, rate, a, slos)
            points.append(p)
            print(f"[{k + 1}/{len(order)}] {server:10s} rate {rate:g}: {p.summary['request_throughput']:.2f} req/s, "
                  f"TTFT P99 {p.summary['ttft']['p99_ms']:.0f} ms, TPOT P99 {p.summary['tpot']['p99_ms']:.0f} ms, "
                  f"others {p.other_cpu_s:.1f} CPU s ({p.label}) {p.summary.get('errors', '')}", flush=True)
    print()
    print(format_table(points, os.cpu_count() or 1))
    print()
    for s in ("engine", "vllm serve"):
        print(knee(points, s, slos))
    print(run_summary(points, os.cpu_count() or 1))
    if a.result_file:  # first: a failing plot must not lose the numbers
        Path(a.result_file).write_text(json.dumps({"args": vars(a), "points": [p.__dict__ for p in points]}, indent=1))
    if a.plot and points:
        from benchmarks.serve_plot import plot_side_by_side

        others, wall = sum(p.other_cpu_s for p in points), sum(p.wall_s for p in points)
        plot_side_by_side(points, slos, a.plot, title=f"{a.model}, {a.dtype}, "
                          f"{load_label(others, wall, os.cpu_count() or 1)} (others {others:.0f} CPU s in {wall:.0f} s)")
        print(f"wrote {a.plot}")
    return points


if __name__ == "__main__":
    main()
