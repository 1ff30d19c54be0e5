"""BlockPool rules: ref counts, the free queue in eviction (LRU) order, the prefix-cache map."""
import pytest

from engine_core.core.block_pool import BlockPool
from engine_core.core.kv_cache_manager import hash_block_tokens


def ids(blocks):
    return [b.block_id for b in blocks]


def free_order(pool):
    return list(pool.free_queue)


def test_new_blocks_come_from_the_front_with_ref_count_one():
    pool = BlockPool(4)
    blocks = pool.get_new_blocks(3)
    assert ids(blocks) == [0, 1, 2]
    assert [b.ref_cnt for b in blocks] == [1, 1, 1]
    assert free_order(pool) == [3] and pool.num_free_blocks == 1
    assert pool.usage == pytest.approx(0.75)


def test_asking_for_more_than_free_raises_and_changes_nothing():
    pool = BlockPool(2)
    with pytest.raises(ValueError, match=r"num_blocks must be in \[0, 2\]"):
        pool.get_new_blocks(3)
    assert pool.num_free_blocks == 2


def test_freed_blocks_join_the_tail_in_the_order_given():
    pool = BlockPool(4)
    a, b, c, d = pool.get_new_blocks(4)
    pool.free_blocks([c, a])
    pool.free_blocks([d])
    assert free_order(pool) == [2, 0, 3]
    assert ids(pool.get_new_blocks(2)) == [2, 0]  # least recently freed first


def test_shared_block_is_free_only_when_the_last_holder_frees_it():
    pool = BlockPool(2)
    (a,) = pool.get_new_blocks(1)
    pool.touch([a])
    assert a.ref_cnt == 2
    pool.free_blocks([a])
    assert a.ref_cnt == 1 and 0 not in pool.free_queue
    pool.free_blocks([a])
    assert a.ref_cnt == 0 and 0 in pool.free_queue


def test_double_free_is_an_error():
    pool = BlockPool(1)
    (a,) = pool.get_new_blocks(1)
    pool.free_blocks([a])
    with pytest.raises(ValueError, match="already free"):
        pool.free_blocks([a])


def test_touch_takes_a_free_cached_block_out_of_the_free_queue():
    pool = BlockPool(3)
    a, b = pool.get_new_blocks(2)
    h = hash_block_tokens(None, [1, 2])
    pool.cache_full_blocks([a], [h])
    pool.free_blocks([a, b])
    assert pool.get_cached_block(h) is a  # freed but still cached
    pool.touch([a])
    assert a.ref_cnt == 1 and free_order(pool) == [2, 1]


def test_eviction_drops_the_hash_least_recently_used_first():
    pool = BlockPool(2)
    a, b = pool.get_new_blocks(2)
    ha, hb = hash_block_tokens(None, [1]), hash_block_tokens(None, [2])
    pool.cache_full_blocks([a, b], [ha, hb])
    pool.free_blocks([b, a])  # b freed first: b is evicted first
    (new,) = pool.get_new_blocks(1)
    assert new is b and b.block_hash is None
    assert pool.get_cached_block(hb) is None and pool.get_cached_block(ha) is a


def test_second_block_with_a_known_hash_is_not_cached():
    pool = BlockPool(2)
    a, b = pool.get_new_blocks(2)
    h = hash_block_tokens(None, [7, 7])
    pool.cache_full_blocks([a], [h])
    pool.cache_full_blocks([b], [h])
    assert pool.get_cached_block(h) is a and b.block_hash is None


def test_empty_pool_is_allowed_and_reports_zero_usage():
    pool = BlockPool(0)
    assert pool.usage == 0.0 and pool.get_new_blocks(0) == []


def test_a_bad_free_changes_no_ref_count():
    pool = BlockPool(2)
    a, b = pool.get_new_blocks(2)
    with pytest.raises(ValueError, match="already free"):
        pool.free_blocks([a, b, b])  # b is held once but freed twice
    assert (a.ref_cnt, b.ref_cnt) == (1, 1) and not pool.free_queue
