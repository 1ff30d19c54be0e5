"""`make bench-spec`: speculative decoding against plain decoding on the real model, batch 1 to 64.

    python -m benchmarks.spec_decode --model smollm2-135m-instruct --batch-sizes 1,4,16,64 \
        --plot docs/images/spec_decode_speedup.png

Two workloads, greedy, `max_tokens` output tokens per request (ignore_eos, so both runs do the same work):
- "repetitive": chat prompts asking the model to copy a given passage with a small edit, where prompt
  lookup (method "ngram") finds the continuation in the prompt;
- "open-ended": chat prompts asking for a story, an explanation, a list, where it rarely does.

Per workload and batch: output tokens/s and mean TPOT (time per output token after a request's first)
with and without speculation, the speedup, acceptance per draft position, alpha (the first position's
rate), the measured mean acceptance length (1 + accepted / drafts) next to the i.i.d. prediction
E = (1 - alpha^(k+1)) / (1 - alpha), and the CPU seconds other processes used during each run (from
/proc/stat, `benchmarks.measure.busy_seconds`): a run is "loaded" when that exceeds 0.1 CPU on
average, "quiet" otherwise. The runs with and without speculation alternate in one process (two
engines built once), and the outputs are checked equal (greedy is exact), so a speedup never comes
from computing something else.

The step-cost model: every decode-only step's wall time against its query rows (drafts included) and
its speculating requests, over all runs, fitted by least squares as t = a + b * rows + c * drafting:
a the fixed per-step cost (Python, weight reads), b the cost of a query row, c the extra cost of a
request that speculates (its rows take the varlen attention path instead of the batched decode op,
its verdict the rejection sampler). With L the tokens a decoding request gets per step under
speculation, d its draft rows per step and s the share of its steps that speculate (all measured per
workload), the model predicts speedup(B) = L (a + b B) / (a + b B (1 + d) + c B s), below 1 from
B* = a (L - 1) / (b (1 + d - L) + c s): speculation amortises a, and multiplies b and c. B* is printed
next to the batch where the measured speedup crosses 1.

`--method draft_model` drafts with a draft model (`--draft-model`, default "<model>-draft").
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from benchmarks.measure import busy_seconds
from engine_core.engine import LLMEngine
from engine_core.request import SamplingParams

LOADED = 0.1  # other processes' CPUs busy on average above which a run is labelled "loaded"

PASSAGES = [
    "The old lighthouse stood at the edge of the cliff for more than a century. Every night its keeper climbed "
    "the narrow stairs, trimmed the wick and polished the great lens, so that ships passing in the dark would "
    "know where the rocks began.",
    "To make bread, mix flour, water, salt and yeast into a dough. Knead it for ten minutes until it is smooth, "
    "let it rise in a warm place for an hour, shape it into a loaf, and bake it in a hot oven until the crust "
    "is brown.",
    "The meeting is moved from Tuesday to Thursday at three in the afternoon. Please bring the quarterly report, "
    "the list of open questions from last month, and any ideas for the new office layout.",
    "Rivers carry water from the mountains to the sea. Along the way they cut valleys, move sand and stones, "
    "and feed the farms and cities built on their banks. Many rivers flood in spring when the snow melts.",
    "Our library opens at nine in the morning and closes at eight in the evening. Books can be borrowed for "
    "three weeks and renewed twice. Late returns cost ten cents a day, and lost books must be replaced.",
    "The train to the coast leaves from platform four every hour. The journey takes ninety minutes, with stops "
    "at the river town, the market town and the old harbour. Tickets are cheaper before seven in the morning.",
    "A good night of sleep helps the body recover and the mind remember. Adults need seven to nine hours, "
    "children more. Going to bed at the same time every day and avoiding screens late at night both help.",
    "The garden has three beds of vegetables, a row of apple trees and a small pond. In summer the beans and "
    "tomatoes grow fast, and the pond is full of frogs. In winter everything rests under the frost.",
]
EDITS = ["Copy the following text exactly, word for word:", "Repeat this text without changing anything:",
         "Rewrite the following text, keeping every sentence as it is:", "Fix any typos in this text and return it:",
         "Return this text unchanged:", "Write out the following paragraph again:",
         "Copy this text and keep its punctuation:", "Repeat the paragraph below exactly:"]
TOPICS = ["a dragon who is afraid of fire", "how volcanoes form", "a robot learning to paint", "why the sky is blue",
          "a city under the sea", "how a bicycle works", "the first day at a new school", "why leaves change colour",
          "a detective cat", "how airplanes fly", "a journey to the moon", "how bees make honey",
          "a lost key", "how rain forms", "a talking tree", "how computers store numbers"]
FORMS = ["Write a short story about {}.", "Explain {} to a child.", "Write a poem about {}.",
         "Give me five interesting facts about {}."]


def workload(name: str, batch: int) -> list[list[dict]]:
    """`batch` distinct chat conversations of workload `name` (at most 64)."""
    if name == "repetitive":
        texts = [f"{EDITS[i // len(PASSAGES) % len(EDITS)]}\n\n{PASSAGES[i % len(PASSAGES)]}" for i in range(batch)]
    else:
        texts = [FORMS[i // len(TOPICS) % len(FORMS)].format(TOPICS[i % len(TOPICS)]) for i in range(batch)]
    return [[{"role": "user", "content": t}] for t in texts]


def tokenize(engine: LLMEngine, conversations: list[list[dict]]) -> list[list[int]]:
    tok = engine.tokenizer
    return [tok.encode(tok.apply_chat_template(c, tokenize=False, add_generation_prompt=True), add_special_tokens=False)
            for c in conversations]


def timed_run(engine: LLMEngine, prompts: list[list[int]], max_tokens: int, tag: str) -> dict:
    """Generate `prompts` greedily; per step (wall time, query rows, decode-only?), per request TPOT."""
    sched = engine.scheduler
    schedule, last = sched.schedule, {}

    def recording_schedule():
        out = schedule()
        last["rows"] = out.total_num_scheduled_tokens
        last["decode"] = all(c.num_tokens == 1 for c in out.scheduled)
        last["drafting"] = len(out.scheduled_spec_decode_tokens)
        return out

    sched.schedule = recording_schedule
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", p, params)
    before = sched.make_stats()
    machine0, own0 = busy_seconds()
    steps, first, done, outs = [], {}, {}, {}
    t0 = time.perf_counter()
    try:
        while engine.has_unfinished_requests():
            t = time.perf_counter()
            step_outs = engine.step()
            now = time.perf_counter()
            if last.get("rows"):
                steps.append((now - t, last["rows"], last["decode"], last["drafting"]))
            for o in step_outs:
                n = len(o.outputs[0].token_ids)
                if n and o.request_id not in first:
                    first[o.request_id] = (now, n)
                if o.finished:
                    done[o.request_id] = now
                    outs[o.request_id] = list(o.outputs[0].token_ids)
    finally:
        sched.schedule = schedule
    wall = time.perf_counter() - t0
    machine1, own1 = busy_seconds()
    after = sched.make_stats()
    old = before.spec_decode_num_accepted_tokens_per_pos
    per_pos = [n - (old[j] if j < len(old) else 0) for j, n in enumerate(after.spec_decode_num_accepted_tokens_per_pos)]
    tpot = [(done[r] - first[r][0]) / (len(outs[r]) - first[r][1]) for r in outs if len(outs[r]) > first[r][1]]
    return {"wall": wall, "other_cpu": max(0.0, (machine1 - machine0) - (own1 - own0)),
            "outputs": [outs[f"{tag}-{i}"] for i in range(len(prompts))], "steps": steps,
            "tpot": statistics.mean(tpot) if tpot else 0.0,
            "drafts": after.spec_decode_num_drafts - before.spec_decode_num_drafts,
            "draft_tokens": after.spec_decode_num_draft_tokens - before.spec_decode_num_draft_tokens,
            "per_pos": per_pos}


def fit_step_cost(steps: list[tuple[float, int, bool, int]]) -> tuple[float, float, float]:
    """Least-squares (a, b, c) of t = a + b * rows + c * drafting over the decode-only steps."""
    pts = [(1.0, rows, drafting, dt) for dt, rows, decode, drafting in steps if decode]
    x = torch.tensor([p[:3] for p in pts], dtype=torch.float64)
    y = torch.tensor([p[3] for p in pts], dtype=torch.float64)
    a, b, c = torch.linalg.lstsq(x, y[:, None]).solution[:, 0].tolist()
    return a, b, c


def predicted_speedup(cost: tuple[float, float, float], shape: tuple[float, float, float], batch: float) -> float:
    (a, b, c), (L, d, s) = cost, shape
    return L * (a + b * batch) / (a + b * batch * (1 + d) + c * batch * s)


def break_even(cost: tuple[float, float, float], shape: tuple[float, float, float]) -> float | None:
    """The batch B* where predicted_speedup falls to 1 (None: never; 0: never above 1, no draft accepted)."""
    (a, b, c), (L, d, s) = cost, shape
    denominator = b * (1 + d - L) + c * s
    if L <= 1:
        return 0.0
    if denominator <= 0:
        return None
    return a * (L - 1) / denominator


def measured_crossing(batches: list[int], speedups: list[float]) -> str:
    """The batch where the measured speedup falls through 1 (log-linear between measured batches)."""
    import math
    if speedups[0] < 1:
        return f"< {batches[0]}"
    for (b0, s0), (b1, s1) in zip(zip(batches, speedups), zip(batches[1:], speedups[1:])):
        if s1 < 1 <= s0:
            f = (s0 - 1) / (s0 - s1)
            return f"{math.exp(math.log(b0) + f * (math.log(b1) - math.log(b0))):.0f}"
    return f"> {batches[-1]}"


def plot(path: str, results: dict, batches: list[int], cost: tuple[float, float, float], model: dict,
         title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    xs = [batches[0] * (batches[-1] / batches[0]) ** (i / 100) for i in range(101)]
    for (name, rows), color in zip(results.items(), ("tab:blue", "tab:orange")):
        ax.plot(batches, [r["speedup"] for r in rows], "o-", color=color, label=f"{name}: measured")
        L, d, s = model[name]
        ax.plot(xs, [predicted_speedup(cost, model[name], x) for x in xs], "--", color=color,
                label=f"{name}: step-cost model (L={L:.2f}, d={d:.2f}, s={s:.2f})")
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xticks(batches, [str(x) for x in batches])
    ax.set_xlabel("batch (concurrent requests)")
    ax.set_ylabel("speedup (tokens/s with / without)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=100)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--batch-sizes", default="1,4,16,64")
    ap.add_argument("--workloads", default="repetitive,open-ended")
    ap.add_argument("--method", choices=("ngram", "draft_model"), default="ngram")
    ap.add_argument("--draft-model", default=None, help="with --method draft_model; default: <model>-draft")
    ap.add_argument("--num-speculative-tokens", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--plot", default=None, help="write the speedup-vs-batch PNG here")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    k = args.num_speculative_tokens
    batches = [int(x) for x in args.batch_sizes.split(",")]
    spec = {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
    if args.method == "draft_model":
        spec = {"method": "draft_model", "num_speculative_tokens": k, "model": args.draft_model or f"{args.model}-draft"}
    common = dict(max_model_len=512, max_num_batched_tokens=2048, max_num_seqs=max(batches),
                  kv_cache_memory_bytes=2**29, swap_space=0)  # 11k tokens each: batch 64 fits, no swap pool
    engines = {"plain": LLMEngine.from_kwargs(args.model, **common),
               "spec": LLMEngine.from_kwargs(args.model, speculative_config=spec, **common)}
    for e in engines.values():  # warm-up
        timed_run(e, tokenize(e, workload("open-ended", 2)), 4, "warm")
    print(f"model {args.model}, {args.method} {spec.get('model', '')} k={k}, {args.max_tokens} greedy output tokens "
          f"per request, torch threads {args.threads}; other CPU = CPU-seconds other processes used per second of "
          f"the run (> {LOADED}: loaded)")
    print(f"{'workload':>10} {'batch':>5} {'plain tok/s':>11} {'spec tok/s':>10} {'speedup':>7} {'TPOT ms':>13} "
          f"{'alpha':>5} {'mean len':>8} {'E pred':>6} {'steps':>7} {'other CPU':>15}  accepted per position")
    results: dict[str, list[dict]] = {}
    all_steps: list[tuple[float, int, bool, int]] = []
    model: dict[str, tuple[float, float, float]] = {}
    for w in args.workloads.split(","):
        results[w] = []
        acc = {"tokens": 0, "req_steps": 0, "draft_tokens": 0, "drafts": 0}
        for i, batch in enumerate(batches):
            prompts = tokenize(engines["plain"], workload(w, batch))
            order = ("plain", "spec") if i % 2 == 0 else ("spec", "plain")  # alternate which runs first
            runs = {name: timed_run(engines[name], prompts, args.max_tokens, f"{w}-{batch}-{name}") for name in order}
            plain, sp = runs["plain"], runs["spec"]
            if plain["outputs"] != sp["outputs"]:
                raise SystemExit(f"{w} batch {batch}: greedy outputs differ with speculation (a bug)")
            all_steps += plain["steps"] + sp["steps"]
            n = batch * args.max_tokens
            # L and d: over the speculative run's decode steps (first tokens come from prefill steps)
            decode_req_steps = sum(rows for dt, rows, dec, _ in sp["steps"] if dec) - sp["draft_tokens"]
            acc["tokens"] += n - batch
            acc["req_steps"] += decode_req_steps
            acc["draft_tokens"] += sp["draft_tokens"]
            acc["drafts"] += sp["drafts"]
            drafts = max(sp["drafts"], 1)
            alpha = sp["per_pos"][0] / drafts if sp["per_pos"] else 0.0
            predicted = (1 - alpha ** (k + 1)) / (1 - alpha) if alpha < 1 else k + 1
            mean_len = 1 + sum(sp["per_pos"]) / drafts if sp["drafts"] else 0.0
            row = {"batch": batch, "plain": n / plain["wall"], "spec": n / sp["wall"],
                   "speedup": plain["wall"] / sp["wall"], "tpot": (plain["tpot"], sp["tpot"]), "alpha": alpha,
                   "mean_len": mean_len, "predicted": predicted, "per_pos": [x / drafts for x in sp["per_pos"]],
                   "steps": (len(plain["steps"]), len(sp["steps"])),
                   "other": (plain["other_cpu"] / plain["wall"], sp["other_cpu"] / sp["wall"])}
            results[w].append(row)
            label = "loaded" if max(row["other"]) > LOADED else "quiet"
            print(f"{w:>10} {batch:>5} {row['plain']:>11.1f} {row['spec']:>10.1f} {row['speedup']:>6.2f}x "
                  f"{row['tpot'][0] * 1e3:>6.0f}/{row['tpot'][1] * 1e3:<6.0f} {alpha:>5.2f} {mean_len:>8.2f} "
                  f"{predicted:>6.2f} {row['steps'][0]:>3}/{row['steps'][1]:<3} "
                  f"{row['other'][0]:>4.2f}/{row['other'][1]:.2f} {label:<6}  "
                  + " ".join(f"{x:.2f}" for x in row["per_pos"]), flush=True)
        n_steps = max(acc["req_steps"], 1)
        model[w] = (acc["tokens"] / n_steps, acc["draft_tokens"] / n_steps, acc["drafts"] / n_steps)
    cost = fit_step_cost(all_steps)
    print(f"\nstep-cost model over {sum(1 for s in all_steps if s[2])} decode-only steps: t = {cost[0] * 1e3:.1f} ms "
          f"+ {cost[1] * 1e3:.2f} ms * rows + {cost[2] * 1e3:.2f} ms * drafting requests")
    print(f"{'workload':>10} {'L tokens/step':>13} {'d drafts/step':>13} {'s drafting':>10} "
          f"{'predicted break-even batch':>26} {'measured':>8}")
    for w, rows in results.items():
        L, d, s = model[w]
        be = break_even(cost, model[w])
        shown = "never" if be is None else "< 1 (L <= 1)" if be == 0 else f"{be:.0f}"
        print(f"{w:>10} {L:>13.2f} {d:>13.2f} {s:>10.2f} {shown:>26} "
              f"{measured_crossing([r['batch'] for r in rows], [r['speedup'] for r in rows]):>8}")
    if args.plot:
        loaded = any(max(r["other"]) > LOADED for rows in results.values() for r in rows)
        plot(args.plot, results, batches, cost, model,
             f"{args.model}, {args.method} k={k}, CPU {args.threads} thread(s), {'loaded' if loaded else 'quiet'}")
        print(f"plot: {args.plot}")


if __name__ == "__main__":
    main()
