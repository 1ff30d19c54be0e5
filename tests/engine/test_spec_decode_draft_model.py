"""Speculative decoding with method "draft_model" end to end: greedy output with a draft model's drafts
equals the output without, token for token, under chunked prefill, prefix caching, both preemption
modes and LoRA; a draft with the target's weights is always accepted; seeded sampled runs repeat; a draft with
another vocabulary or a shorter context is refused by name before the engine is built. The sampled
distribution is tested where it is decided, in tests/worker/test_draft_model.py."""
from __future__ import annotations

import json
import random
import shutil

import pytest
from engine_helpers import pool_is_whole

from engine_core import LLM, SamplingParams
from engine_core.config import EngineConfig
from engine_core.lora.presets import adapter_path
from engine_core.lora.request import LoRARequest
from engine_core.presets import resolve_model

DRAFT = {"method": "draft_model", "model": "tiny-llama-draft", "num_speculative_tokens": 3}
SELF = {**DRAFT, "model": "tiny-llama"}  # the target's own weights as the draft
RNG = random.Random(25)
PROMPTS = [list(range(10, 20)) * 3, [RNG.randrange(3, 512) for _ in range(20)],
           list(range(10, 20)) * 2 + [77, 78]]  # shares a prefix with the first: prefix-cache hits
PARAMS = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (20, 16, 18)]
BASE = dict(block_size=4, max_model_len=128, max_num_batched_tokens=32)


def generate(spec: dict | None, params=PARAMS, **kw) -> tuple[list[list[int]], dict]:
    llm = LLM("tiny-llama", speculative_config=spec, **{**BASE, **kw})
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    assert pool_is_whole(llm.engine), llm.engine.stats()
    return [o.outputs[0].token_ids for o in outs], llm.engine.stats()


@pytest.fixture(scope="module")
def plain():
    return generate(None)[0]


def _assert_speculated(stats: dict) -> None:
    assert stats["spec_decode_num_drafts"] > 0 and stats["spec_decode_num_accepted_tokens"] > 0, stats
    assert stats["spec_decode_num_accepted_tokens"] < stats["spec_decode_num_draft_tokens"], stats  # rejections too


@pytest.mark.parametrize("kw", [{}, {"enable_chunked_prefill": False}, {"enable_prefix_caching": True},
                                {"max_num_batched_tokens": 8}],
                         ids=["chunked", "unchunked", "prefix-caching", "small-budget"])
def test_greedy_output_with_a_draft_model_equals_the_output_without(plain, kw):
    outs, stats = generate(DRAFT, **kw)
    assert outs == plain
    _assert_speculated(stats)
    if kw.get("enable_prefix_caching"):
        assert stats["prefix_cache_hits"] > 0, stats


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_greedy_output_survives_preemption_with_draft_model_drafts(plain, mode):
    outs, stats = generate(DRAFT, num_gpu_blocks=20, preemption_mode=mode, enable_prefix_caching=True)
    key = {"recompute": "num_preemptions_recompute", "swap": "num_preemptions_swap"}[mode]
    assert stats[key] > 0, stats
    assert outs == plain
    _assert_speculated(stats)


def test_lora_requests():
    """The target verifies with its adapter; the draft (the base weights, no adapter) only changes which
    drafts are accepted, never the greedy output. (fp8 KV is not repeated here: the draft never touches
    the target's cache, and test_spec_decode.py runs the same verify path with an fp8 cache; on CPU each
    fp8 run costs ~25 s.)"""
    lora = LoRARequest("r8-attn", 1, str(adapter_path("tiny-llama", "r8-attn")))
    got = {}
    for spec in (None, DRAFT):
        llm = LLM("tiny-llama", speculative_config=spec, enable_lora=True, max_lora_rank=16, **BASE)
        got[spec is None] = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False,
                                                                         lora_request=lora)]
        if spec:
            _assert_speculated(llm.engine.stats())
    assert got[False] == got[True]


def test_a_draft_with_the_targets_weights_is_always_accepted(plain):
    """Greedy, draft == target: every draft is the target's argmax, so acceptance is exactly 1.0 and each
    verify step emits k + 1 tokens (fewer only where max_tokens caps the drafts)."""
    outs, stats = generate(SELF)
    assert outs == plain
    assert stats["spec_decode_num_drafts"] > 0
    assert stats["spec_decode_num_accepted_tokens"] == stats["spec_decode_num_draft_tokens"], stats
    assert stats["spec_decode_mean_acceptance_length"] > 3.5, stats  # k = 3: 4 but for the capped last drafts


def test_seeded_sampled_runs_repeat_and_accept_some_drafts():
    """Seeded sampling with draft-model drafts: the same seeds give the same tokens in another batch
    order, and with draft == target at T = 1 (q = p) most drafts are accepted (min(1, p/q) = 1)."""
    params = [SamplingParams(max_tokens=12, temperature=1.0, seed=s, ignore_eos=True) for s in (1, 2, 3)]
    first, _ = generate(DRAFT, params)
    llm = LLM("tiny-llama", speculative_config=DRAFT, **BASE)
    again = llm.generate(PROMPTS[::-1], params[::-1], use_tqdm=False)
    assert [o.outputs[0].token_ids for o in again][::-1] == first
    _, stats = generate(SELF, params)
    assert stats["spec_decode_num_accepted_tokens"] == stats["spec_decode_num_draft_tokens"] > 0, stats


# ---- bad input -------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("spec, match", [
    ({**DRAFT, "model": ""}, r"speculative_config\['model'\] must be a preset name or a model folder"),
    ({**DRAFT, "model": None}, r"speculative_config\['model'\]"),
    ({**DRAFT, "prompt_lookup_max": 3}, r"unknown key\(s\) \['prompt_lookup_max'\] for method 'draft_model'"),
    ({**DRAFT, "num_speculative_tokens": 0}, r"num_speculative_tokens'\] must be an int in \[1, 16\]"),
])
def test_bad_draft_model_config_is_refused_by_name(spec, match):
    with pytest.raises(ValueError, match=match):
        EngineConfig(speculative_config=spec)


def test_a_draft_with_another_vocabulary_is_refused():
    with pytest.raises(ValueError, match=r"speculative_config\['model'\]='small-llama' has vocab_size 8192.*"
                                         r"vocab_size 512"):
        LLM("tiny-llama", speculative_config={**DRAFT, "model": "small-llama"}, **BASE)


def test_a_draft_with_a_shorter_context_is_refused(tmp_path):
    folder = tmp_path / "short-draft"
    shutil.copytree(resolve_model("tiny-llama-draft"), folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 64}))
    with pytest.raises(ValueError, match=r"max_position_embeddings 64, shorter than max_model_len 128"):
        LLM("tiny-llama", speculative_config={**DRAFT, "model": str(folder)}, **BASE)
    LLM("tiny-llama", speculative_config={**DRAFT, "model": str(folder)}, **{**BASE, "max_model_len": 64})
