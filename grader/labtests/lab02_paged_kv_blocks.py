"""Official tests of lab 02_paged_kv_blocks: the block pool and block-table growth.

The learner writes `get_new_blocks(self, num_blocks)` and `free_blocks(self, blocks)` of
`engine_core.core.block_pool.BlockPool` and `allocate_slots(self, request, num_new_tokens,
new_computed_blocks=None)` of `engine_core.core.kv_cache_manager.KVCacheManager`, as plain functions.
Each unit test plugs in only the piece it grades (the engine's own code does the set-up), so one
wrong function fails its own tests only. The end-to-end tests plug in all three and compare the
engine's tokens with the reference engine's on the same workload, then look for leaked blocks.
Expected block counts are hand arithmetic here: blocks = ceil(tokens / block_size).
"""
import functools

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine_core.core.block_pool import BlockPool
from engine_core.core.kv_cache_manager import KVCacheManager
from engine_core.request import Request, SamplingParams


def _ids(blocks):
    return [b.block_id for b in blocks]


def _state(pool: BlockPool) -> str:
    return f"free queue (front first) {list(pool.free_queue)}, ref_cnt by block id {[b.ref_cnt for b in pool.blocks]}"


def _request(rid: str, num_prompt_tokens: int, first_token: int = 1) -> Request:
    return Request(rid, list(range(first_token, first_token + num_prompt_tokens)), SamplingParams(max_tokens=8))


def _blocks_for(num_tokens: int, block_size: int) -> int:
    """The specification: the fewest blocks whose slots hold num_tokens (no division tricks)."""
    blocks = 0
    while blocks * block_size < num_tokens:
        blocks += 1
    return blocks


# ---- task 1: get_new_blocks ------------------------------------------------------------------

@pytest.mark.points(2)
@pytest.mark.task("get_new_blocks")
def test_get_new_blocks_takes_the_front_of_the_free_queue(student, monkeypatch):
    """Blocks leave from the front of the free queue (least recently freed first), with ref_cnt 1."""
    monkeypatch.setattr(BlockPool, "get_new_blocks", student.get_new_blocks)
    pool = BlockPool(6)
    got = pool.get_new_blocks(2)
    assert _ids(got) == [0, 1], f"a fresh pool of 6 blocks: get_new_blocks(2) gave blocks {_ids(got)}, expected [0, 1]"
    assert all(b is pool.blocks[b.block_id] for b in got), "return the pool's own KVCacheBlock objects, not copies"
    assert [b.ref_cnt for b in got] == [1, 1], f"a block handed out has one holder: ref_cnt {[b.ref_cnt for b in got]}, expected [1, 1]"
    assert list(pool.free_queue) == [2, 3, 4, 5], f"after taking blocks 0 and 1: {_state(pool)}, expected free queue [2, 3, 4, 5]"
    pool.free_blocks([got[1]])  # the engine's own free_blocks: block 1 joins the tail
    more = pool.get_new_blocks(5)
    assert _ids(more) == [2, 3, 4, 5, 1], (f"free queue [2, 3, 4, 5, 1] (block 1 freed last): get_new_blocks(5) gave "
                                            f"{_ids(more)}, expected [2, 3, 4, 5, 1]: the front is evicted first")
    assert pool.get_new_blocks(0) == [] and pool.num_free_blocks == 0, f"get_new_blocks(0) must return [] ({_state(pool)})"


@pytest.mark.points(1)
@pytest.mark.task("get_new_blocks")
def test_get_new_blocks_rejects_bad_counts(student, monkeypatch):
    """Asking for more blocks than are free (or fewer than 0) is a ValueError naming num_blocks, with nothing taken."""
    monkeypatch.setattr(BlockPool, "get_new_blocks", student.get_new_blocks)
    pool = BlockPool(3)
    pool.get_new_blocks(1)
    before = _state(pool)
    for bad in (3, -1):
        with pytest.raises(ValueError, match="num_blocks") as info:
            pool.get_new_blocks(bad)
        assert _state(pool) == before, (f"get_new_blocks({bad}) with 2 free blocks raised {info.value!r} but changed "
                                        f"the pool: before {before}; after {_state(pool)}")


