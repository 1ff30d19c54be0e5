"""kv_cache_dtype="int8" through the engine: symmetric int8 with the fp8 cache's scales (dynamic from the first
batch, a calibration file, per tensor or per KV head), half of bf16's bytes, tokens close to the fp32 cache,
preemption unchanged, and refusals before the weights load (no scales; the Triton backend)."""
from __future__ import annotations

import importlib.util

import pytest
import torch

from engine_core import LLM, LLMEngine, SamplingParams
from engine_core.calibrate import calibrate_kv_amax
from engine_core.worker.kv_scales import save_kv_amax

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
PROMPTS = [[3 + i, 50 + 7 * i, 90, 11 * i % 500 + 3] * (1 + i % 5) for i in range(16)]


def _tokens(llm: LLM, prompts, params=GREEDY) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.fixture(scope="module")
def scales_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("int8") / "scales.json"
    save_kv_amax(path, calibrate_kv_amax("tiny-llama", max_tokens=4), "tiny-llama")
    return path


@pytest.mark.parametrize("per_head", [False, True])
def test_int8_dynamic_scales_are_amax_over_127(per_head):
    llm = LLM("tiny-llama", kv_cache_dtype="int8", calculate_kv_scales=True, kv_scales_per_head=per_head,
              num_gpu_blocks=64)
    kv = llm.engine.runner.kv_cache
    assert kv.key[0].dtype == torch.int8 and kv.k_scale[0].shape == ((2,) if per_head else ())
    assert all(len(t) == 6 for t in _tokens(llm, PROMPTS[:3]))
    assert kv.observer is None
    codes = torch.cat([c.reshape(-1, 2, 16) for c in kv.key])
    assert codes.abs().max() == 127  # the first batch's largest |K| maps onto the top code


def test_int8_with_a_scales_file_stays_close_to_the_fp32_cache(scales_file):
    """Calibrated int8 KV, per head: the same next token as the fp32 cache on most of 16 prompts (as the e4m3
    test: one rounding can flip a near-tie of tiny-llama's random weights)."""
    params = SamplingParams(max_tokens=1, temperature=0.0)
    exact = _tokens(LLM("tiny-llama", num_gpu_blocks=64), PROMPTS, params)
    int8 = _tokens(LLM("tiny-llama", kv_cache_dtype="int8", kv_cache_scales=str(scales_file), kv_scales_per_head=True,
                       num_gpu_blocks=64), PROMPTS, params)
    assert sum(a == b for a, b in zip(exact, int8)) >= 14, (exact, int8)


def test_a_scales_file_gives_int8_scales(scales_file):
    from engine_core.worker.kv_scales import load_kv_amax
    amax = load_kv_amax(scales_file, 2, 2)
    llm = LLM("tiny-llama", kv_cache_dtype="int8", kv_cache_scales=str(scales_file), kv_scales_per_head=True,
              num_gpu_blocks=64)
    k = torch.stack([s for s in llm.engine.runner.kv_cache.k_scale])
    assert torch.allclose(k, amax.key / 127)


def test_int8_holds_twice_the_bf16_blocks():
    budget = 3_000_000

    def blocks(**kw):
        e = LLMEngine.from_kwargs("tiny-llama", dtype="bfloat16", kv_cache_memory_bytes=budget, swap_space=0, **kw)
        return e.runner.kv_cache.num_blocks, e.runner.kv_cache.key[0].element_size()

    (plain, plain_bytes), (int8, int8_bytes) = blocks(), blocks(kv_cache_dtype="int8", calculate_kv_scales=True)
    block = 2 * 2 * 2 * 16 * 16  # K and V, 2 layers, 2 KV heads, head_dim 16, block_size 16, 1 byte
    assert (plain_bytes, int8_bytes) == (2, 1)
    assert (int8, plain) == (budget // block, budget // (2 * block))


def test_int8_outputs_survive_swap_preemption(scales_file):
    """Static scales: a block's codes depend only on its tokens, so swapping int8 blocks out and back changes
    nothing."""
    def run(**kw):
        llm = LLM("tiny-llama", block_size=4, max_model_len=128, max_num_batched_tokens=32, kv_cache_dtype="int8",
                  kv_cache_scales=str(scales_file), **kw)
        return _tokens(llm, PROMPTS[:8], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)), \
            llm.engine.stats()

    plenty, _ = run(num_gpu_blocks=400)
    tight, stats = run(num_gpu_blocks=20, preemption_mode="swap")
    assert stats["num_preemptions"] > 0 and tight == plenty


def test_int8_without_scales_is_refused_before_load():
    with pytest.raises(ValueError, match="kv_cache_dtype='int8' needs scales: calculate_kv_scales=True"):
        LLMEngine.from_kwargs("tiny-llama", kv_cache_dtype="int8")


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="the Triton backend needs triton")
def test_int8_on_the_triton_backend_is_refused_before_load(monkeypatch):
    import engine_core.worker.model_runner as model_runner

    def no_load(*args, **kwargs):
        raise AssertionError("the weights were loaded before the refusal")

    monkeypatch.setattr(model_runner, "load_model", no_load)
    with pytest.raises(ValueError, match="kv_cache_dtype='int8' runs on the cpu and torch backends only"):
        LLMEngine.from_kwargs("tiny-llama", kv_cache_dtype="int8", calculate_kv_scales=True,
                              attention_backend="triton")
