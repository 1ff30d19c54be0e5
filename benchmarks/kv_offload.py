"""`python -m benchmarks.kv_offload`: a returning session's time to first token with the CPU offload tier
(`kv_offload_bytes`): recompute (no tier), load (the copy back starts when the request arrives, the step that admits
it waits for it) and prefetch (a client hint while another request decodes: the copy overlaps its steps).

One round per mode, modes alternating (`--rounds` rounds, medians printed): a session's `--prompt-len`-token prompt
runs; another session's prompt of the same length then takes the device cache (`num_gpu_blocks` holds one of
them), so the first session's blocks leave it; a short request decodes `--decode-tokens` tokens (the prefetch hint
comes when it starts); then the first session returns with its prompt and `--new-tokens` more. TTFT: from
`add_request` to the first token. Also printed: the prefix-cache hits and the blocks loaded, how long steps waited
for copies (the copy a prefetch hides), and the short request's decode time (the copy thread shares the CPU with
it, so the overlap is not free on a 2-core machine)."""
from __future__ import annotations

import argparse
import statistics
import time

import torch

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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--new-tokens", type=int, default=40)
    ap.add_argument("--decode-tokens", type=int, default=48)
    ap.add_argument("--tier-mib", type=int, default=256)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)

    def ids(n: int) -> list[int]:
        return torch.randint(3, 40000, (n,), generator=g).tolist()

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
