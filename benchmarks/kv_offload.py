"""`python -m benchmarks.kv_offload`: a returning session's time to first token with the CPU offload tier
(`kv_offload_bytes`): recompute (no tier), load (the copy back starts when the request arrives, the step that admits
it waits for it) and prefetch (a client hint while another request decodes: the copy overlaps its steps).

One round per mode, modes alternating (`--rounds` rounds, medians printed): a session's `--prompt-len`-token prompt
runs; another session's prompt of the same length then takes the device cache (`num_gpu_blocks` holds one of
them), so the first session's blocks leave it; a short request decodes `--decode-tokens` tokens (the prefetch hint
comes when it starts); then the first session returns with its prompt and `--new-tokens` more. TTFT: from
`add_request` to the first token. Also printed: the prefix-cache hits and the blocks loaded, how long steps waited
for copies (the copy a prefetch hides), and the short request's decode time (the copy thread shares the CPU with
it, so the overlap is not free on a 2-core machine).

`--server`: the same returning session through the OpenAI server (`python -m engine_core.entrypoints.openai`, one
on 127.0.0.1 with `--kv-offload-bytes`, one without), the real `openai` client streaming the returning request;
TTFT: from sending it to its first streamed chunk. Recompute vs load only: the server has no prefetch hint (nor
has vLLM's), so a client cannot start a copy ahead of its request. Fresh prompts each round, the two servers in
turn."""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import urllib.request

import openai
import torch

from benchmarks.measure import machine_busy_seconds, tree_cpu_seconds
from benchmarks.server_procs import ServerProcess, free_port
from engine_core import LLMEngine, SamplingParams


