"""Lab 09's experiment keeps its lesson on a loaded machine: the deterministic measure (engine steps)
of merged-one-adapter-at-a-time serving exceeds unmerged batched serving by the number of adapters,
with the same tokens, while a busy-looping process runs on every core (wall clock would not hold)."""
from __future__ import annotations

import torch
from cpu_hog import cpu_hog

from engine_core import LLM, LoRARequest, SamplingParams
from engine_core.lora.adapter import load_adapter, merge_adapter
from engine_core.lora.presets import adapter_path

NUM_REQUESTS, PROMPT_LEN, OUTPUT_LEN, NUM_ADAPTERS = 8, 6, 4, 4
GREEDY = SamplingParams(max_tokens=OUTPUT_LEN, temperature=0.0, ignore_eos=True)


def _steps(llm: LLM, prompts, lora_request) -> tuple[int, list[list[int]]]:
    before = llm.engine.stats()["num_steps"]
    outs = llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=lora_request)
    return llm.engine.stats()["num_steps"] - before, [list(o.outputs[0].token_ids) for o in outs]


def test_merged_serving_takes_more_steps_under_a_cpu_hog():
    with cpu_hog():
        prompts = [[(11 * i + j) % 400 + 3 for j in range(PROMPT_LEN)] for i in range(NUM_REQUESTS)]
        loras = [LoRARequest(f"a{k}", k + 1, str(adapter_path("tiny-llama", "r8-attn", k))) for k in range(NUM_ADAPTERS)]
        which = [i % NUM_ADAPTERS for i in range(NUM_REQUESTS)]
        common = dict(device="cpu", max_num_batched_tokens=256, num_gpu_blocks=128)
        unmerged = LLM("tiny-llama", enable_lora=True, max_loras=NUM_ADAPTERS, max_lora_rank=16, **common)
        steps_u, tokens_u = _steps(unmerged, prompts, [loras[k] for k in which])
        base = LLM("tiny-llama", **common)
        model = base.engine.runner.model
        saved = [p.detach().clone() for p in model.parameters()]
        steps_m, tokens_m = 0, {}
        for k in range(NUM_ADAPTERS):
            rows = [i for i in range(NUM_REQUESTS) if which[i] == k]
            merge_adapter(model, load_adapter(loras[k], base.engine.model_config.args, 16, torch.float32))
            s, toks = _steps(base, [prompts[i] for i in rows], None)
            steps_m += s
            tokens_m.update(zip(rows, toks))
            with torch.no_grad():
                for p, v in zip(model.parameters(), saved):
                    p.copy_(v)
    assert (steps_u, steps_m) == (OUTPUT_LEN, NUM_ADAPTERS * OUTPUT_LEN)
    assert [tokens_m[i] for i in range(NUM_REQUESTS)] == tokens_u
