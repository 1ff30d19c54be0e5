"""The parallel engine's rules without starting a process: vLLM's pipeline layer split, which heads and
rows a TP rank holds (KV heads replicated past num_kv_heads), the vocab shards' padding, the general
plugins a worker runs (ENGINE_CORE_PLUGINS), and the machine-size refusal that comes before any worker
is spawned."""
from __future__ import annotations

import pytest
import torch

from engine_core import LLM
from engine_core.executor import multiproc_executor
from engine_core.distributed.parallel_state import GroupCoordinator, get_pp_indices, output_rank
from engine_core.models.parallel_linear import COLUMN, ROW, TPShard, VocabParallelEmbedding, layer_shards
from engine_core.executor.plugins import PLUGINS_ENV, load_general_plugins
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
    d, mlp = 4, 8 * tp  # head_dim, intermediate_size
    got = [shard(r, tp).layer(heads, kv_heads, d, mlp) for r in range(tp)]
    as_heads = [((s["q_proj"][1].start // d, s["q_proj"][1].stop // d), (s["k_proj"][1].start // d, s["k_proj"][1].stop // d))
                for s in got]
    assert as_heads == expected
    group = heads // kv_heads
    for r, s in enumerate(got):  # every query head of a rank finds its KV head (GQA group) on that rank
        (q0, q1), (kv0, kv1) = as_heads[r]
        assert all(kv0 <= h // group < kv1 for h in range(q0, q1))
        assert s["v_proj"] == s["k_proj"] and s["o_proj"] == (ROW, s["q_proj"][1])
        assert s["gate_proj"] == s["up_proj"] == (COLUMN, slice(8 * r, 8 * (r + 1))) and s["down_proj"] == (ROW, s["up_proj"][1])
    assert got[0] == layer_shards(heads, kv_heads, d, mlp, 0, tp)


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


def test_general_plugins_run_in_order_and_a_malformed_entry_is_named(monkeypatch):
    calls = []
    monkeypatch.setattr(torch, "_plugin_probe_a", lambda: calls.append("a"), raising=False)
    monkeypatch.setattr(torch, "_plugin_probe_b", lambda: calls.append("b"), raising=False)
    monkeypatch.setenv(PLUGINS_ENV, "torch:_plugin_probe_b, torch:_plugin_probe_a")
    assert load_general_plugins() == ["torch:_plugin_probe_b", "torch:_plugin_probe_a"] and calls == ["b", "a"]
    monkeypatch.setenv(PLUGINS_ENV, "torch._plugin_probe_a")
    with pytest.raises(ValueError, match="'package.module:function', got 'torch._plugin_probe_a'"):
        load_general_plugins()
    monkeypatch.delenv(PLUGINS_ENV)
    assert load_general_plugins() == []
