"""The parallel engine's rules without starting a process: vLLM's pipeline layer split, which heads and
rows a TP rank holds (KV heads replicated past num_kv_heads), the vocab shards' padding, and the
machine-size refusal that comes before any worker is spawned."""
from __future__ import annotations

import pytest
import torch

from engine_core import LLM
from engine_core.distributed import multiproc_executor
from engine_core.distributed.parallel_state import GroupCoordinator, get_pp_indices, output_rank
from engine_core.models.parallel_linear import TPShard, VocabParallelEmbedding
from parallel_helpers import child_processes


@pytest.mark.parametrize("num_layers, pp, expected", [
    (2, 2, [(0, 1), (1, 2)]),
    (5, 2, [(0, 3), (3, 5)]),  # the remainder goes to the stage before the last
    (10, 4, [(0, 2), (2, 5), (5, 8), (8, 10)]),  # vLLM's docstring example
    (28, 3, [(0, 9), (9, 19), (19, 28)]),
    (3, 3, [(0, 1), (1, 2), (2, 3)]),
])
def test_pp_layer_split_is_vllms(num_layers, pp, expected):
    assert [get_pp_indices(num_layers, r, pp) for r in range(pp)] == expected


def shard(rank: int, size: int) -> TPShard:
    return TPShard(GroupCoordinator(list(range(size)), rank))


@pytest.mark.parametrize("heads, kv_heads, tp, expected", [
    (4, 2, 2, [((0, 2), (0, 1)), ((2, 4), (1, 2))]),  # one KV head each
    (4, 1, 2, [((0, 2), (0, 1)), ((2, 4), (0, 1))]),  # the one KV head on both ranks
    (8, 2, 4, [((0, 2), (0, 1)), ((2, 4), (0, 1)), ((4, 6), (1, 2)), ((6, 8), (1, 2))]),  # each KV head twice
    (8, 8, 2, [((0, 4), (0, 4)), ((4, 8), (4, 8))]),
])
def test_tp_heads_with_kv_replication(heads, kv_heads, tp, expected):
    got = [shard(r, tp).heads(heads, kv_heads) for r in range(tp)]
    assert [((q.start, q.stop), (kv.start, kv.stop)) for q, kv in got] == expected
    for (q, kv) in got:  # every query head of a rank finds its KV head (GQA group) on that rank
        group = heads // kv_heads
        assert all(kv.start <= h // group < kv.stop for h in range(q.start, q.stop))


def test_vocab_shards_are_padded_with_zero_rows():
    full = torch.arange(5 * 2, dtype=torch.float32).view(5, 2)
    a, b = (VocabParallelEmbedding.shard(full, shard(r, 2).group) for r in range(2))
    assert torch.equal(a, full[:3]) and torch.equal(b[:2], full[3:]) and not b[2].any()


def test_output_rank_is_the_last_stage_tp_rank_0():
    assert output_rank(2, 1) == 0 and output_rank(1, 2) == 1 and output_rank(2, 3) == 4


def test_more_ranks_than_cores_is_refused_before_any_process(monkeypatch):
    monkeypatch.setattr(multiproc_executor.os, "cpu_count", lambda: 1)
    before = {p.pid for p in child_processes()}
    with pytest.raises(ValueError, match="= 2 worker processes need at least one CPU core each; this machine has 1"):
        LLM("tiny-llama", tensor_parallel_size=2)
    assert {p.pid for p in child_processes()} == before
