"""KVCacheManager rules: block-table growth, None when it cannot allocate, swap plans."""
import pytest
from grader.harness import make_request

from engine_core.core.kv_cache_manager import KVCacheManager


def test_block_table_grows_one_block_per_block_size_tokens():
    kvm = KVCacheManager(num_gpu_blocks=8, block_size=4)
    req = make_request("a", 10)
    new = kvm.allocate_slots(req, 10)
    assert len(new) == 3 and kvm.get_block_ids("a") == [0, 1, 2]
    req.num_computed_tokens = 10
    assert kvm.allocate_slots(req, 2) == []  # positions 10, 11 still fit block 2
    req.num_computed_tokens = 12
    assert [b.block_id for b in kvm.allocate_slots(req, 1)] == [3]


def test_allocate_returns_none_and_changes_nothing_when_blocks_run_out():
    kvm = KVCacheManager(num_gpu_blocks=3, block_size=4)
    kvm.allocate_slots(make_request("a", 8), 8)
    b = make_request("b", 8)
    assert kvm.allocate_slots(b, 8) is None
    assert kvm.get_block_ids("b") == [] and kvm.num_free_blocks == 1


def test_free_returns_the_table_tail_first():
    kvm = KVCacheManager(num_gpu_blocks=4, block_size=2)
    req = make_request("a", 6)
    kvm.allocate_slots(req, 6)
    kvm.free(req)
    assert list(kvm.block_pool.free_queue) == [3, 2, 1, 0]
    assert kvm.get_block_ids("a") == [] and kvm.usage == 0.0


def test_swap_out_copies_only_blocks_with_written_kv_and_frees_the_gpu_table():
    kvm = KVCacheManager(num_gpu_blocks=4, block_size=4, num_cpu_blocks=4)
    req = make_request("a", 9)
    kvm.allocate_slots(req, 9)  # 3 blocks
    req.num_computed_tokens = 5  # KV only in blocks 0 and 1
    assert kvm.swap_out(req) == [(0, 0), (1, 1)]
    assert kvm.get_block_ids("a") == [] and kvm.num_free_blocks == 4
    assert kvm.get_cpu_block_ids("a") == [0, 1]


def test_swap_in_maps_cpu_blocks_to_fresh_gpu_blocks_and_frees_the_cpu_ones():
    kvm = KVCacheManager(num_gpu_blocks=4, block_size=4, num_cpu_blocks=2)
    req = make_request("a", 8)
    kvm.allocate_slots(req, 8)
    req.num_computed_tokens = 8
    kvm.swap_out(req)
    kvm.allocate_slots(make_request("b", 4), 4)  # another request takes a GPU block meanwhile
    mapping = kvm.swap_in(req)
    assert [c for c, _ in mapping] == [0, 1]
    assert [g for _, g in mapping] == kvm.get_block_ids("a")
    assert not set(kvm.get_block_ids("a")) & set(kvm.get_block_ids("b"))
    assert kvm.cpu_block_pool.num_free_blocks == 2


def test_swap_out_without_cpu_room_is_an_error_not_a_partial_copy():
    kvm = KVCacheManager(num_gpu_blocks=4, block_size=4, num_cpu_blocks=1)
    req = make_request("a", 8)
    kvm.allocate_slots(req, 8)
    req.num_computed_tokens = 8
    assert not kvm.can_swap_out(req)
    with pytest.raises(ValueError, match="needs 2 CPU blocks"):
        kvm.swap_out(req)
    assert kvm.get_block_ids("a") == [0, 1]


def test_free_releases_cpu_blocks_of_a_swapped_request():
    kvm = KVCacheManager(num_gpu_blocks=2, block_size=4, num_cpu_blocks=2)
    req = make_request("a", 8)
    kvm.allocate_slots(req, 8)
    req.num_computed_tokens = 8
    kvm.swap_out(req)
    kvm.free(req)
    assert kvm.cpu_usage == 0.0 and kvm.usage == 0.0