def returning_session(args: argparse.Namespace, mode: str, prompts: dict[str, list[int]]) -> dict[str, float]:
    offload = 0 if mode == "recompute" else args.tier_mib << 20
    blocks = -(-(args.prompt_len + 8) // 16) + 8
    engine = LLMEngine.from_kwargs(args.model, device="cpu", enable_prefix_caching=True, block_size=16,
                                   num_gpu_blocks=blocks, kv_offload_bytes=offload)
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    try:
        def run(rid: str, prompt: list[int], params: SamplingParams, hint: list[int] | None = None) -> float:
            t0 = time.perf_counter()
            engine.add_request(rid, {"prompt_token_ids": prompt}, params)
            first = None
            while engine.has_unfinished_requests():
                outs = engine.step()
                if hint is not None:
                    engine.prefetch({"prompt_token_ids": hint})
                    hint = None
                if first is None and any(o.request_id == rid and o.outputs[0].token_ids for o in outs):
                    first = time.perf_counter() - t0
            return first if first is not None else float("nan")

        run("s1", prompts["session"], greedy)
        run("o1", prompts["other"], greedy)
        t0 = time.perf_counter()
        run("o2", prompts["short"], SamplingParams(max_tokens=args.decode_tokens, temperature=0.0, ignore_eos=True),
            hint=prompts["returning"] if mode == "prefetch" else None)
        decode_s = time.perf_counter() - t0
        ttft = run("s2", prompts["returning"], greedy)
        stats = engine.stats()
        return {"ttft_s": ttft, "decode_s": decode_s, "prefix_hits": stats["prefix_cache_hits"],
                "loaded": stats.get("kv_offload_loaded_blocks", 0),
                "load_wait_s": stats.get("kv_offload_load_wait_s", 0.0)}
    finally:
        engine.shutdown()


def server_sessions(args: argparse.Namespace, ids) -> None:
    """Recompute vs load through the HTTP server (see the module's docstring); prints the medians."""
    blocks = -(-(args.prompt_len + 8) // 16) + 8
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), TOKENIZERS_PARALLELISM="false")
    servers: dict[str, ServerProcess] = {}
    busy0, wall0 = machine_busy_seconds(), time.perf_counter()
    try:
        for mode, tier in (("recompute", 0), ("load", args.tier_mib << 20)):
            port = free_port()
            servers[mode] = ServerProcess(f"kv-offload {mode}", [
                sys.executable, "-m", "engine_core.entrypoints.openai", "--model", args.model, "--port", str(port),
                "--device", "cpu", "--enable-prefix-caching", "--block-size", "16", "--num-gpu-blocks", str(blocks),
                "--kv-offload-bytes", str(tier)], port, env=env)
        for server in servers.values():
            server.wait_healthy(180)
        clients = {m: openai.OpenAI(base_url=f"{s.url}/v1", api_key="none", max_retries=0, timeout=120)
                   for m, s in servers.items()}
        ttft: dict[str, list[float]] = {m: [] for m in servers}
        for r in range(args.rounds):
            session, other = ids(args.prompt_len), ids(args.prompt_len)
            returning = session + ids(args.new_tokens)
            for mode, client in clients.items():
                for prompt in (session, other):
                    client.completions.create(model=args.model, prompt=prompt, max_tokens=8, temperature=0.0,
                                              extra_body={"ignore_eos": True})
                t0 = time.perf_counter()
                stream = client.completions.create(model=args.model, prompt=returning, max_tokens=8,
                                                   temperature=0.0, stream=True, extra_body={"ignore_eos": True})
                first = None
                for chunk in stream:
                    if first is None and chunk.choices:
                        first = time.perf_counter() - t0
                ttft[mode].append(first if first is not None else float("nan"))
                print(f"round {r + 1} {mode:9s} ttft_s {ttft[mode][-1]:.3f}", flush=True)
        metrics = servers["load"].url + "/metrics"
        with urllib.request.urlopen(metrics, timeout=10) as f:
            counters = {line.split()[0].split(":")[1]: float(line.split()[1]) for line in f.read().decode().splitlines()
                        if line.startswith("inference_labs:kv_offload_")}
        wall = time.perf_counter() - wall0
        others = machine_busy_seconds() - busy0 - tree_cpu_seconds([s.proc.pid for s in servers.values()])
    finally:
        for server in servers.values():
            server.stop()
    print(f"\n{args.model} through the OpenAI server, returning prompt {len(returning)} tokens, streamed, "
          f"OMP_NUM_THREADS={args.threads}, median of {args.rounds}:")
    for mode, runs in ttft.items():
        print(f"  {mode:9s} TTFT {1e3 * statistics.median(runs):8.1f} ms")
    print(f"  load server's tier: {counters['kv_offload_hit_blocks']:.0f} blocks hit, "
          f"{counters['kv_offload_loaded_blocks']:.0f} loaded, {counters['kv_offload_failed_loads']:.0f} failed")
    print(f"  other processes took {others:.1f} CPU s of {wall:.1f} s wall ({os.cpu_count()} CPUs)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--new-tokens", type=int, default=40)
    ap.add_argument("--decode-tokens", type=int, default=48)
    ap.add_argument("--tier-mib", type=int, default=256)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--server", action="store_true", help="through the OpenAI server: recompute vs load")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)

    def ids(n: int) -> list[int]:
        return torch.randint(3, 40000, (n,), generator=g).tolist()

    if args.server:
        server_sessions(args, ids)
        return
    session = ids(args.prompt_len)
    prompts = {"session": session, "other": ids(args.prompt_len), "short": ids(32),
               "returning": session + ids(args.new_tokens)}
    results: dict[str, list[dict[str, float]]] = {"recompute": [], "load": [], "prefetch": []}
    for r in range(args.rounds):
        for mode in results:
            results[mode].append(returning_session(args, mode, prompts))
            print(f"round {r + 1} {mode:9s} " + " ".join(f"{k} {v:.3f}" for k, v in results[mode][-1].items()),
                  flush=True)
    print(f"\n{args.model}, returning prompt {len(prompts['returning'])} tokens, {args.threads} threads, "
          f"median of {args.rounds}:")
    for mode, runs in results.items():
        print(f"  {mode:9s} TTFT {1e3 * statistics.median(x['ttft_s'] for x in runs):8.1f} ms   "
              f"short request's decode {1e3 * statistics.median(x['decode_s'] for x in runs):8.1f} ms   "
              f"prefix hits {runs[-1]['prefix_hits']:.0f} tokens, blocks loaded {runs[-1]['loaded']:.0f}, "
              f"steps waited {1e3 * statistics.median(x['load_wait_s'] for x in runs):.1f} ms for copies")


if __name__ == "__main__":
    main()
