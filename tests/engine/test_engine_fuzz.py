"""A real-model random fuzzer: random engine configs (block size, tight KV memory, swap space, budget,
chunking, prefix caching, every preemption mode, max_model_len, model family), random sequences of
add / step / abort with priorities, shared prefixes, reused request ids, greedy and seeded sampling,
LoRA adapters (every third seed: 1-3 slots for 4 adapters, a host cache that evicts), speculative
decoding (its own random stream, so the other draws of a seed stay as they were: tiny-llama-draft's
drafts every fourth seed (3, 7, ...), n-gram drafts half the others, k from 1 to 4), and one step in ten
interrupted at a random line (KeyboardInterrupt: the step is rolled back).

After every operation the whole engine is checked (engine_helpers.check_engine: ref counts, the
free queue, pool totals, the prefix-cache map, queues against statuses, the runner's tables, the
step's token budget, adapter pins and slots); an add is accepted exactly when the request can ever
fit. At the end every GPU and CPU block is free, and every finished request's tokens equal those of
the same request (same adapter) run alone in a roomy engine (with a draft model, greedy requests only: a
sampled request's draws depend on how its drafts fell into steps, its distribution is tested in
tests/worker/test_draft_model.py). FUZZ_ENGINE_SEQUENCES sets the number of sequences (default 4, so that
one is a draft model's; `make fuzz`: 300).
"""
from __future__ import annotations

import functools
import os
import random

import pytest
from engine_helpers import check_engine, interrupt_at, one_torch_thread, pool_is_whole, run_to_end

from engine_core import LLMEngine, LoRARequest, SamplingParams
from engine_core.core.kv_cache_manager import cdiv
from engine_core.lora.presets import adapter_path
from engine_core.request import Request

pytestmark = pytest.mark.usefixtures(one_torch_thread.__name__)
SEQUENCES = int(os.environ.get("FUZZ_ENGINE_SEQUENCES", "4"))
MODELS = ["tiny-llama", "tiny-llama", "tiny-qwen2", "tiny-qwen3", "tiny-llama3"]
PREFIXES = [[], [7] * 9, list(range(40, 57)), [300, 301, 302, 303, 304, 305]]
ADAPTERS = ["r8-attn", "r4-mlp", "r16-all", "r16-rslora-qv"]  # lora_int_id = index + 1


def _random_config(rng: random.Random, with_lora: bool) -> dict:
    block_size = rng.choice([1, 2, 4, 8, 16])
    max_model_len = rng.choice([32, 64, 128])
    chunked = rng.random() < 0.7
    max_loras = rng.randint(1, 3)
    lora = dict(enable_lora=True, max_loras=max_loras, max_cpu_loras=max_loras + rng.randint(0, 1))
    return dict(**(lora if with_lora else {}), device="cpu", block_size=block_size, max_model_len=max_model_len,
                num_gpu_blocks=rng.randint(cdiv(24, block_size), cdiv(4 * max_model_len, block_size)),
                swap_space=rng.choice([0, 2, 8, 64]) * 1024 * block_size / 2**30,  # ~that many CPU blocks
                max_num_seqs=rng.randint(1, 8),
                max_num_batched_tokens=rng.randint(1, 64) if chunked else rng.randint(1, 64) * 4,
                enable_chunked_prefill=chunked, enable_prefix_caching=rng.random() < 0.6,
                preemption_mode=rng.choice(["auto", "recompute", "swap", "swap"]),
                long_prefill_token_threshold=rng.choice([0, 0, 3, 8]), seed=rng.randrange(2**32),
                scheduling_policy=rng.choice(["fcfs", "priority"]))


def _random_spec(rng: random.Random, draft_model: bool) -> dict:
    """With `draft_model`, tiny-llama-draft's drafts (greedy tokens are those of the roomy engine without
    speculation); else half the time n-gram speculation (greedy and seeded tokens are)."""
    if draft_model:
        return dict(speculative_config={"method": "draft_model", "model": "tiny-llama-draft",
                                        "num_speculative_tokens": rng.randint(1, 4)})
    if rng.random() < 0.5:
        return {}
    lo = rng.randint(1, 2)
    return dict(speculative_config={"method": "ngram", "num_speculative_tokens": rng.randint(1, 4),
                                    "prompt_lookup_min": lo, "prompt_lookup_max": rng.randint(lo, 4)})


