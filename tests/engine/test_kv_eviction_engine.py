"""Token eviction in the engine (kv_eviction "streaming_llm" / "h2o", tiny-llama, blocks of 4).

The oracle: Hugging Face's model run once over the whole sequence with a 4D mask in which each position sees
exactly the tokens of the blocks its request held when it was computed (recorded at every schedule), at its
original position. The engine's greedy tokens must be that model's argmax: attention over the kept blocks only,
compact rows, cache positions and RoPE positions all right. Budgets hold, no block leaks, and H2O's scores change
what is kept."""
from __future__ import annotations

import pytest
import torch
import transformers
from engine_helpers import check_engine, pool_is_whole, run_to_end

from engine_core import LLM, LLMEngine, SamplingParams
from engine_core.core.kv_cache_manager import NULL_BLOCK
from engine_core.presets import preset_path

BS = 4
SETTINGS = dict(block_size=BS, num_gpu_blocks=128, kv_budget_tokens=20, kv_sink_tokens=4, kv_recent_tokens=4,
                max_num_batched_tokens=8)
PROMPT_LENS = [3, 10, 29]  # the last one is longer than the budget: evicted while it is prefilled (chunks of 8)
NUM_NEW = 30
GREEDY = SamplingParams(max_tokens=NUM_NEW, temperature=0.0, ignore_eos=True)


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(3, 512, (n,), generator=g).tolist() for n in PROMPT_LENS]


