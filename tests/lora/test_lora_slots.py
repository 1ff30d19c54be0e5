"""Adapter memory: the GPU slot pool (LRU, running requests' adapters pinned), the host cache
(`max_cpu_loras`, LRU), and the rows' slot mapping the runner builds for one step."""
from __future__ import annotations

import pytest
import torch

from engine_core.lora.cache import LoRACache
from engine_core.lora.request import LoRARequest
from engine_core.lora.slots import LoRASlotPool
from engine_core.models.lora import LoRABatch


def test_free_slots_first_then_the_least_recently_used_unpinned_adapter():
    pool = LoRASlotPool(2)
    assert pool.assign([7], pinned={7}) == [(7, 0)]
    assert pool.assign([8, 7], pinned={7, 8}) == [(8, 1)]  # 7 is resident: nothing to load
    assert pool.assign([7], pinned={7}) == []  # 7 used now: 8 is the least recently used
    assert pool.assign([9], pinned={7, 9}) == [(9, 1)], "8 (unpinned, least recently used) gives its slot"
    assert dict(pool.slot_of) == {7: 0, 9: 1}


def test_a_pinned_adapter_keeps_its_slot_even_when_least_recently_used():
    pool = LoRASlotPool(2)
    pool.assign([1, 2], pinned={1, 2})
    pool.assign([2], pinned={1, 2})  # 1 is least recently used but still running (not scheduled this step)
    assert pool.assign([3], pinned={1, 3}) == [(3, pool.slot_of[3])] and 1 in pool.slot_of and 2 not in pool.slot_of


def test_no_room_is_an_error_that_changes_nothing():
    pool = LoRASlotPool(2)
    pool.assign([1, 2], pinned={1, 2})
    before = dict(pool.slot_of)
    with pytest.raises(RuntimeError, match="max_loras"):
        pool.assign([3], pinned={1, 2, 3})
    assert dict(pool.slot_of) == before and pool.free_slots == []


def test_one_step_never_evicts_its_own_adapters():
    pool = LoRASlotPool(3)
    pool.assign([1, 2, 3], pinned=set())
    loads = pool.assign([4, 1, 5], pinned=set())  # 2 and 3 go, 1 stays
    assert sorted(i for i, _ in loads) == [4, 5] and set(pool.slot_of) == {1, 4, 5}
    assert sorted(pool.slot_of.values()) == [0, 1, 2]


def test_host_cache_is_lru_and_a_failed_load_changes_nothing():
    loads = []

    def load(req: LoRARequest) -> str:
        if req.lora_name == "bad":
            raise ValueError("bad folder")
        loads.append(req.lora_int_id)
        return f"adapter {req.lora_int_id}"

    cache = LoRACache(2, load)
    a, b, c = (LoRARequest(n, i, "/x") for n, i in (("a", 1), ("b", 2), ("c", 3)))
    cache.get(a), cache.get(b), cache.get(a), cache.get(c)  # b is least recently used when c arrives
    assert list(cache.adapters) == [1, 3] and loads == [1, 2, 3]
    assert cache.get(b) == "adapter 2" and loads == [1, 2, 3, 2], "an evicted adapter is read from disk again"
    with pytest.raises(ValueError):
        cache.get(LoRARequest("bad", 4, "/x"))
    assert list(cache.adapters) == [3, 2] and cache.num_loads == 4


def test_mapping_rows_segments_and_output_rows():
    """Batch order: 2 decode rows (slots 1, -1), then prefill chunks of 3, 2 (both slot 0), 4 (-1), 1 (slot 1)."""
    batch = LoRABatch.build(slots=[1, -1, 0, 0, -1, 1], num_tokens=[1, 1, 3, 2, 4, 1],
                            emits=[True, True, False, True, True, True], num_decode=2, every_row_emits=False,
                            device=torch.device("cpu"), backend="torch")
    m = batch.all_rows
    assert m.row_slots.tolist() == [1, -1]
    assert m.seg_starts.tolist() == [0, 5, 9, 10] and m.seg_slots.tolist() == [0, -1, 1] and m.max_seg_len == 5
    out = batch.rows(only_output_rows=True)
    assert out.row_slots.tolist() == [1, -1, 0, -1, 1] and out.seg_slots.numel() == 0
    assert batch.rows(only_output_rows=False) is m
    every = LoRABatch.build([2], [1], [True], 1, True, torch.device("cpu"), "torch")
    assert every.rows(only_output_rows=True) is every.all_rows