@pytest.mark.points(1)
@pytest.mark.task("get_new_blocks")
def test_get_new_blocks_evicts_a_cached_block(student, monkeypatch):
    """A free block that still holds a prefix's KV loses its cache entry when handed out for new tokens."""
    from engine_core.core.kv_cache_manager import hash_block_tokens

    pool = BlockPool(3)
    b0 = pool.get_new_blocks(1)[0]  # the engine's own get_new_blocks, for the set-up
    h = hash_block_tokens(None, [5, 6, 7, 8])
    pool.cache_full_blocks([b0], [h])
    pool.free_blocks([b0])  # free queue [1, 2, 0]; block 0 still maps hash h
    monkeypatch.setattr(BlockPool, "get_new_blocks", student.get_new_blocks)
    got = pool.get_new_blocks(3)
    assert _ids(got) == [1, 2, 0], f"free queue [1, 2, 0]: get_new_blocks(3) gave {_ids(got)}, expected [1, 2, 0]"
    assert pool.get_cached_block(h) is None and b0.block_hash is None, (
        "block 0 held the cached KV of tokens [5, 6, 7, 8]; get_new_blocks handed it out for new tokens but the "
        "prefix cache still maps it (call self._evict(block) on every block you hand out)")


# ---- task 2: free_blocks ---------------------------------------------------------------------

@pytest.mark.points(2)
@pytest.mark.task("free_blocks")
def test_free_blocks_counts_references(student, monkeypatch):
    """A shared block stays in use until its last holder frees it; then it joins the free queue's tail."""
    pool = BlockPool(4)
    b0, b1 = pool.get_new_blocks(2)
    pool.touch([b0])  # a second request shares block 0: ref_cnt 2
    monkeypatch.setattr(BlockPool, "free_blocks", student.free_blocks)
    pool.free_blocks([b0, b1])
    assert (b0.ref_cnt, b1.ref_cnt) == (1, 0), (f"block 0 (ref_cnt 2) and block 1 (ref_cnt 1) freed once: ref_cnt "
                                                f"{(b0.ref_cnt, b1.ref_cnt)}, expected (1, 0)")
    assert list(pool.free_queue) == [2, 3, 1], (f"block 0 is still held by one request, block 1 is free: {_state(pool)}, "
                                                f"expected free queue [2, 3, 1]")
    pool.free_blocks([b0])
    assert list(pool.free_queue) == [2, 3, 1, 0], f"block 0's last holder freed it: {_state(pool)}, expected [2, 3, 1, 0]"


@pytest.mark.points(1)
@pytest.mark.task("free_blocks")
def test_free_blocks_keeps_the_given_order(student, monkeypatch):
    """Freed blocks join the tail in the order given (the caller passes eviction order), from any iterable."""
    pool = BlockPool(5)
    blocks = pool.get_new_blocks(4)
    monkeypatch.setattr(BlockPool, "free_blocks", student.free_blocks)
    pool.free_blocks(iter([blocks[3], blocks[0], blocks[2]]))  # the engine passes reversed(table): an iterator
    assert list(pool.free_queue) == [4, 3, 0, 2], (f"blocks 0-3 in use, free_blocks(iter([3, 0, 2])): {_state(pool)}, "
                                                   f"expected free queue [4, 3, 0, 2]")
    assert [b.ref_cnt for b in pool.blocks] == [0, 1, 0, 0, 0], f"ref counts after freeing 3, 0, 2: {_state(pool)}"


@pytest.mark.points(1)
@pytest.mark.task("free_blocks")
def test_free_blocks_rejects_a_double_free(student, monkeypatch):
    """Freeing a block nobody holds is a bug upstream: ValueError, and the pool stays consistent."""
    pool = BlockPool(2)
    b0 = pool.get_new_blocks(1)[0]
    pool.free_blocks([b0])
    monkeypatch.setattr(BlockPool, "free_blocks", student.free_blocks)
    before = _state(pool)
    with pytest.raises(ValueError):
        pool.free_blocks([b0])
    assert _state(pool) == before and b0.ref_cnt == 0, (
        f"block 0 was already free; freeing it again must raise before changing anything: before {before}, "
        f"after {_state(pool)}")


# ---- task 3: allocate_slots ------------------------------------------------------------------

