"""Load generator for an OpenAI-compatible server (in the spirit of `vllm bench serve`).

    python -m benchmarks.serve --base-url http://127.0.0.1:8000 --model small-llama \\
        --num-prompts 64 --input-len 32:256 --output-len 16:128 --request-rate 4 \\
        --goodput ttft:500 tpot:50

Requests arrive as a Poisson process at `--request-rate` per second (gamma gaps with
`--burstiness` != 1; `inf`: all at once), at most `--max-concurrency` in flight. Each is a streamed
/v1/completions of random token ids with `ignore_eos`, so its output length is exactly the one
asked. Per request: TTFT (send to first streamed text), every ITL (gap between streamed chunks;
a chunk may carry several tokens when the server merges them), TPOT ((E2E - TTFT) / (output
tokens - 1)) and E2E. Reported: mean, P50, P90, P99 of each (numpy's linear percentiles, as vLLM),
throughput, and goodput: requests per second that met every SLO given to `--goodput`.

`--prefix-groups G --prefix-len L`: every prompt starts with one of G shared L-token prefixes (the
multi-tenant workload a prefix-aware router is for); the suffix takes `--input-len`.

`--workload chat`: streamed /v1/chat/completions instead, each a system prompt drawn from
`--system-prompts N` shared ones (so requests share a prefix, as an application's do) and a varied
user question (benchmarks/serve_chat.py), with `--output-len` tokens each; the prompt length is the
server's `usage.prompt_tokens` (its chat template's rendering). TTFT, TPOT and ITL as above.

    python -m benchmarks.serve --model smollm2-135m-instruct --workload chat --num-prompts 16 \
        --output-len 16:32 --request-rate 2

`--sweep 1,2,4,8` runs the same workload at each offered rate in turn (instead of
`--request-rate`) and prints one row per rate, with the server's queue depth: its
`vllm:num_requests_waiting` from `/metrics`, sampled every 0.25 s while the point runs (mean and
max; n/a for a server without the gauge, benchmarks/serve_queue.py). `--plot FILE.png` draws
achieved throughput against P50/P99 TTFT and TPOT with the SLO lines, and the queue depth
(benchmarks/serve_plot.py).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from engine_core.entrypoints import request_metrics as metrics  # module attributes: lab 12 plugs them
from benchmarks.serve_chat import chat_workload
from benchmarks.serve_queue import queue_summary, sample_waiting
from engine_core.entrypoints.request_metrics import SLO_METRICS, LatencyMetrics

PERCENTILES = (50, 90, 99)
Prompt = list[int] | list[dict[str, str]]  # token ids (/v1/completions) or a conversation (/v1/chat/completions)


@dataclass
class RequestResult:
    prompt_len: int
    output_len: int = 0  # completion tokens the server reported
    success: bool = False
    ttft: float = 0.0  # seconds
    itl: list[float] = field(default_factory=list)
    e2e: float = 0.0
    error: str = ""

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first (None for a single-token output)."""
        return (self.e2e - self.ttft) / (self.output_len - 1) if self.output_len > 1 else None


def parse_range(text: str) -> tuple[int, int]:
    """"N" or "LO:HI" (inclusive) -> (lo, hi)."""
    lo, _, hi = text.partition(":")
    bounds = (int(lo), int(hi or lo))
    if bounds[0] < 1 or bounds[1] < bounds[0]:
        raise ValueError(f"a length must be N or LO:HI with 1 <= LO <= HI, got {text!r}")
    return bounds


def parse_goodput(items: list[str] | None) -> dict[str, float]:
    """["ttft:500", "tpot:50"] -> {"ttft": 0.5, "tpot": 0.05} (seconds)."""
    slos = {}
    for item in items or []:
        name, _, ms = item.partition(":")
        if name not in SLO_METRICS:
            raise ValueError(f"--goodput takes {'/'.join(SLO_METRICS)}:MS, got {item!r}")
        value = float(ms)
        if not value > 0:
            raise ValueError(f"--goodput {name} must be > 0 ms, got {ms!r}")
        slos[name] = value / 1000.0
    return slos


def parse_rates(text: str) -> list[float]:
    """"1,2,4,inf" -> [1.0, 2.0, 4.0, inf]: each > 0."""
    rates = []
    for item in text.split(","):
        try:
            rate = float(item)
        except ValueError:
            raise ValueError(f"--sweep takes request rates like 1,2,4,inf, got {item!r}") from None
        if not rate > 0:
            raise ValueError(f"--sweep rates must be > 0, got {item!r}")
        rates.append(rate)
    return rates


