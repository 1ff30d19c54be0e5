"""Acceptance: with LoRA adapters the engine's greedy tokens equal Hugging Face + PEFT `generate`
on the same PEFT folders (fp32, CPU), on every tiny preset; one mixed batch of several adapters
and the base model gives each request what it gets in a batch of its own adapter alone; and an adapter served unmerged gives
the tokens of the base model with the adapter merged into its weights (peft's merge_and_unload).

The batch mixes 4 adapters (ranks 4, 8, 16; attention-only, MLP-only, all modules, rsLoRA) and
the base model under max_loras=2, so adapters wait for slots and slots are reloaded, with chunked
prefill (a 32-token budget) next to decodes. Near-ties are handled as in test_engine_hf.py.
"""
from __future__ import annotations

import pytest
import torch
from lora_helpers import NUM_NEW, hf_greedy, make_prompts, peft_model
from hf_helpers import assert_matches_hf

from engine_core import LLM, LoRARequest, SamplingParams
from engine_core.lora.presets import ADAPTER_PRESETS, adapter_path

PRESETS = ["tiny-llama", "tiny-llama3", "tiny-qwen2", "tiny-qwen3"]
ADAPTERS = list(ADAPTER_PRESETS)  # r8-attn, r16-all, r4-mlp, r16-rslora-qv
PROMPT_LENS = [1, 7, 16, 33, 70]
GREEDY = SamplingParams(max_tokens=NUM_NEW, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module", params=PRESETS)
def reference(request):
    """(preset, prompts, {adapter or None: (HF+PEFT tokens, logits)}), once per preset."""
    name = request.param
    refs = {}
    for adapter in ADAPTERS:
        model = peft_model(name, adapter_path(name, adapter))
        refs[adapter] = hf_greedy(model, prompts := make_prompts(model.config.vocab_size, PROMPT_LENS))
        if adapter == ADAPTERS[0]:
            with model.disable_adapter():
                refs[None] = hf_greedy(model, prompts)
    return name, prompts, refs


def lora_request(name: str, adapter: str | None) -> LoRARequest | None:
    return None if adapter is None else LoRARequest(adapter, ADAPTERS.index(adapter) + 1, str(adapter_path(name, adapter)))


def test_mixed_batch_matches_hf_peft_and_each_request_alone(reference):
    name, prompts, refs = reference
    kinds = ADAPTERS + [None]
    jobs = [(p, kinds[(i + j) % len(kinds)]) for j in range(len(kinds)) for i, p in enumerate(prompts)]
    llm = LLM(name, enable_lora=True, max_loras=2, max_lora_rank=16, block_size=16, num_gpu_blocks=256,
              max_num_batched_tokens=32)
    outputs = llm.generate([p for p, _ in jobs], GREEDY, use_tqdm=False,
                           lora_request=[lora_request(name, a) for _, a in jobs])
    for kind in kinds:
        mine = [(o, prompts.index(p)) for o, (p, a) in zip(outputs, jobs) if a == kind]
        tokens, logits = refs[kind]
        assert_matches_hf([o for o, _ in mine], [tokens[i] for _, i in mine], [logits[i] for _, i in mine],
                          f"{name} adapter={kind} (mixed batch)")
    alone = LLM(name, enable_lora=True, max_loras=1, max_lora_rank=16, block_size=16, num_gpu_blocks=256)
    for kind in kinds:  # each adapter's requests in a batch of their own (no other adapter, unchunked)
        mine = [(p, o) for (p, a), o in zip(jobs, outputs) if a == kind]
        got = alone.generate([p for p, _ in mine], GREEDY, use_tqdm=False, lora_request=lora_request(name, kind))
        for (p, mixed), own in zip(mine, got):
            assert own.outputs[0].token_ids == mixed.outputs[0].token_ids, (
                f"{name} adapter={kind} prompt len {len(p)}: alone {own.outputs[0].token_ids}, in the mixed batch "
                f"{mixed.outputs[0].token_ids}")
    kvm = llm.engine.scheduler.kv_cache_manager
    assert kvm.num_free_blocks == kvm.num_gpu_blocks
    pins = llm.engine.runner.lora.request_lora
    assert set(pins) <= llm.engine.scheduler.finished_req_ids, "only requests the runner has yet to forget pin slots"
    llm.engine.step()  # an empty step: its SchedulerOutput tells the runner to forget the finished requests
    assert pins == {}, "finished requests must not pin slots"


def test_unmerged_adapter_equals_merged_weights(reference, tmp_path):
    """The base model with W + scaling * B @ A (peft's merge_and_unload, saved as a checkpoint) served
    without LoRA gives the tokens the adapter gives unmerged."""
    name, prompts, refs = reference
    adapter = "r16-all"
    merged = peft_model(name, adapter_path(name, adapter)).merge_and_unload()
    merged.save_pretrained(tmp_path)
    with torch.inference_mode():
        merged_tokens, merged_logits = hf_greedy(merged, prompts)
    unmerged = LLM(name, enable_lora=True, max_lora_rank=16, num_gpu_blocks=64).generate(
        prompts, GREEDY, use_tqdm=False, lora_request=lora_request(name, adapter))
    plain = LLM(str(tmp_path), num_gpu_blocks=64).generate(prompts, GREEDY, use_tqdm=False)
    assert_matches_hf(unmerged, merged_tokens, merged_logits, f"{name} {adapter} unmerged vs merged (HF)")
    assert_matches_hf(plain, merged_tokens, merged_logits, f"{name} {adapter} merged checkpoint in the engine")
    assert [o.outputs[0].token_ids for o in unmerged] == [o.outputs[0].token_ids for o in plain]
