"""The benchmarks' shared workload: seeded random token-id prompts and output lengths, the command
line flags that describe them, and one greedy run of it through the engine.

`make bench`, `make bench-vllm`, `make bench-lora`, `profile_steps` and `fp8_accuracy` draw their
requests here, so the same flags and seed give the same prompts in every one of them.
"""
from __future__ import annotations

import argparse
import random
from dataclasses import dataclass

import torch

from engine_core.engine import LLMEngine
from engine_core.lora.request import LoRARequest
from engine_core.models.attention import AttentionMetadata
from engine_core.request import SamplingParams

WARM_UP_LENGTHS = ((8, 32), (4, 8))  # (input, output) ranges of the untimed warm-up requests


@dataclass
class Workload:
    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def num_output_tokens(self) -> int:
        return sum(self.output_lens)


def parse_range(text: str) -> tuple[int, int]:
    """'A:B' (or 'A') -> (A, B) with 1 <= A <= B."""
    lo, _, hi = text.partition(":")
    a, b = int(lo), int(hi or lo)
    if not 1 <= a <= b:
        raise ValueError(f"a length range must be A:B with 1 <= A <= B, got {text!r}")
    return a, b


def _prompts(rng: random.Random, num: int, lengths: tuple[int, int], vocab_size: int) -> list[list[int]]:
    return [[rng.randrange(3, vocab_size) for _ in range(rng.randint(*lengths))] for _ in range(num)]


def make_prompts(num: int, lengths: tuple[int, int], vocab_size: int, seed: int) -> list[list[int]]:
    """`num` prompts of uniform length in `lengths`, uniform token ids (the 3 special ids excluded)."""
    return _prompts(random.Random(seed), num, lengths, vocab_size)


def make_workload(num_requests: int, input_len: tuple[int, int], output_len: tuple[int, int], vocab_size: int,
                  seed: int) -> Workload:
    """`make_prompts`' prompts for the same seed, then each request's output length, uniform in `output_len`."""
    rng = random.Random(seed)
    prompts = _prompts(rng, num_requests, input_len, vocab_size)
    return Workload(prompts, [rng.randint(*output_len) for _ in range(num_requests)])


def warm_up_workload(vocab_size: int, seed: int) -> Workload:
    """Four short requests, untimed, that take first-use costs (allocator, kernels) out of the timed runs."""
    return make_workload(4, *WARM_UP_LENGTHS, vocab_size, seed + 1)


def add_workload_args(ap: argparse.ArgumentParser, *, num_requests: int = 64, input_len: str = "16:512",
                      output_len: str = "16:256", timing: bool = False) -> None:
    """The flags the benchmarks share: the model, the workload (--num-requests, --input-len, --output-len,
    --seed), the scheduler's two limits and, with `timing`, --threads and --repeats."""
    ap.add_argument("--model", default="small-llama")
    ap.add_argument("--num-requests", type=int, default=num_requests)
    ap.add_argument("--input-len", default=input_len, help="prompt lengths, A:B (uniform)")
    ap.add_argument("--output-len", default=output_len, help="output lengths, A:B (uniform)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    if timing:
        ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
        ap.add_argument("--repeats", type=int, default=1, help="runs of every side; medians reported")


def workload_from_args(a: argparse.Namespace, vocab_size: int) -> Workload:
    """The workload `add_workload_args`' flags describe."""
    if a.num_requests < 1:
        raise ValueError(f"--num-requests must be >= 1, got {a.num_requests}")
    return make_workload(a.num_requests, parse_range(a.input_len), parse_range(a.output_len), vocab_size, a.seed)


def add_requests(engine: LLMEngine, w: Workload, tag: str = "bench",
                 loras: list[LoRARequest | None] | None = None) -> list[str]:
    """Queue every request of `w` (greedy, ignore_eos, each its own output length); their ids, in order."""
    ids = [f"{tag}-{i}" for i in range(len(w.prompts))]
    for i, (rid, p, n) in enumerate(zip(ids, w.prompts, w.output_lens)):
        engine.add_request(rid, p, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True),
                           lora_request=loras[i] if loras else None)
    return ids


def run_engine(engine: LLMEngine, w: Workload) -> list[list[int]]:
    """Serve every request (all queued at t=0); the outputs in request order."""
    ids = add_requests(engine, w)
    outputs: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out.outputs[0].token_ids
    return [outputs[rid] for rid in ids]


def token_agreement(a: list[list[int]], b: list[list[int]]) -> float:
    """Fraction of output tokens equal up to each pair's first difference (greedy paths diverge after it)."""
    same = 0
    for x, y in zip(a, b):
        same += next((i for i, (s, t) in enumerate(zip(x, y)) if s != t), min(len(x), len(y)))
    return same / max(1, sum(len(x) for x in a))


def teacher_forced_hidden(engine: LLMEngine, seqs: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Every token of `seqs` in one prefill through the engine's model and KV cache (blocks 0.. of the
    cache, each sequence its own run of blocks), bypassing the scheduler: (final hidden state of every
    row, query_start_loc), sequence i owning rows qsl[i]:qsl[i+1]. What the accuracy benchmarks score."""
    runner = engine.runner
    bs, device = runner.block_size, runner.device
    lens = [len(s) for s in seqs]
    width = -(-max(lens) // bs)
    tables = torch.arange(len(seqs) * width, dtype=torch.int32).view(len(seqs), width)
    slots = torch.cat([tables[i].long().repeat_interleave(bs)[:n] * bs + torch.arange(n) % bs
                       for i, n in enumerate(lens)])
    qsl = torch.tensor([0] + lens).cumsum(0).to(torch.int32)
    meta = AttentionMetadata(slots.to(device), tables.to(device), torch.tensor(lens, dtype=torch.int32).to(device),
                             qsl.to(device), 0, runner.config.engine.kv_cache_dtype, runner.attention_backend)
    ids = torch.tensor([t for s in seqs for t in s], device=device)
    positions = torch.cat([torch.arange(n) for n in lens]).to(device)
    return runner.model(ids, positions, runner.kv_cache, meta), qsl