def arrival_offsets(n: int, request_rate: float, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """Send times (seconds from the start) of n requests: gamma gaps of mean 1/rate and shape
    `burstiness` (1: Poisson arrivals; < 1 burstier); all at 0 for an infinite rate."""
    if request_rate == float("inf"):
        return [0.0] * n
    rng = np.random.default_rng(seed)
    gaps = rng.gamma(burstiness, 1.0 / (request_rate * burstiness), size=n)
    gaps[0] = 0.0
    return list(np.cumsum(gaps))


def meets(result: RequestResult, slos: dict[str, float]) -> bool:
    """A request counts for goodput only if it succeeded and met every SLO."""
    return result.success and metrics.meets_slos(LatencyMetrics(result.ttft, result.itl, result.tpot, result.e2e), slos)


def distribution(values: list[float]) -> dict[str, float]:
    """mean and P50/P90/P99 in milliseconds (zeros when empty)."""
    if not values:
        return {"mean_ms": 0.0, **{f"p{p}_ms": 0.0 for p in PERCENTILES}}
    ms = [v * 1000.0 for v in values]
    return {"mean_ms": float(np.mean(ms)), **{f"p{p}_ms": metrics.percentile(ms, p) for p in PERCENTILES}}


def summarize(results: list[RequestResult], duration_s: float, slos: dict[str, float] | None = None) -> dict[str, Any]:
    ok = [r for r in results if r.success]
    out_tokens = sum(r.output_len for r in ok)
    in_tokens = sum(r.prompt_len for r in ok)
    summary: dict[str, Any] = {
        "completed": len(ok), "failed": len(results) - len(ok), "duration_s": duration_s,
        "request_throughput": len(ok) / duration_s, "output_throughput": out_tokens / duration_s,
        "total_token_throughput": (in_tokens + out_tokens) / duration_s,
        "ttft": distribution([r.ttft for r in ok]),
        "tpot": distribution([r.tpot for r in ok if r.tpot is not None]),
        "itl": distribution([gap for r in ok for gap in r.itl]),
        "e2el": distribution([r.e2e for r in ok]),
    }
    if slos:
        good = sum(meets(r, slos) for r in results)
        summary["goodput"] = good / duration_s
        summary["slo_attainment"] = good / len(results) if results else 0.0
    return summary


def is_chat(prompt: Prompt) -> bool:
    return bool(prompt) and isinstance(prompt[0], dict)


def request_body(model: str, prompt: Prompt, output_len: int) -> tuple[str, dict[str, Any]]:
    """(path, JSON body) of one streamed, greedy request of exactly `output_len` tokens (`ignore_eos`):
    /v1/chat/completions for a conversation, /v1/completions for token ids."""
    common = {"model": model, "max_tokens": output_len, "temperature": 0.0, "ignore_eos": True, "stream": True,
              "stream_options": {"include_usage": True}}
    if is_chat(prompt):
        return "/v1/chat/completions", {**common, "messages": prompt}
    return "/v1/completions", {**common, "prompt": prompt}


def chunk_text(chunk: dict[str, Any]) -> str:
    """The text a streamed chunk carries: a completion's `text` or a chat delta's `content`."""
    choice = chunk["choices"][0] if chunk.get("choices") else {}
    return choice.get("text") or (choice.get("delta") or {}).get("content") or ""


async def send(client: Any, base_url: str, model: str, prompt: Prompt, output_len: int) -> RequestResult:
    """One streamed completion or chat completion, timed on this side of the socket."""
    chat = is_chat(prompt)
    result = RequestResult(prompt_len=0 if chat else len(prompt))  # a chat's: the server's usage.prompt_tokens
    path, body = request_body(model, prompt, output_len)
    start = time.perf_counter()
    chunk_times: list[float] = []
    try:
        async with client.stream("POST", f"{base_url}{path}", json=body) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {(await response.aread()).decode()[:200]}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[len("data: "):])
                if "error" in chunk:
                    result.error = chunk["error"].get("message", "error")
                    return result
                now = time.perf_counter()
                if chunk_text(chunk):
                    chunk_times.append(now)
                if chunk.get("usage"):
                    result.output_len = chunk["usage"]["completion_tokens"]
                    if chat:
                        result.prompt_len = chunk["usage"].get("prompt_tokens", 0)
        end = time.perf_counter()
        result.e2e = end - start
        result.success = result.output_len > 0 and bool(chunk_times)
        if not result.success:
            result.error = "no usage chunk or no text (the server did not report completion tokens)"
        else:
            m = metrics.request_metrics(start, chunk_times, end, result.output_len)
            result.ttft, result.itl = m.ttft, m.itl
    except Exception as e:  # a refused connection, a reset: counted as failed, the run goes on
        result.error = f"{type(e).__name__}: {e}"
    return result


