"""Flash-decoding's split policy (kernels/split_policy.py) and how the engine applies it per step:
powers of two (few CUDA graphs), 1 on CPU, more splits for fewer and longer sequences."""
from __future__ import annotations

import pytest

import kernels.cpu
from engine_core import LLM, SamplingParams
from kernels.split_policy import SPLIT_COUNTS, choose_num_splits


def test_the_policy_picks_from_a_small_set_and_never_splits_without_sms():
    for num_seqs in (1, 2, 7, 64, 300):
        for max_len in (1, 300, 4096, 40000):
            assert choose_num_splits(num_seqs, 8, max_len, num_sms=132) in SPLIT_COUNTS
            assert choose_num_splits(num_seqs, 8, max_len, num_sms=0) == 1


def test_fewer_or_shorter_sequences_never_get_more_splits_than_they_can_use():
    assert [choose_num_splits(n, 8, 32768, 132) for n in (1, 2, 4, 8, 16, 32, 64)] == [64, 32, 16, 8, 4, 2, 1]
    # 4 tiles of 64 tokens per split at least: 1000 tokens allow 2 splits (500 each), not 4 (250)
    assert [choose_num_splits(1, 8, n, 132) for n in (255, 511, 512, 1000, 1024)] == [1, 1, 2, 2, 4]


@pytest.fixture
def recorded_splits(monkeypatch):
    """The num_splits of every decode-op call of the cpu backend (the engine's default on CPU)."""
    calls: list[int] = []
    decode = kernels.cpu.paged_attention_decode

    def spy(*args, num_splits=1, **kw):
        calls.append(num_splits)
        return decode(*args, num_splits=num_splits, **kw)

    monkeypatch.setattr(kernels.cpu, "paged_attention_decode", spy)
    return calls


def test_the_engine_applies_the_policy_to_each_step(recorded_splits):
    """A 1500-token prompt and a short one with a GPU's 132 SMs pretended. 2 sequences x 2 KV heads are
    4 programs, far from 2 per SM, so the length decides: 1500 tokens allow 4 splits of >= 256 (4 tiles
    of 64), not 8. The prefill step's last layer (the emitting rows: one decode-op call) and both
    layers of the 2 decode steps run with 4 splits. The cpu backend ignores the count: same tokens."""
    prompts = [[3 + i % 400 for i in range(1500)], [5, 6, 7]]
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    plain = LLM("tiny-llama", num_gpu_blocks=200, max_num_batched_tokens=2048)
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
    assert set(recorded_splits) == {1}
    recorded_splits.clear()
    llm = LLM("tiny-llama", num_gpu_blocks=200, max_num_batched_tokens=2048)
    llm.engine.runner.num_sms = 132
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == want
    assert recorded_splits == [4] * 5, recorded_splits
