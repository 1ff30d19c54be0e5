"""`python -m benchmarks.pp_overlap`: pipeline_parallel_size=2 on CPU (two worker processes, gloo, fp32) with
vLLM's batch queue (two steps in flight: stage 0 runs step n + 1 while stage 1 runs step n) and without it
(one step at a time: the stages take turns). One engine, the two settings alternated round by round (the
same processes, warm), greedy, `--requests` prompts of `--prompt-len` tokens and `--max-tokens` outputs each,
a token budget (`--max-num-batched-tokens`) below the running requests' decodes, so a step's batch is part of
them and the queue has a second batch to keep in flight (with one batch holding every running request the
batch queue has nothing to overlap: the requests in flight cannot be scheduled again).
Prints each round's output tokens per second and the medians. On a 2-core machine shared with other jobs the
two stages compete for the cores with each other and with the engine process: expect little overlap."""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from engine_core import LLM, SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="small-llama")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--max-num-seqs", type=int, default=16)
    ap.add_argument("--max-num-batched-tokens", type=int, default=8,
                    help="below the decodes of all running requests, so a step's batch is part of them")
    args = ap.parse_args()
    llm = LLM(args.model, pipeline_parallel_size=2, dtype="float32", max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens, enable_chunked_prefill=True)
    try:
        g = torch.Generator().manual_seed(0)
        vocab = llm.engine.vocab_size
        prompts = [torch.randint(3, vocab, (args.prompt_len,), generator=g).tolist() for _ in range(args.requests)]
        params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
        llm.generate(prompts[:2], params, use_tqdm=False)  # warm-up
        rates: dict[int, list[float]] = {1: [], 2: []}
        tokens: dict[int, list[list[int]]] = {}
        for r in range(args.rounds):
            for depth in ((1, 2) if r % 2 == 0 else (2, 1)):  # alternate which goes first
                llm.engine.batch_queue_size = depth
                t0 = time.perf_counter()
                outs = llm.generate(prompts, params, use_tqdm=False)
                seconds = time.perf_counter() - t0
                tokens[depth] = [o.outputs[0].token_ids for o in outs]
                rates[depth].append(sum(map(len, tokens[depth])) / seconds)
                print(f"round {r} batch_queue_size={depth}: {rates[depth][-1]:.1f} tok/s", flush=True)
        if tokens[1] != tokens[2]:
            raise SystemExit("the batch queue changed the greedy tokens")
        print(f"max_batches_in_flight={llm.engine.stats()['max_batches_in_flight']}")
        for depth, name in ((1, "one step at a time"), (2, "batch queue (2 in flight)")):
            print(f"PP=2 {name}: median {statistics.median(rates[depth]):.1f} tok/s "
                  f"(rounds: {', '.join(f'{x:.1f}' for x in rates[depth])})")
    finally:
        llm.shutdown()


if __name__ == "__main__":
    main()
