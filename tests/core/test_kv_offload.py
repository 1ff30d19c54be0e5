"""The offload tier's bookkeeping: save plans copies of new blocks only, LRU slots, load finds the stored run from
the first block, a hash-value collision with other tokens is a miss (never served)."""
import pytest

from engine_core.core.block_pool import BlockHash
from engine_core.core.kv_offload import OffloadTier


def chain(*tokens: int) -> list[BlockHash]:
    """One block per token id (a 1-token block), hash values 100, 101, ... (chained in spirit, hand-written)."""
    return [BlockHash(100 + i, (t,)) for i, t in enumerate(tokens)]


def test_save_plans_new_blocks_in_order_then_load_finds_them():
    tier = OffloadTier(4)
    assert tier.save(chain(7, 8, 9), [5, 6, 2]) == [(5, 0), (6, 1), (2, 2)]
    assert tier.save(chain(7, 8, 9), [11, 12, 13]) == []  # stored already: no copy
    assert tier.load(chain(7, 8, 9)) == [0, 1, 2]
    assert tier.load(chain(7, 8, 9)[1:]) == [1, 2]
    assert (tier.counters.num_saved_blocks, tier.counters.external_prefix_cache_queries,
            tier.counters.external_prefix_cache_hits) == (3, 5, 5)


def test_load_stops_at_the_first_miss():
    tier = OffloadTier(4)
    tier.save(chain(7, 8, 9)[:2], [5, 6])
    assert tier.load(chain(7, 8, 9)) == [0, 1]
    assert tier.load([BlockHash(55, (1,)), *chain(7, 8)]) == []


def test_full_tier_evicts_least_recently_used_never_this_calls_blocks():
    tier = OffloadTier(3)
    tier.save(chain(1, 2), [10, 11])  # slots 0, 1
    tier.load(chain(1))  # block 100 is now the most recent
    other = [BlockHash(200, (5,)), BlockHash(201, (6,))]
    assert tier.save(other, [20, 21]) == [(20, 2), (21, 1)]  # slot 2 free, then 101 (LRU) evicted
    assert tier.load(chain(1, 2)) == [0]
    big = [BlockHash(300 + i, (i,)) for i in range(5)]
    # LRU order now 200, 201, 100 (the load above refreshed 100): at most num_slots, the first ones
    assert tier.save(big, list(range(5))) == [(0, 2), (1, 1), (2, 0)]
    assert tier.load(big) == [2, 1, 0]


def test_collision_is_a_miss_and_is_replaced_on_save():
    tier = OffloadTier(2)
    tier.save([BlockHash(100, (1, 2))], [3])
    forged = BlockHash(100, (9, 9))  # the same 128-bit value, other tokens
    assert tier.load([forged]) == []
    assert tier.counters.num_collisions == 1
    assert tier.save([forged], [4]) == [(4, 0)]  # takes the old one's slot
    assert tier.load([BlockHash(100, (1, 2))]) == [] and tier.load([forged]) == [0]
    assert tier.load([BlockHash(100, (9, 9), (3,))]) == []  # other extra keys (a LoRA id): a miss too


def test_discard_frees_the_slots():
    tier = OffloadTier(2)
    tier.save(chain(1, 2), [0, 1])
    tier.discard([0])
    assert tier.load(chain(1, 2)) == [] and tier.usage == 0.5
    assert tier.save(chain(1), [7]) == [(7, 0)]


@pytest.mark.parametrize("bad", [0, -1, 1.5, None])
def test_bad_num_slots_refused(bad):
    with pytest.raises(ValueError, match="num_slots"):
        OffloadTier(bad)


def test_save_refuses_mismatched_lengths():
    with pytest.raises(ValueError, match="2 block hashes but 1 block ids"):
        OffloadTier(2).save(chain(1, 2), [0])