@pytest.mark.points(2)
@pytest.mark.task("allocate_slots")
def test_allocate_slots_grows_the_table_only_when_needed(student, monkeypatch):
    """A table of T blocks covers T * block_size positions; only tokens past that need new blocks."""
    monkeypatch.setattr(KVCacheManager, "allocate_slots", student.allocate_slots)
    kvm = KVCacheManager(num_gpu_blocks=8, block_size=4)
    req = _request("r", 10)
    # (num_computed_tokens, num_new_tokens): a 10-token prefill, three decodes, then a 7-token chunk
    for computed, new in [(0, 10), (10, 1), (11, 1), (12, 1), (13, 7)]:
        req.num_computed_tokens = computed
        held = len(kvm.get_block_ids("r"))
        want = _blocks_for(computed + new, 4) - held
        got = kvm.allocate_slots(req, new)
        assert got is not None, f"block_size 4, table of {held} blocks, num_computed_tokens {computed}: " \
                                f"allocate_slots(num_new_tokens={new}) returned None with {kvm.num_free_blocks} free blocks"
        assert len(got) == want, (f"block_size 4, table of {held} blocks (positions 0..{held * 4 - 1}), "
                                  f"num_computed_tokens {computed}, num_new_tokens {new}: positions up to "
                                  f"{computed + new - 1} need {held + want} blocks, so {want} new; you returned {len(got)} "
                                  f"({_ids(got)})")
        table = kvm.get_block_ids("r")
        assert table[held:] == _ids(got) and len(table) == held + want, (
            f"the new blocks must be appended to the request's table: table {table}, returned {_ids(got)}")
    assert kvm.get_block_ids("r") == [0, 1, 2, 3, 4], f"table after 20 positions: {kvm.get_block_ids('r')}"


@pytest.mark.points(1)
@pytest.mark.task("allocate_slots")
def test_allocate_slots_returns_none_and_changes_nothing_when_full(student, monkeypatch):
    """Not enough free blocks: return None, take nothing (the scheduler then preempts and retries)."""
    monkeypatch.setattr(KVCacheManager, "allocate_slots", student.allocate_slots)
    kvm = KVCacheManager(num_gpu_blocks=4, block_size=4)
    a, b = _request("a", 12), _request("b", 5)
    assert len(kvm.allocate_slots(a, 12) or []) == 3, "a 12-token prompt takes 3 of 4 blocks"
    got = kvm.allocate_slots(b, 5)
    assert got is None, f"1 free block, a 5-token prompt needs 2: allocate_slots returned {got!r}, expected None"
    assert kvm.num_free_blocks == 1 and kvm.get_block_ids("b") == [] and "b" not in kvm.req_to_blocks, (
        f"a failed allocation must change nothing: {kvm.num_free_blocks} free blocks (expected 1), table of b "
        f"{kvm.get_block_ids('b')} (expected none)")
    got = kvm.allocate_slots(b, 4)
    assert got is not None and len(got) == 1, f"1 free block, a 4-token prompt needs 1: got {got!r}"
    a.num_computed_tokens = 12
    assert kvm.allocate_slots(a, 1) is None, "no free block, position 12 of a needs a 4th block: expected None"
    assert kvm.get_block_ids("a") == [0, 1, 2], f"table of a changed after a failed allocation: {kvm.get_block_ids('a')}"


@pytest.mark.points(1)
@pytest.mark.task("allocate_slots")
def test_allocate_slots_validates_and_handles_zero(student, monkeypatch):
    """num_new_tokens < 0 is a ValueError naming it; 0 new tokens inside the table allocate nothing."""
    monkeypatch.setattr(KVCacheManager, "allocate_slots", student.allocate_slots)
    kvm = KVCacheManager(num_gpu_blocks=4, block_size=4)
    req = _request("r", 3)
    with pytest.raises(ValueError, match="num_new_tokens"):
        kvm.allocate_slots(req, -1)
    assert kvm.num_free_blocks == 4 and "r" not in kvm.req_to_blocks, "a rejected call must change nothing"
    assert len(kvm.allocate_slots(req, 3)) == 1
    req.num_computed_tokens = 3
    got = kvm.allocate_slots(req, 0)
    assert got == [], f"table of 1 block, 3 tokens computed, 0 new: allocate_slots returned {got!r}, expected []"