async def run(base_url: str, model: str, prompts: list[Prompt], output_lens: list[int], request_rate: float,
              max_concurrency: int | None = None, burstiness: float = 1.0, seed: int = 0,
              timeout_s: float = 600.0) -> tuple[list[RequestResult], float]:
    """Send every prompt at its arrival time; (results in prompt order, wall seconds)."""
    import httpx2

    offsets = arrival_offsets(len(prompts), request_rate, burstiness, seed)
    limit = asyncio.Semaphore(max_concurrency or len(prompts))
    limits = httpx2.Limits(max_connections=max_concurrency or len(prompts))
    async with httpx2.AsyncClient(timeout=timeout_s, limits=limits) as client:
        start = time.perf_counter()

        async def one(i: int) -> RequestResult:
            await asyncio.sleep(max(0.0, start + offsets[i] - time.perf_counter()))
            async with limit:
                return await send(client, base_url, model, prompts[i], output_lens[i])

        results = await asyncio.gather(*(one(i) for i in range(len(prompts))))
        return list(results), time.perf_counter() - start


def synthetic_workload(n: int, input_len: tuple[int, int], output_len: tuple[int, int], vocab: int,
                       seed: int) -> tuple[list[list[int]], list[int]]:
    """Random token-id prompts (ids 3.. past the specials) and output lengths, uniform in the ranges."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, vocab) for _ in range(rng.randint(*input_len))] for _ in range(n)]
    return prompts, [rng.randint(*output_len) for _ in range(n)]


def prefix_workload(n: int, num_groups: int, prefix_len: int, input_len: tuple[int, int], output_len: tuple[int, int],
                    vocab: int, seed: int) -> tuple[list[list[int]], list[int]]:
    """Prompts that share their leading blocks, as tenants' system prompts do: `num_groups` random
    prefixes of `prefix_len` token ids; each prompt is one of them (uniformly) and a suffix of its own."""
    if num_groups < 1 or prefix_len < 1:
        raise ValueError(f"--prefix-groups and --prefix-len must be >= 1, got {num_groups} and {prefix_len}")
    rng = random.Random(seed)
    prefixes = [[rng.randrange(3, vocab) for _ in range(prefix_len)] for _ in range(num_groups)]
    suffixes, output_lens = synthetic_workload(n, input_len, output_len, vocab, seed + 1)
    return [prefixes[rng.randrange(num_groups)] + suffix for suffix in suffixes], output_lens


async def sweep(base_url: str, model: str, prompts: list[Prompt], output_lens: list[int], rates: list[float],
                slos: dict[str, float], max_concurrency: int | None = None, burstiness: float = 1.0,
                seed: int = 0) -> list[dict[str, Any]]:
    """The workload at each offered rate, one after another: a summary per rate (`request_rate` added,
    and `queue_waiting`: the server's waiting count sampled while the point ran, None without the gauge)."""
    import httpx2

    summaries = []
    for rate in rates:
        stop = asyncio.Event()
        async with httpx2.AsyncClient() as poller:
            sampler = asyncio.create_task(sample_waiting(poller, base_url, stop))
            try:
                results, duration = await run(base_url, model, prompts, output_lens, rate, max_concurrency,
                                              burstiness, seed)
            finally:
                stop.set()
                samples = await sampler
        summaries.append({"request_rate": rate, **summarize(results, duration, slos),
                          "queue_waiting": queue_summary(samples)})
    return summaries


def format_queue(summary: dict[str, Any]) -> str:
    """'mean max' waiting requests of a sweep point, or n/a where the server exposed no gauge."""
    queue = summary.get("queue_waiting")
    return f"{queue['mean']:9.1f} {queue['max']:8g}" if queue else f"{'n/a':>9} {'n/a':>8}"


def format_sweep(summaries: list[dict[str, Any]]) -> str:
    lines = [f"{'rate/s':>7} {'req/s':>7} {'tok/s':>8} {'TTFT P50':>9} {'TTFT P99':>9} {'TPOT P50':>9} "
             f"{'TPOT P99':>9} {'goodput':>8} {'failed':>6} {'wait mean':>9} {'wait max':>8}"]
    for s in summaries:
        goodput = f"{s['goodput']:8.2f}" if "goodput" in s else f"{'-':>8}"
        lines.append(f"{s['request_rate']:7g} {s['request_throughput']:7.2f} {s['output_throughput']:8.1f} "
                     f"{s['ttft']['p50_ms']:9.1f} {s['ttft']['p99_ms']:9.1f} {s['tpot']['p50_ms']:9.1f} "
                     f"{s['tpot']['p99_ms']:9.1f} {goodput} {s['failed']:6d} {format_queue(s)}")
    return "\n".join(lines)


def format_summary(summary: dict[str, Any]) -> str:
    lines = [f"completed {summary['completed']}, failed {summary['failed']}, {summary['duration_s']:.2f} s",
             f"throughput: {summary['request_throughput']:.2f} req/s, {summary['output_throughput']:.1f} output tok/s, "
             f"{summary['total_token_throughput']:.1f} total tok/s"]
    if "goodput" in summary:
        lines.append(f"goodput: {summary['goodput']:.2f} req/s ({100 * summary['slo_attainment']:.1f}% met every SLO)")
    lines.append(f"{'ms':>6} {'mean':>9} {'P50':>9} {'P90':>9} {'P99':>9}")
    for name in ("ttft", "tpot", "itl", "e2el"):
        d = summary[name]
        lines.append(f"{name:>6} {d['mean_ms']:9.2f} {d['p50_ms']:9.2f} {d['p90_ms']:9.2f} {d['p99_ms']:9.2f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.serve", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--model", required=True, help="the served model name")
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--input-len", default="32:128", help="N or LO:HI prompt tokens")
    parser.add_argument("--output-len", default="16:64", help="N or LO:HI output tokens")
    parser.add_argument("--vocab-size", type=int, default=256, help="prompt ids are drawn from [3, this)")
    parser.add_argument("--request-rate", type=float, default=float("inf"), help="requests/s (inf: all at once)")
    parser.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of the gaps (1: Poisson)")
    parser.add_argument("--max-concurrency", type=int, default=None)
    parser.add_argument("--goodput", nargs="*", default=None, metavar="KEY:MS", help="SLOs: ttft, tpot, e2el in ms")
    parser.add_argument("--workload", choices=("random", "chat"), default="random",
                        help="random: token-id prompts to /v1/completions; chat: /v1/chat/completions with "
                             "shared system prompts (benchmarks/serve_chat.py)")
    parser.add_argument("--system-prompts", type=int, default=4,
                        help="with --workload chat: how many shared system prompts the requests draw from")
    parser.add_argument("--prefix-groups", type=int, default=0,
                        help="G > 0: every prompt starts with one of G shared prefixes (a multi-tenant workload)")
    parser.add_argument("--prefix-len", type=int, default=64, help="tokens of each shared prefix")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--result-file", default=None, help="write the summary and every request as JSON")
    parser.add_argument("--sweep", default=None, metavar="RATES", help="offered rates to run in turn: 1,2,4,inf")
    parser.add_argument("--plot", default=None, metavar="FILE.png", help="with --sweep: the capacity plot")
    args = parser.parse_args(argv)
    try:
        slos = parse_goodput(args.goodput)
        rates = parse_rates(args.sweep) if args.sweep is not None else None
    except ValueError as e:
        parser.error(str(e))
    if not args.request_rate > 0 or not args.burstiness > 0:
        parser.error("--request-rate and --burstiness must be > 0")
    if args.plot and rates is None:
        parser.error("--plot needs --sweep")
    if args.workload == "chat":
        try:
            prompts, output_lens = chat_workload(args.num_prompts, args.system_prompts, parse_range(args.output_len),
                                                 args.seed)
        except ValueError as e:
            parser.error(str(e))
    elif args.prefix_groups:
        try:
            prompts, output_lens = prefix_workload(args.num_prompts, args.prefix_groups, args.prefix_len,
                                                   parse_range(args.input_len), parse_range(args.output_len),
                                                   args.vocab_size, args.seed)
        except ValueError as e:
            parser.error(str(e))
    else:
        prompts, output_lens = synthetic_workload(args.num_prompts, parse_range(args.input_len),
                                                  parse_range(args.output_len), args.vocab_size, args.seed)
    if rates is not None:
        summaries = asyncio.run(sweep(args.base_url.rstrip("/"), args.model, prompts, output_lens, rates, slos,
                                      args.max_concurrency, args.burstiness, args.seed))
        print(format_sweep(summaries))
        if args.plot:
            from benchmarks.serve_plot import plot_sweep

            plot_sweep(summaries, slos, args.plot)
            print(f"wrote {args.plot}")
        if args.result_file:
            with open(args.result_file, "w") as f:
                json.dump({"args": vars(args), "sweep": summaries}, f, indent=1)
        return
    results, duration = asyncio.run(run(args.base_url.rstrip("/"), args.model, prompts, output_lens,
                                        args.request_rate, args.max_concurrency, args.burstiness, args.seed))
    summary = summarize(results, duration, slos)
    print(format_summary(summary))
    for r in [r for r in results if not r.success][:3]:
        print(f"failed: {r.error}")
    if args.result_file:
        with open(args.result_file, "w") as f:
            json.dump({"args": vars(args), "summary": summary, "requests": [asdict(r) for r in results]}, f, indent=1)


if __name__ == "__main__":
    main()
