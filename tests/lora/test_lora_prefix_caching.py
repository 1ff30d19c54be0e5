"""Prefix caching with adapters, end to end: blocks are keyed by the adapter id, so the same prompt
under two adapters (or an adapter and the base model) never shares KV, while repeating it under
one adapter hits the cache; the tokens equal an engine without prefix caching."""
from __future__ import annotations

from engine_core import LLM, LoRARequest, SamplingParams
from engine_core.lora.presets import adapter_path

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
PROMPT = list(range(3, 53))  # 50 tokens: 3 full blocks of 16


def test_the_same_prompt_under_different_adapters_never_shares_blocks():
    a, b = (LoRARequest(n, i, str(adapter_path("tiny-llama", n))) for i, n in ((1, "r8-attn"), (2, "r4-mlp")))
    order = [a, b, None, a]
    cached = LLM("tiny-llama", enable_lora=True, max_loras=2, enable_prefix_caching=True, num_gpu_blocks=64)
    got = [cached.generate([PROMPT], GREEDY, use_tqdm=False, lora_request=r)[0] for r in order]
    assert [o.num_cached_tokens for o in got] == [0, 0, 0, 48], "only the repeat under the same adapter hits"
    plain = LLM("tiny-llama", enable_lora=True, max_loras=2, num_gpu_blocks=64)
    expected = [plain.generate([PROMPT], GREEDY, use_tqdm=False, lora_request=r)[0] for r in order]
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in expected]
    assert len({tuple(o.outputs[0].token_ids) for o in got[:3]}) == 3, "the adapters must change the tokens"
