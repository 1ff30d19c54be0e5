"""Tensor parallelism with fewer KV heads than ranks: tiny-qwen2 (4 query heads, 1 KV head, qkv bias) at
tensor_parallel_size=2 replicates its KV head on both ranks (vLLM's rule) and shards the query heads
and the biases; preemption by swapping here (each rank copies its own heads' blocks to its own CPU
pool, from the one swap plan of the message). The same checks as tests/distributed/test_parallel_tp.py
(tolerances explained there)."""
from __future__ import annotations

import pytest

from parallel_helpers import engine_pair
from test_parallel_tp import (test_each_rank_caches_its_own_kv_heads, test_greedy_tokens_equal_tp1_under_chunking_prefix_caching_and_preemption,
                              test_logits_match_tp1_and_float64)

pytestmark = pytest.mark.timeout(600)
__all__ = ["test_each_rank_caches_its_own_kv_heads", "test_greedy_tokens_equal_tp1_under_chunking_prefix_caching_and_preemption",
           "test_logits_match_tp1_and_float64"]


@pytest.fixture(scope="module")
def engines():
    yield from engine_pair("tiny-qwen2", tensor_parallel_size=2, preemption_mode="swap")