def _random_params(rng: random.Random) -> SamplingParams:
    kind = rng.random()
    common = dict(max_tokens=rng.randint(1, 24), ignore_eos=rng.random() < 0.8,
                  stop_token_ids=rng.choice([[], [], [rng.randrange(3, 512)]]))
    if kind < 0.6:
        return SamplingParams(temperature=0.0, **common)
    return SamplingParams(temperature=rng.choice([0.5, 1.0]), top_k=rng.choice([0, 5, 50]),
                          top_p=rng.choice([1.0, 0.9]), seed=None if kind > 0.9 else rng.randrange(2**31), **common)


@functools.cache
def _adapter(model: str, index: int) -> LoRARequest:
    return LoRARequest(ADAPTERS[index], index + 1, str(adapter_path(model, ADAPTERS[index])))


@functools.cache
def _roomy(model: str, max_model_len: int, lora: bool) -> LLMEngine:
    return LLMEngine.from_kwargs(model, device="cpu", max_model_len=max_model_len, num_gpu_blocks=64, block_size=16,
                                 **(dict(enable_lora=True, max_cpu_loras=len(ADAPTERS)) if lora else {}))


def _alone(model: str, max_model_len: int, prompt: tuple[int, ...], params: SamplingParams,
           lora: LoRARequest | None) -> list[int]:
    engine = _roomy(model, max_model_len, lora is not None)
    engine.add_request("alone", list(prompt), params, lora_request=lora)
    return run_to_end(engine)["alone"]


def _reproducible(params: SamplingParams, config: dict) -> bool:
    spec = config.get("speculative_config")
    return params.greedy or (params.seed is not None and not (spec and spec["method"] == "draft_model"))


@pytest.mark.parametrize("seed", range(SEQUENCES))
def test_random_sequence(seed):
    rng = random.Random(seed)
    model, config = rng.choice(MODELS), _random_config(rng, with_lora=seed % 3 == 1)
    config.update(_random_spec(random.Random(f"spec {seed}"), draft_model=seed % 4 == 3))
    engine = LLMEngine.from_kwargs(model, **config)
    bs, mml, gpu_blocks = config["block_size"], engine.config.max_model_len, config["num_gpu_blocks"]
    added: list[tuple[Request, SamplingParams, LoRARequest | None]] = []
    finished_ids: list[str] = []
    for op in range(rng.randint(10, 60)):
        where = f"seed {seed}, {model} {config}, op {op}"
        action = rng.random()
        if action < 0.35:
            prompt = rng.choice(PREFIXES) + [rng.randrange(3, 512) for _ in range(rng.randint(0, 30))] or [5]
            params = _random_params(rng)
            lora = None
            if config.get("enable_lora") and rng.random() < 0.7:
                lora = _adapter(model, rng.randrange(len(ADAPTERS)))
            reuse = finished_ids and rng.random() < 0.3
            rid = finished_ids.pop(rng.randrange(len(finished_ids))) if reuse else f"r{op}"
            fits = len(prompt) + 1 <= mml and cdiv(min(len(prompt) + params.max_tokens, mml), bs) <= gpu_blocks
            try:
                priority = rng.randint(0, 2) if config["scheduling_policy"] == "priority" else 0  # fcfs: 0 only
                request = engine.add_request(rid, prompt, params, priority=priority, lora_request=lora)
            except ValueError as e:
                assert not fits, f"{where}: rejected a request that fits: {e}"
            else:
                assert fits, f"{where}: accepted a request that can never fit"
                added.append((request, params, lora))
        elif action < 0.9:
            try:
                with interrupt_at(rng.randrange(1500) if rng.random() < 0.1 else None):
                    outputs = engine.step()
            except KeyboardInterrupt:  # rolled back; requests it finished come with a later step
                outputs = []
            for out in outputs:
                request = next(r for r, _, _ in reversed(added) if r.request_id == out.request_id)
                assert out.outputs[0].token_ids == request.output_token_ids, where
                if out.finished:
                    finished_ids.append(out.request_id)
        elif engine.requests:
            rid = rng.choice(sorted(engine.requests))
            engine.abort_request(rid)
            finished_ids.append(rid)
        check_engine(engine)
    run_to_end(engine, check=True)
    assert pool_is_whole(engine) and not engine.requests, f"seed {seed}: {engine.stats()}"
    for request, params, lora in added:
        where = f"seed {seed}, {model} {config}: {request}"
        assert request.is_finished, where
        if request.status.finish_reason == "abort" or not _reproducible(params, config):
            continue
        assert request.status.finish_reason in ("stop", "length"), where
        assert request.output_token_ids == _alone(model, mml, tuple(request.prompt_token_ids), params, lora), where