def _run_recording(llm: LLM) -> tuple[dict[str, list[int]], dict[str, dict[int, list[int]]], int]:
    """Greedy tokens per request, the positions each computed position could see, and the most blocks a request
    held at the start of a step (before its chunk's new blocks)."""
    engine = llm.engine
    sched, kvm = engine.scheduler, engine.scheduler.kv_cache_manager
    seen: dict[str, dict[int, list[int]]] = {}
    most = [0]
    plan = sched.schedule

    def recording_schedule():
        out = plan()
        for chunk in out.scheduled:
            rid = chunk.request.request_id
            table = kvm.req_to_blocks[rid]
            held = {i for i, b in enumerate(table) if b is not NULL_BLOCK}
            most[0] = max(most[0], len([i for i in held if i < -(-chunk.start // BS)]))
            for p in range(chunk.start, chunk.start + chunk.num_tokens):
                seen.setdefault(rid, {})[p] = [k for k in range(p + 1) if k // BS in held]
        return out

    sched.schedule = recording_schedule
    for i, p in enumerate(_prompts()):
        engine.add_request(str(i), p, GREEDY)
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                tokens[out.request_id] = out.outputs[0].token_ids
    return tokens, seen, most[0]


@pytest.fixture(scope="module")
def hf_model():
    return transformers.AutoModelForCausalLM.from_pretrained(preset_path("tiny-llama"), dtype=torch.float32).eval()


def _masked_greedy(model, sequence: list[int], seen: dict[int, list[int]]) -> torch.Tensor:
    n = len(sequence) - 1
    mask = torch.full((1, 1, n, n), float("-inf"))
    for p in range(n):
        mask[0, 0, p, seen[p]] = 0.0
    with torch.inference_mode():
        return model(torch.tensor([sequence[:n]]), attention_mask=mask).logits[0]


@pytest.mark.parametrize("policy", ["streaming_llm", "h2o"])
def test_tokens_are_hf_over_the_kept_blocks(hf_model, policy):
    llm = LLM("tiny-llama", kv_eviction=policy, **SETTINGS)
    tokens, seen, most = _run_recording(llm)
    assert llm.engine.stats()["num_blocks_evicted"] > 0
    differs_from_full = 0
    for i, prompt in enumerate(_prompts()):
        got = tokens[str(i)]
        logits = _masked_greedy(hf_model, prompt + got, seen[str(i)])[len(prompt) - 1:]
        assert logits.argmax(-1).tolist() == got, f"{policy} request {i}"
        with torch.inference_mode():
            full = hf_model(torch.tensor([prompt + got[:-1]])).logits[0, len(prompt) - 1:].argmax(-1).tolist()
        differs_from_full += full != got
    assert differs_from_full >= 1  # the eviction is not vacuous
    assert most <= SETTINGS["kv_budget_tokens"] // BS  # within budget at the start of every step
    assert pool_is_whole(llm.engine)


def test_a_budget_never_reached_changes_nothing():
    """Greedy tokens with eviction on but a budget above every request's length equal those with it off."""
    sp = GREEDY
    off = LLM("tiny-llama", block_size=BS, num_gpu_blocks=128, max_num_batched_tokens=8, attention_backend="torch")
    want = [o.outputs[0].token_ids for o in off.generate(_prompts(), sp, use_tqdm=False)]
    for policy in ("streaming_llm", "h2o"):
        on = LLM("tiny-llama", block_size=BS, num_gpu_blocks=128, max_num_batched_tokens=8, kv_eviction=policy,
                 kv_budget_tokens=128)
        assert [o.outputs[0].token_ids for o in on.generate(_prompts(), sp, use_tqdm=False)] == want
        assert on.engine.stats()["num_blocks_evicted"] == 0


def test_h2o_keeps_other_blocks_than_streaming_llm():
    kept = {}
    for policy in ("streaming_llm", "h2o"):
        _, seen, _ = _run_recording(LLM("tiny-llama", kv_eviction=policy, **SETTINGS))
        kept[policy] = seen
    assert kept["streaming_llm"] != kept["h2o"]


def test_preemption_under_eviction_leaks_nothing():
    llm = LLM("tiny-llama", kv_eviction="h2o", **dict(SETTINGS, num_gpu_blocks=10))
    outs = llm.generate(_prompts(), GREEDY, use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == NUM_NEW for o in outs)
    assert llm.engine.stats()["num_preemptions_recompute"] > 0 and pool_is_whole(llm.engine)


@pytest.mark.parametrize("kwargs, match", [
    (dict(kv_eviction="lru", kv_budget_tokens=64), "kv_eviction must be one of"),
    (dict(kv_eviction="h2o"), r"kv_budget_tokens must be an int >= 32"),
    (dict(kv_eviction="h2o", kv_budget_tokens=16, block_size=16), r"kv_budget_tokens must be an int >= 32"),
    (dict(kv_eviction="streaming_llm", kv_budget_tokens=32, kv_sink_tokens=32), r"kv_budget_tokens .*>= 64"),
    (dict(kv_eviction="streaming_llm", kv_budget_tokens=64, kv_recent_tokens=0), "kv_recent_tokens must be"),
    (dict(kv_eviction="streaming_llm", kv_budget_tokens=64, kv_sink_tokens=-1), "kv_sink_tokens must be"),
    (dict(kv_budget_tokens=64), "kv_budget_tokens must be None without kv_eviction"),
    (dict(kv_sink_tokens=4), "kv_sink_tokens must be 0 without kv_eviction"),
    (dict(kv_eviction="h2o", kv_budget_tokens=64, enable_prefix_caching=True), "enable_prefix_caching must be False"),
    (dict(kv_eviction="h2o", kv_budget_tokens=64, attention_backend="cpu"), "attention_backend must be 'auto' or"),
    (dict(kv_eviction="h2o", kv_budget_tokens=64,
          speculative_config=dict(method="ngram", prompt_lookup_max=2, num_speculative_tokens=2)),
     "speculative_config must be None with kv_eviction"),
])
def test_bad_settings_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        LLM("tiny-llama", num_gpu_blocks=8, **kwargs)


def test_eviction_with_a_sliding_window_is_refused():
    with pytest.raises(ValueError, match="kv_eviction='h2o' is not supported with the model's sliding_window=12"):
        LLM("tiny-mistral-swa", num_gpu_blocks=8, kv_eviction="h2o", kv_budget_tokens=64)


def test_a_failed_step_is_recovered_without_a_leak():
    """A step that raises after evictions: the engine recovers (every request recomputed from its tokens, then
    evicted anew, so its tokens may differ from an uninterrupted run's: docs/long_context.md), stays consistent
    and frees every block."""
    engine = LLMEngine.from_kwargs("tiny-llama", kv_eviction="h2o", **SETTINGS)
    requests = [engine.add_request(str(i), p, GREEDY) for i, p in enumerate(_prompts())]
    real, calls = engine.scheduler.update_from_output, []

    def flaky(*args):
        calls.append(1)
        out = real(*args)
        if len(calls) == 12:
            raise TypeError("injected")
        return out

    engine.scheduler.update_from_output = flaky
    with pytest.raises(TypeError, match="injected"):
        for _ in range(12):
            engine.step()
    assert engine.stats()["num_blocks_evicted"] > 0
    check_engine(engine)
    run_to_end(engine, check=True)
    assert all(len(r.output_token_ids) == NUM_NEW for r in requests) and pool_is_whole(engine)
