"""`make bench-spec`: n-gram speculative decoding against plain decoding, greedy, on a repetitive workload.

`--method draft_model` drafts with a draft model instead (`--draft-model`, default the model's
"<model>-draft" preset, e.g. smollm2-135m-instruct-draft), which runs one request at a time
(engine_core/worker/draft_model.py): its acceptance numbers are real, its CPU wall time is not a speedup.

Each request's prompt is a random passage repeated (an "edit this text" workload, where prompt lookup
finds the continuation). Reported per batch size: output tokens/s with and without speculation, the
speedup, the measured first-draft acceptance rate alpha, the measured mean acceptance length (tokens per
verify step, 1 + accepted / drafts) and the prediction (1 - alpha^(k+1)) / (1 - alpha) for i.i.d.
acceptance at rate alpha with k drafts each step, and the engine steps each run took (the drafts count
only where the n-gram lookup found a match). The outputs with and without speculation are checked equal
(greedy is exact), so a speedup never comes from computing something else. The presets have random
weights: their greedy output repeats itself only sometimes, so the drafts hit less often than on a
trained model copying its prompt; the wall times are single runs on a shared CPU.
"""
from __future__ import annotations

import argparse
import random
import time

from engine_core import LLM, SamplingParams


def workload(batch: int, passage_len: int, repeats: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    prompts = []
    for _ in range(batch):
        passage = [rng.randrange(3, vocab) for _ in range(passage_len)]
        prompts.append(passage * repeats)
    return prompts


def run(model: str, prompts: list[list[int]], max_tokens: int, spec: dict | None) -> tuple[float, list[list[int]], dict]:
    llm = LLM(model, speculative_config=spec, max_model_len=1024, max_num_batched_tokens=2048)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    llm.generate(prompts[:1], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True), use_tqdm=False)  # warm-up
    before = llm.engine.scheduler.make_stats()  # the warm-up's counts, subtracted
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - t0
    after = llm.engine.scheduler.make_stats()
    drafts = after.spec_decode_num_drafts - before.spec_decode_num_drafts
    old = before.spec_decode_num_accepted_tokens_per_pos
    per_pos = [n - (old[j] if j < len(old) else 0) for j, n in enumerate(after.spec_decode_num_accepted_tokens_per_pos)]
    return wall, [o.outputs[0].token_ids for o in outs], {
        "steps": after.num_steps - before.num_steps, "drafts": drafts, "per_pos": per_pos,
        "mean_len": 1 + sum(per_pos) / drafts if drafts else 0.0}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="small-llama")
    ap.add_argument("--batch-sizes", default="1,4,16")
    ap.add_argument("--method", choices=("ngram", "draft_model"), default="ngram")
    ap.add_argument("--draft-model", default=None, help="with --method draft_model; default: <model>-draft")
    ap.add_argument("--num-speculative-tokens", type=int, default=3)
    ap.add_argument("--passage-len", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    k = args.num_speculative_tokens
    spec = {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 1, "prompt_lookup_max": 4}
    if args.method == "draft_model":
        spec = {"method": "draft_model", "num_speculative_tokens": k, "model": args.draft_model or f"{args.model}-draft"}
    print(f"model {args.model}, {args.method} {spec.get('model', '')}, k={k}, prompts: a {args.passage_len}-token passage x {args.repeats}, "
          f"{args.max_tokens} output tokens, greedy")
    print(f"{'batch':>5} {'plain tok/s':>11} {'spec tok/s':>10} {'speedup':>7} {'alpha':>6} "
          f"{'mean len':>8} {'predicted':>9} {'drafts':>6} {'steps':>9}  accepted per position")
    for batch in (int(b) for b in args.batch_sizes.split(",")):
        prompts = workload(batch, args.passage_len, args.repeats, 512, args.seed)
        wall_plain, plain, st_plain = run(args.model, prompts, args.max_tokens, None)
        wall_spec, outs, st = run(args.model, prompts, args.max_tokens, spec)
        if outs != plain:
            raise SystemExit(f"batch {batch}: greedy outputs differ with speculation (a bug)")
        n = batch * args.max_tokens
        drafts = max(st["drafts"], 1)
        alpha = st["per_pos"][0] / drafts if st["per_pos"] else 0.0
        predicted = (1 - alpha ** (k + 1)) / (1 - alpha) if alpha < 1 else k + 1
        rates = " ".join(f"{a / drafts:.2f}" for a in st["per_pos"])
        print(f"{batch:>5} {n / wall_plain:>11.1f} {n / wall_spec:>10.1f} {wall_plain / wall_spec:>6.2f}x "
              f"{alpha:>6.2f} {st['mean_len']:>8.2f} {predicted:>9.2f} {st['drafts']:>6} "
              f"{st_plain['steps']:>4}/{st['steps']:<4}  {rates}")


if __name__ == "__main__":
    main()