@pytest.mark.points(2)
@pytest.mark.task("allocate_slots")
def test_allocate_slots_with_prefix_hits(student, monkeypatch):
    """Prefix hits go first in the table and are touched; hits sitting in the free queue are not free room."""
    kvm = KVCacheManager(num_gpu_blocks=3, block_size=4, enable_caching=True)
    p = _request("p", 8)  # tokens 1..8: two full blocks, set up with the engine's own allocate_slots
    kvm.allocate_slots(p, 8)
    p.num_computed_tokens = 8
    kvm.cache_blocks(p, 8)
    kvm.free(p)  # blocks 0 and 1 are free but still hold the prefix: free queue [2, 1, 0]
    monkeypatch.setattr(KVCacheManager, "allocate_slots", student.allocate_slots)
    q = _request("q", 16)  # tokens 1..16: the same 8-token prefix, then 8 more
    hits, num_cached = kvm.get_computed_blocks(q)
    assert _ids(hits) == [0, 1] and num_cached == 8
    got = kvm.allocate_slots(q, 8, hits)
    assert got is None, (f"3 free blocks, two of them are q's prefix hits (blocks 0, 1): 8 hits + 8 new tokens need 2 "
                         f"more blocks but only 1 block is really free; allocate_slots returned {got!r}, expected None")
    assert kvm.num_free_blocks == 3 and [b.ref_cnt for b in hits] == [0, 0] and "q" not in kvm.req_to_blocks, (
        f"a failed allocation must not touch the hits or take blocks: {_state(kvm.block_pool)}")
    got = kvm.allocate_slots(q, 3, hits)  # 8 hits + 3 new tokens = 11 positions = 3 blocks
    assert got is not None and _ids(got) == [2], f"8 hits + 3 new tokens need 1 new block (block 2); got {got!r}"
    assert kvm.get_block_ids("q") == [0, 1, 2], f"the table must be hits then new blocks: {kvm.get_block_ids('q')}"
    assert [b.ref_cnt for b in kvm.block_pool.blocks] == [1, 1, 1] and kvm.num_free_blocks == 0, (
        f"hits are held by q now (touch them): {_state(kvm.block_pool)}")
    r = _request("r", 9)  # shares q's first two blocks, which are in use: touching them makes ref_cnt 2
    hits, _ = kvm.get_computed_blocks(r)
    assert kvm.allocate_slots(r, 0, hits) == [] and [b.ref_cnt for b in hits] == [2, 2], (
        f"hits held by another request gain a holder: {_state(kvm.block_pool)}")


@pytest.mark.points(2)
@pytest.mark.task("allocate_slots")
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=st.lists(st.tuples(st.integers(0, 3), st.integers(0, 9), st.booleans()), min_size=1, max_size=40))
def test_allocation_invariants(student, monkeypatch, ops):
    """Random grow / free sequences on 4 requests: counts, ref_cnt and the free queue stay consistent."""
    monkeypatch.setattr(BlockPool, "get_new_blocks", student.get_new_blocks)
    monkeypatch.setattr(BlockPool, "free_blocks", student.free_blocks)
    monkeypatch.setattr(KVCacheManager, "allocate_slots", student.allocate_slots)
    kvm = KVCacheManager(num_gpu_blocks=6, block_size=3)
    reqs = [_request(f"r{i}", 30) for i in range(4)]
    log = []
    for k, new, finish in ops:
        req = reqs[k]
        if finish:
            log.append(f"free(r{k})")
            kvm.free(req)
            req.num_computed_tokens = 0
        else:
            held = len(kvm.get_block_ids(req.request_id))
            need = max(0, _blocks_for(req.num_computed_tokens + new, 3) - held)
            log.append(f"allocate_slots(r{k}, computed={req.num_computed_tokens}, new={new})")
            got = kvm.allocate_slots(req, new)
            if need > kvm.num_free_blocks + (0 if got is None else len(got)):
                assert got is None, f"after {log}: needed {need} blocks, expected None, got {_ids(got)}"
            else:
                assert got is not None and len(got) == need, (
                    f"after {log}: needed {need} new blocks, got {got if got is None else _ids(got)}")
                req.num_computed_tokens += new
        tables = [kvm.get_block_ids(r.request_id) for r in reqs]
        held_ids = [i for t in tables for i in t]
        ref = [b.ref_cnt for b in kvm.block_pool.blocks]
        assert ref == [held_ids.count(i) for i in range(6)], f"after {log}: tables {tables}, ref_cnt {ref}"
        assert sorted(kvm.block_pool.free_queue) == [i for i in range(6) if ref[i] == 0], (
            f"after {log}: the free queue must hold exactly the blocks nobody holds: {_state(kvm.block_pool)}")


