"""TP=2 x PP=2: four workers (two stages of two TP ranks; ranks 0,1 stage 0, ranks 2,3 stage 1; rank 2
samples). The engine refuses more ranks than CPU cores, so on the 2-core test machine this test lets the
engine's check see 4 cores (the workers still get one thread each): it is here to run the TP and PP
groups together, not for speed. Same checks as tests/distributed/test_parallel_tp.py (tolerances explained there)."""
from __future__ import annotations

import pytest

from engine_core.executor import multiproc_executor
from parallel_helpers import engine_pair, kv_cache_shape
from test_parallel_tp import (test_greedy_tokens_equal_tp1_under_chunking_prefix_caching_and_preemption,
                              test_logits_match_tp1_and_float64)

pytestmark = pytest.mark.timeout(600)
__all__ = ["test_greedy_tokens_equal_tp1_under_chunking_prefix_caching_and_preemption",
           "test_logits_match_tp1_and_float64"]


@pytest.fixture(scope="module")
def engines():
    with pytest.MonkeyPatch.context() as mp:
        cores = multiproc_executor.os.cpu_count() or 1
        mp.setattr(multiproc_executor.os, "cpu_count", lambda: max(cores, 4))
        pairs = engine_pair("tiny-llama", tensor_parallel_size=2, pipeline_parallel_size=2)
        first = next(pairs)
    yield first
    next(pairs, None)


def test_each_rank_caches_its_heads_of_its_stage_layers(engines):
    _, one, tp_pp, _ = engines
    (shape, layers), = one.engine.executor.collective_rpc(kv_cache_shape)
    per_rank = tp_pp.engine.executor.collective_rpc(kv_cache_shape)
    assert per_rank == [((shape[0], shape[1], shape[2] // 2, shape[3]), 1)] * 4
    assert tp_pp.engine.executor.output_rank == 2
