"""KV tensors: layout, batched block copies between device cache and swap pool, fp8 scales, sizing."""
from __future__ import annotations

import pytest
import torch

from engine_core import LLM, LLMEngine, SamplingParams
from engine_core.worker.kv_cache import KVCache, swap_blocks
from engine_core.worker.kv_scales import DynamicScales
from engine_core.models.loader import read_config
from engine_core.presets import preset_path


def _filled_cache(num_cpu_blocks: int = 4) -> KVCache:
    kv = KVCache(num_layers=2, num_blocks=6, block_size=4, num_kv_heads=2, head_dim=8, dtype=torch.float32,
                 device=torch.device("cpu"), num_cpu_blocks=num_cpu_blocks)
    for layer in range(2):
        kv.key[layer].copy_(torch.arange(kv.key[layer].numel(), dtype=torch.float32).view_as(kv.key[layer]) + layer)
        kv.value[layer].copy_(-kv.key[layer])
    return kv


def test_layout_matches_the_kernel_contract():
    kv = _filled_cache()
    assert kv.key[0].shape == (6, 4, 2, 8) and kv.cpu_key[0].shape == (4, 4, 2, 8)
    assert kv.dtype == torch.float32 and kv.num_layers == 2 and kv.num_blocks == 6


def test_swap_out_and_back_in_restores_blocks():
    kv = _filled_cache()
    before = [k.clone() for k in kv.key], [v.clone() for v in kv.value]
    kv.swap_out([(5, 0), (1, 3)])
    for layer in range(2):
        assert torch.equal(kv.cpu_key[layer][0], before[0][layer][5])
        assert torch.equal(kv.cpu_value[layer][3], before[1][layer][1])
        kv.key[layer][[1, 5]] = 0.0
        kv.value[layer][[1, 5]] = 0.0
    kv.swap_in([(0, 2), (3, 4)])  # back into different device blocks
    for layer in range(2):
        assert torch.equal(kv.key[layer][2], before[0][layer][5])
        assert torch.equal(kv.value[layer][4], before[1][layer][1])
        assert torch.equal(kv.key[layer][0], before[0][layer][0])  # untouched


def test_swap_blocks_is_one_indexed_copy_with_overlapping_ids():
    src = torch.arange(5.0)[:, None].repeat(1, 3)
    swap_blocks(src, src, torch.tensor([[0, 1], [1, 0]]))  # a swap, not a chain
    assert src[:2, 0].tolist() == [1.0, 0.0]
    swap_blocks(src, src, torch.empty(0, 2, dtype=torch.int64))
    assert src[:, 0].tolist() == [1.0, 0.0, 2.0, 3.0, 4.0]


@pytest.mark.parametrize("per_head", [False, True])
def test_fp8_cache_has_per_layer_scales_and_calibrates_once(per_head):
    kv = KVCache(2, 4, 4, 2, 8, torch.float32, torch.device("cpu"), kv_cache_dtype="fp8_e4m3",
                 per_head_scales=per_head)
    kv.observer = DynamicScales(kv, per_head)
    assert kv.key[0].dtype == torch.float8_e4m3fn and kv.k_scale[0].shape == ((2,) if per_head else ())
    k, v = torch.full((3, 2, 8), 2.0), torch.full((3, 2, 8), -896.0)
    k[:, 1] = 0.5  # KV head 1 is smaller
    kv.observer(0, k, v)
    kv.observer(1, k * 2, v)
    want_k0 = [2.0 / 448, 0.5 / 448] if per_head else 2.0 / 448
    assert kv.k_scale[0].tolist() == pytest.approx(want_k0) and kv.v_scale[0].tolist() == pytest.approx(
        [2.0, 2.0] if per_head else 2.0)
    assert kv.k_scale[1].tolist() == pytest.approx([4.0 / 448, 1.0 / 448] if per_head else 4.0 / 448)
    assert kv.observer is None  # fixed after the first batch's last layer


def test_fp8_blocks_swap_out_and_in_as_bytes():
    kv = KVCache(1, 4, 2, 1, 4, torch.float32, torch.device("cpu"), kv_cache_dtype="fp8_e5m2", num_cpu_blocks=2)
    kv.key[0].copy_(torch.arange(32.0).view(4, 2, 1, 4).to(torch.float8_e5m2))
    before = kv.key[0].view(torch.uint8).clone()
    kv.swap_out([(3, 0)])
    kv.key[0][3] = 0.0
    kv.swap_in([(0, 1)])
    assert torch.equal(kv.key[0].view(torch.uint8)[1], before[3])


def test_per_head_scales_need_an_fp8_cache():
    with pytest.raises(ValueError, match="per-head scales need an fp8 or int8 kv_cache_dtype"):
        KVCache(1, 4, 2, 2, 4, torch.float32, torch.device("cpu"), per_head_scales=True)


def test_fp8_engine_runs_close_to_fp32():
    """fp8 KV: same first tokens as the fp32 cache for most prompts (quantisation may flip near-ties)."""
    prompts = [[3 + i, 50 + 7 * i, 90, 11 * i % 500 + 3] * (1 + i % 5) for i in range(16)]

    def first_tokens(**kw):
        e = LLMEngine.from_kwargs("tiny-llama", num_gpu_blocks=64, **kw)
        for i, p in enumerate(prompts):
            e.add_request(str(i), p, SamplingParams(max_tokens=1, temperature=0.0))
        out = {}
        while e.has_unfinished_requests():
            out.update({o.request_id: o.outputs[0].token_ids[0] for o in e.step() if o.finished})
        return [out[str(i)] for i in range(len(prompts))]

    exact = first_tokens()
    fp8 = first_tokens(kv_cache_dtype="fp8_e4m3", calculate_kv_scales=True)
    assert sum(a == b for a, b in zip(exact, fp8)) >= 13, (exact, fp8)


def test_cpu_sizing_follows_the_memory_model():
    """num_gpu_blocks = kv_cache_memory_bytes // (2 * layers * kv_heads * head_dim * 4 bytes * block_size)."""
    cfg = read_config(preset_path("tiny-llama"))
    head_dim = cfg["hidden_size"] // cfg["num_attention_heads"]
    per_token = 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * head_dim * 4
    budget = 1_000_000
    e = LLMEngine.from_kwargs("tiny-llama", kv_cache_memory_bytes=budget, block_size=16, swap_space=0.0001)
    kvm = e.scheduler.kv_cache_manager
    assert kvm.num_gpu_blocks == budget // (per_token * 16) == e.runner.kv_cache.num_blocks
    assert kvm.num_cpu_blocks == int(0.0001 * 2**30) // (per_token * 16) == e.runner.kv_cache.cpu_key[0].shape[0]
    # the swap pool is capped at the device cache's size: more could never be used
    e = LLMEngine.from_kwargs("tiny-llama", num_gpu_blocks=10, swap_space=1.0)
    assert e.scheduler.kv_cache_manager.num_cpu_blocks == 10


def test_a_budget_too_small_for_one_block_is_an_error():
    with pytest.raises(ValueError, match="no room for the KV cache"):
        LLMEngine.from_kwargs("tiny-llama", kv_cache_memory_bytes=100)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
def test_cuda_graph_decode_matches_eager():
    prompts = [[5 + i] * (3 + 5 * i) for i in range(6)]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    eager = LLM("tiny-llama", dtype="float32", enforce_eager=True).generate(prompts, params, use_tqdm=False)
    graphs = LLM("tiny-llama", dtype="float32").generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in graphs] == [o.outputs[0].token_ids for o in eager]