# ---- end to end ------------------------------------------------------------------------------

WORKLOAD = [(5 + 3 * i, 6 + (i * 5) % 9) for i in range(8)]  # (prompt length, max_tokens)
SHARED_PREFIX = list(range(40, 52))  # 12 tokens: three blocks of 4


def _engine_args(**overrides):
    args = dict(device="cpu", block_size=4, num_gpu_blocks=14, max_num_batched_tokens=32, preemption_mode="recompute",
                swap_space=0, max_model_len=128)
    return {**args, **overrides}


def _prompts(prefix: bool) -> list[list[int]]:
    return [(SHARED_PREFIX if prefix else []) + [(7 * i + j) % 500 + 3 for j in range(n)] for i, (n, _) in enumerate(WORKLOAD)]


def _run(prefix: bool, max_steps: int = 500):
    """Runs the workload to the end; returns (tokens by request, the engine)."""
    from engine_core import LLMEngine

    engine = LLMEngine.from_kwargs("tiny-llama", **_engine_args(enable_prefix_caching=prefix))
    for i, (prompt, (_, max_tokens)) in enumerate(zip(_prompts(prefix), WORKLOAD)):
        engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
                           arrival_time=float(i))
    tokens = {}
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            return tokens, engine
        for out in engine.step():
            if out.finished:
                tokens[out.request_id] = list(out.outputs[0].token_ids)
    raise AssertionError(f"the engine made no progress: unfinished after {max_steps} steps ({engine.stats()})")


@functools.cache
def _reference(prefix: bool):
    tokens, engine = _run(prefix)
    return tokens, engine.stats()


def _assert_same_tokens_no_leak(student, monkeypatch, prefix: bool):
    want, ref_stats = _reference(prefix)  # the engine's own pieces, before any patch
    assert ref_stats["num_preemptions"] > 0, "the workload must run out of blocks (a test bug, not yours)"
    monkeypatch.setattr(BlockPool, "get_new_blocks", student.get_new_blocks)
    monkeypatch.setattr(BlockPool, "free_blocks", student.free_blocks)
    monkeypatch.setattr(KVCacheManager, "allocate_slots", student.allocate_slots)
    got, engine = _run(prefix)
    setup = f"tiny-llama, {_engine_args(enable_prefix_caching=prefix)}, (prompt length, max_tokens) {WORKLOAD}"
    for rid in sorted(want):
        if got.get(rid) != want[rid]:
            first = next((k for k, (a, b) in enumerate(zip(got.get(rid) or [], want[rid])) if a != b), None)
            raise AssertionError(f"{setup}: request {rid} generated {got.get(rid)}, the reference engine "
                                 f"{want[rid]} (first difference at output token {first})")
    pool = engine.scheduler.kv_cache_manager.block_pool
    leaked = [b.block_id for b in pool.blocks if b.ref_cnt != 0]
    assert not leaked and pool.num_free_blocks == pool.num_blocks, (
        f"{setup}: every request finished, yet blocks {leaked} still have holders and {pool.num_free_blocks} of "
        f"{pool.num_blocks} blocks are free ({_state(pool)})")


@pytest.mark.points(3)
@pytest.mark.task("end_to_end")
def test_engine_tokens_match_under_memory_pressure(student, monkeypatch):
    """The engine with your three pieces, 14 blocks of 4 for 8 requests: the reference tokens, no leaked block."""
    _assert_same_tokens_no_leak(student, monkeypatch, prefix=False)


@pytest.mark.points(2)
@pytest.mark.task("end_to_end")
def test_engine_tokens_match_with_prefix_caching(student, monkeypatch):
    """The same with a shared 12-token prefix and prefix caching: hits, evictions, the reference tokens."""
    _assert_same_tokens_no_leak(student, monkeypatch, prefix=True)
