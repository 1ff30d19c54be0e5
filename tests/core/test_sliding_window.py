"""num_blocks_out_of_window against cases worked by hand (window W: position p sees keys p - W + 1 .. p), and the
manager's release of those blocks into null slots."""
import pytest
from grader.harness import make_request

from engine_core.core.kv_cache_manager import NULL_BLOCK, KVCacheManager
from engine_core.core.sliding_window import num_blocks_out_of_window


@pytest.mark.parametrize("num_computed, window, block_size, expected", [
    (0, 8, 4, 0),     # nothing computed
    (8, 8, 4, 0),     # p=8 sees 1..8: block 0 (0..3) still holds key 1..3
    (11, 8, 4, 1),    # p=11 sees 4..11: block 0 (0..3) dead, block 1 (4..7) alive
    (10, 8, 4, 0),    # p=10 sees 3..10: token 3 of block 0 still visible
    (12, 8, 4, 1),    # p=12 sees 5..12: block 1 keeps 5..7
    (15, 8, 4, 2),    # p=15 sees 8..15: blocks 0, 1 dead
    (100, 16, 16, 5), # p=100 sees 85..100: blocks 0..4 (0..79) dead, block 5 (80..95) holds 85
    (5, 1, 4, 1),     # W=1: p=5 sees itself only; block 0 (0..3) dead, block 1 holds 5
    (3, 1, 4, 0),     # p=3 is in block 0
    (7, 20, 1, 0),    # the window covers everything so far
    (25, 20, 1, 6),   # block_size 1: keys 0..5 dead
])
def test_hand_cases(num_computed, window, block_size, expected):
    assert num_blocks_out_of_window(num_computed, window, block_size) == expected


def test_matches_the_mask_token_by_token():
    """A block is out exactly when none of its tokens is visible to any query at or after num_computed."""
    for window in (1, 3, 8, 13):
        for block_size in (1, 4, 16):
            for p in range(0, 80):
                dead = [all(not (p - window < k <= q) for q in range(p, p + 200) for k in
                            range(b * block_size, (b + 1) * block_size)) for b in range(p // block_size + 1)]
                expected = dead.index(False) if False in dead else len(dead)
                assert num_blocks_out_of_window(p, window, block_size) == expected, (p, window, block_size)


@pytest.mark.parametrize("args, name", [((4, 0, 4), "window"), ((4, -3, 4), "window"), ((4, 8, 0), "block_size"),
                                        ((-1, 8, 4), "num_computed_tokens")])
def test_bad_arguments_name_the_parameter(args, name):
    with pytest.raises(ValueError, match=name):
        num_blocks_out_of_window(*args)


def test_the_manager_frees_out_of_window_blocks_into_null_slots():
    """window 8, blocks of 4: at 11 computed tokens block 0 goes; the table keeps its length; freeing again is a
    no-op; the request's free releases each real block once; a table with null slots is not swapped."""
    kvm = KVCacheManager(num_gpu_blocks=8, block_size=4, num_cpu_blocks=8, sliding_window=8)
    req = make_request("a", 16)
    kvm.allocate_slots(req, 16)
    req.num_computed_tokens = 10
    assert kvm.remove_skipped_blocks(req, 10) == 0 and kvm.num_free_blocks == 4
    req.num_computed_tokens = 11
    assert kvm.can_swap_out(req)
    assert kvm.remove_skipped_blocks(req, 11) == 1
    assert kvm.get_block_ids("a") == [-1, 1, 2, 3] and kvm.req_to_blocks["a"][0] is NULL_BLOCK
    assert kvm.num_free_blocks == 5 and kvm.remove_skipped_blocks(req, 11) == 0
    assert not kvm.can_swap_out(req)
    assert kvm.remove_skipped_blocks(req, 16) == 1 and kvm.get_block_ids("a") == [-1, -1, 2, 3]
    kvm.free(req)
    assert kvm.num_free_blocks == 8 and all(b.ref_cnt == 0 for b in kvm.block_pool.blocks)


def test_without_a_window_nothing_is_freed():
    kvm = KVCacheManager(num_gpu_blocks=8, block_size=4)
    req = make_request("a", 16)
    kvm.allocate_slots(req, 16)
    assert kvm.remove_skipped_blocks(req, 16) == 0 and kvm.get_block_ids("a") == [0, 1, 2, 3]
    with pytest.raises(ValueError, match="sliding_window"):
        KVCacheManager(num_gpu_blocks=8, block_size=4, sliding_window=0)
