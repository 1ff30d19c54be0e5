"""Official tests of lab 02_paged_kv_blocks: the block pool and block-table growth.

The learner writes `get_new_blocks(self, num_blocks)` and `free_blocks(self, blocks)` of the
engine's BlockPool and `allocate_slots(self, request, num_new_tokens, new_computed_blocks=None)`
of its KVCacheManager, as plain functions (the seams in grader/seams.py). Every test runs inside
`plug(student, LAB)` (tasks 1 and 2 plug only their own function: the notebook checks them before the
next one is written); unit tests build the pool's state directly (ref counts, free queue, block
tables, cache entries: no seam runs during set-up), so one wrong function fails its own tests,
and allocate_slots' tests, which need the learner's get_new_blocks. One more graded function is a
prediction, `predicted_waste_per_request(block_size)`, checked against the hand-derived mean. The end-to-end tests run
tiny-llama with all three and compare tokens, preemptions and prefix-cache hits with the
reference engine's, computed after the plug ends. Expected block counts are hand arithmetic:
blocks = ceil(tokens / block_size). Every check is an `expect_*` observation.
"""
import functools

import pytest
from hypothesis import given, seed
from hypothesis import strategies as st

from grader.harness import BlockHash, BlockPool, Request, SamplingParams, build_manager, build_pool, lab_settings, run_engine
from grader.observe import expect_equal, expect_prediction, expect_raises
from grader.plug import plug

LAB = "02_paged_kv_blocks"


def _ids(blocks):
    return None if blocks is None else [b.block_id for b in blocks]


def _state(pool: BlockPool) -> dict:
    """What the pool holds: the free queue (front first) and every block's ref_cnt by block id."""
    return {"free queue": list(pool.free_queue), "ref_cnt": [b.ref_cnt for b in pool.blocks]}


def _request(rid: str, num_prompt_tokens: int, computed: int = 0) -> Request:
    req = Request(rid, list(range(1, 1 + num_prompt_tokens)), SamplingParams(max_tokens=8))
    req.num_computed_tokens = computed
    return req


# ---- task 1: get_new_blocks ------------------------------------------------------------------

@pytest.mark.points(2)
@pytest.mark.task("get_new_blocks")
def test_get_new_blocks_takes_the_front_of_the_free_queue(student):
    """Blocks leave from the front of the free queue (least recently freed first), with ref_cnt 1."""
    with plug(student, LAB, only=["get_new_blocks"]):
        pool = build_pool(6)
        got = pool.get_new_blocks(2)
        expect_equal(_ids(got), [0, 1], "a fresh pool of 6 blocks (free queue [0, 1, 2, 3, 4, 5]): get_new_blocks(2)")
        expect_equal([b is pool.blocks[b.block_id] for b in got], [True, True],
                     "get_new_blocks(2) returns the pool's own KVCacheBlock objects, not copies (is pool.blocks[id])")
        expect_equal(_state(pool), {"free queue": [2, 3, 4, 5], "ref_cnt": [1, 1, 0, 0, 0, 0]},
                     "the pool after get_new_blocks(2) on a fresh pool of 6: a block handed out has one holder")
        pool = build_pool(6, held={0: 1}, free_order=[2, 3, 4, 5, 1])  # block 1 was freed last
        got = pool.get_new_blocks(5)
        expect_equal(_ids(got), [2, 3, 4, 5, 1],
                     "free queue [2, 3, 4, 5, 1] (block 1 freed last): get_new_blocks(5); the front is evicted first")
        expect_equal(_ids(pool.get_new_blocks(0)), [], "no free block left: get_new_blocks(0)")


@pytest.mark.points(1)
@pytest.mark.task("get_new_blocks")
def test_get_new_blocks_rejects_bad_counts(student):
    """Asking for more blocks than are free (or fewer than 0) is a ValueError naming num_blocks, with nothing taken."""
    with plug(student, LAB, only=["get_new_blocks"]):
        pool = build_pool(3, held={0: 1})
        for bad in (3, -1):
            expect_raises(ValueError, pool.get_new_blocks, bad, match="num_blocks",
                          message=f"block 0 held, free queue [1, 2]: get_new_blocks({bad})")
            expect_equal(_state(pool), {"free queue": [1, 2], "ref_cnt": [1, 0, 0]},
                         f"the pool after the rejected get_new_blocks({bad}): unchanged")


@pytest.mark.points(1)
@pytest.mark.task("get_new_blocks")
def test_get_new_blocks_evicts_a_cached_block(student):
    """A free block that still holds a prefix's KV loses its cache entry when handed out for new tokens."""
    with plug(student, LAB, only=["get_new_blocks"]):
        pool = build_pool(3, free_order=[1, 2, 0], cached={0: (5, 6, 7, 8)})
        got = pool.get_new_blocks(3)
        expect_equal(_ids(got), [1, 2, 0], "free queue [1, 2, 0], block 0 free but cached: get_new_blocks(3)")
        expect_equal((pool.blocks[0].block_hash, len(pool.cached_blocks)), (None, 0),
                     "block 0 held the cached KV of tokens [5, 6, 7, 8] and was handed out for new tokens: (its "
                     "block_hash, entries left in the prefix cache); call self._evict(block) on every block you hand out")


# ---- task 2: free_blocks ---------------------------------------------------------------------

@pytest.mark.points(2)
@pytest.mark.task("free_blocks")
def test_free_blocks_counts_references(student):
    """A shared block stays in use until its last holder frees it; then it joins the free queue's tail."""
    with plug(student, LAB, only=["free_blocks"]):
        pool = build_pool(4, held={0: 2, 1: 1})
        pool.free_blocks([pool.blocks[0], pool.blocks[1]])
        expect_equal(_state(pool), {"free queue": [2, 3, 1], "ref_cnt": [1, 0, 0, 0]},
                     "block 0 (ref_cnt 2, shared) and block 1 (ref_cnt 1) freed once, free queue was [2, 3]")
        pool.free_blocks([pool.blocks[0]])
        expect_equal(_state(pool), {"free queue": [2, 3, 1, 0], "ref_cnt": [0, 0, 0, 0]},
                     "then block 0 freed by its last holder")


@pytest.mark.points(1)
@pytest.mark.task("free_blocks")
def test_free_blocks_keeps_the_given_order(student):
    """Freed blocks join the tail in the order given (the caller passes eviction order), from any iterable."""
    with plug(student, LAB, only=["free_blocks"]):
        pool = build_pool(5, held={0: 1, 1: 1, 2: 1, 3: 1})
        pool.free_blocks(iter([pool.blocks[3], pool.blocks[0], pool.blocks[2]]))  # the engine passes an iterator
        expect_equal(_state(pool), {"free queue": [4, 3, 0, 2], "ref_cnt": [0, 1, 0, 0, 0]},
                     "blocks 0-3 held once, free queue [4]: free_blocks(iter([block 3, block 0, block 2]))")


@pytest.mark.points(1)
@pytest.mark.task("free_blocks")
def test_free_blocks_rejects_a_double_free(student):
    """Freeing a block more often than it is held is a bug upstream: ValueError, raised before any ref
    count changes (a half-applied free would corrupt the pool)."""
    with plug(student, LAB, only=["free_blocks"]):
        pool = build_pool(3, held={1: 1})
        cases = [([0], "block 0, already free"), ([1, 0], "block 1 (held once), then block 0 (already free)"),
                 ([1, 1], "block 1 twice, but it is held once")]
        for ids, what in cases:
            expect_raises(ValueError, pool.free_blocks, [pool.blocks[i] for i in ids],
                          message=f"block 1 held once, free queue [0, 2]: free_blocks([{what}])")
            expect_equal(_state(pool), {"free queue": [0, 2], "ref_cnt": [0, 1, 0]},
                         f"the pool after the rejected free_blocks([{what}]): unchanged")


@pytest.mark.points(1)
@pytest.mark.task("free_blocks")
def test_free_blocks_keeps_cached_kv(student):
    """A freed block keeps its cached KV: a later request with the same prefix can take it back
    until get_new_blocks hands it out (freeing is not evicting)."""
    with plug(student, LAB, only=["free_blocks"]):
        pool = build_pool(3, held={0: 1, 1: 1}, cached={0: (1, 2, 3, 4), 1: (5, 6, 7, 8)})
        pool.free_blocks([pool.blocks[1], pool.blocks[0]])
        expect_equal([pool.get_cached_block(BlockHash(1000 + i, t)) is pool.blocks[i]
                      for i, t in ((0, (1, 2, 3, 4)), (1, (5, 6, 7, 8)))], [True, True],
                     "blocks 0 and 1 held and cached, then freed: does the prefix cache still find each of them?")
        expect_equal(_state(pool), {"free queue": [2, 1, 0], "ref_cnt": [0, 0, 0]}, "the pool after the free")


# ---- task 3: allocate_slots ------------------------------------------------------------------

@pytest.mark.points(2)
@pytest.mark.task("allocate_slots")
def test_allocate_slots_grows_the_table_only_when_needed(student):
    """A table of T blocks covers T * block_size positions; only tokens past that need new blocks."""
    with plug(student, LAB):
        kvm = build_manager(8)
        req = _request("r", 10)
        # (num_computed_tokens, num_new_tokens): a 10-token prefill, three decodes, then a 7-token chunk
        for computed, new, want_new, want_table in [(0, 10, 3, [0, 1, 2]), (10, 1, 0, [0, 1, 2]), (11, 1, 0, [0, 1, 2]),
                                                    (12, 1, 1, [0, 1, 2, 3]), (13, 7, 1, [0, 1, 2, 3, 4])]:
            req.num_computed_tokens = computed
            got = kvm.allocate_slots(req, new)
            expect_equal((None if got is None else len(got), kvm.get_block_ids("r")), (want_new, want_table),
                         f"blocks of 4, num_computed_tokens {computed}, allocate_slots(num_new_tokens={new}): "
                         f"(new blocks returned, the request's table); positions up to {computed + new - 1} need "
                         f"{len(want_table)} blocks")


@pytest.mark.points(1)
@pytest.mark.task("allocate_slots")
def test_allocate_slots_returns_none_and_changes_nothing_when_full(student):
    """Not enough free blocks: return None, take nothing (the scheduler then preempts and retries)."""
    with plug(student, LAB):
        kvm = build_manager(4, tables={"a": [0, 1, 2]})
        a, b = _request("a", 12, computed=12), _request("b", 5)
        expect_equal(_ids(kvm.allocate_slots(b, 5)), None,
                     "4 blocks of 4, a holds 3: allocate_slots(b, 5) needs 2 blocks, 1 is free")
        expect_equal((kvm.num_free_blocks, "b" in kvm.req_to_blocks), (1, False),
                     "after the failed allocation: (free blocks, does b have a table?)")
        expect_equal(_ids(kvm.allocate_slots(b, 4)), [3], "then allocate_slots(b, 4): 1 block, the free one")
        expect_equal(_ids(kvm.allocate_slots(a, 1)), None,
                     "no free block left; a (12 tokens computed) needs a 4th block for position 12")
        expect_equal(kvm.get_block_ids("a"), [0, 1, 2], "a's table after its failed allocation")


@pytest.mark.points(1)
@pytest.mark.task("allocate_slots")
def test_allocate_slots_validates_and_handles_zero(student):
    """num_new_tokens < 0 is a ValueError naming it; 0 new tokens inside the table allocate nothing."""
    with plug(student, LAB):
        kvm = build_manager(4)
        req = _request("r", 3)
        expect_raises(ValueError, kvm.allocate_slots, req, -1, match="num_new_tokens",
                      message="allocate_slots(request, num_new_tokens=-1)")
        expect_equal((kvm.num_free_blocks, "r" in kvm.req_to_blocks), (4, False),
                     "after the rejected call: (free blocks, does r have a table?)")
        expect_equal(_ids(kvm.allocate_slots(req, 3)), [0], "a fresh manager: allocate_slots(r, 3)")
        req.num_computed_tokens = 3
        expect_equal(_ids(kvm.allocate_slots(req, 0)), [], "table of 1 block, 3 tokens computed, 0 new tokens")


@pytest.mark.points(2)
@pytest.mark.task("allocate_slots")
def test_allocate_slots_with_prefix_hits(student):
    """Prefix hits go first in the table and are touched; hits sitting in the free queue are not free room."""
    with plug(student, LAB):
        # blocks 0 and 1 hold a freed request's prefix: free but cached, free queue [2, 1, 0]
        kvm = build_manager(3, free_order=[2, 1, 0], cached={0: (1, 2, 3, 4), 1: (5, 6, 7, 8)}, caching=True)
        pool = kvm.block_pool
        q = _request("q", 16)  # its first 8 tokens are the cached prefix
        hits = [pool.blocks[0], pool.blocks[1]]
        expect_equal(_ids(kvm.allocate_slots(q, 8, hits)), None,
                     "3 free blocks, two of them q's prefix hits (blocks 0, 1): 8 hit + 8 new tokens need 2 more "
                     "blocks, only block 2 is really free")
        expect_equal((_state(pool), "q" in kvm.req_to_blocks), ({"free queue": [2, 1, 0], "ref_cnt": [0, 0, 0]}, False),
                     "after the failed allocation: (the pool, does q have a table?): the hits must not be touched")
        expect_equal(_ids(kvm.allocate_slots(q, 3, hits)), [2], "then allocate_slots(q, 3, hits): 8 + 3 positions")
        expect_equal((kvm.get_block_ids("q"), _state(pool)), ([0, 1, 2], {"free queue": [], "ref_cnt": [1, 1, 1]}),
                     "(q's table, the pool): hits first, then the new block; q holds its hits now (touch them)")
        expect_equal(kvm.num_cached_blocks.get("q"), 2,
                     "num_cached_blocks['q'] after 2 hits: the table's length right after the hits (already cached)")
        r = _request("r", 9)  # shares q's first two blocks, which are in use
        expect_equal(_ids(kvm.allocate_slots(r, 0, hits)), [], "r hits q's blocks 0 and 1 (in use): allocate_slots(r, 0, hits)")
        expect_equal([b.ref_cnt for b in hits], [2, 2], "ref_cnt of blocks 0 and 1: hits held by another request gain a holder")


@pytest.mark.points(1)
@pytest.mark.task("allocate_slots")
def test_allocate_slots_takes_no_extra_block_next_to_hits(student):
    """Blocks held next to prefix hits: the hits cover their tokens, so a request with h hit blocks takes
    only the blocks its remaining tokens need (an over-allocation keeps the tokens right but wastes memory)."""
    with plug(student, LAB):
        kvm = build_manager(10, free_order=[2, 3, 4, 5, 6, 7, 8, 9, 1, 0], cached={0: (1, 2, 3, 4), 1: (5, 6, 7, 8)},
                       caching=True)
        hits = [kvm.block_pool.blocks[0], kvm.block_pool.blocks[1]]
        for rid, new, want in (("q", 3, [2]), ("s", 4, [3]), ("t", 5, [4, 5]), ("u", 0, [])):
            expect_equal(_ids(kvm.allocate_slots(_request(rid, 8 + new), new, hits)), want,
                         f"request {rid}: 2 hit blocks (8 tokens) + {new} new tokens, blocks of 4: the new blocks")
        expect_equal(kvm.num_free_blocks, 4, "free blocks left of 10 (2 hits shared by 4 requests, 4 new blocks)")


@pytest.mark.points(2)
@pytest.mark.task("allocate_slots")
@lab_settings(60)
@seed(20240602)  # the same examples in the reference run and in the kit (derandomize would hash the source)
@given(ops=st.lists(st.tuples(st.integers(0, 3), st.integers(0, 9), st.booleans()), min_size=1, max_size=40))
def test_allocation_invariants(student, ops):
    """Random grow / free sequences on 4 requests: counts, ref_cnt and the free queue stay consistent."""
    with plug(student, LAB):
        kvm = build_manager(6, block_size=3)
        reqs = [_request(f"r{i}", 30) for i in range(4)]
        log = []
        for k, new, finish in ops:
            req = reqs[k]
            if finish:
                log.append(f"free(r{k})")
                kvm.free(req)  # the engine's free: your free_blocks, the table's tail first
                req.num_computed_tokens = 0
                continue
            held, free = len(kvm.get_block_ids(req.request_id)), kvm.num_free_blocks
            log.append(f"allocate_slots(r{k}, computed={req.num_computed_tokens}, new={new})")
            got = kvm.allocate_slots(req, new)
            need = max(0, -(-(req.num_computed_tokens + new) // 3) - held)
            expect_equal(None if got is None else len(got), None if need > free else need,
                         f"blocks of 3, 6 blocks, after {log}: the number of new blocks (None: no room)")
            if got is not None:
                req.num_computed_tokens += new
            tables = [kvm.get_block_ids(r.request_id) for r in reqs]
            expect_equal(_state(kvm.block_pool)["ref_cnt"], [sum(t.count(i) for t in tables) for i in range(6)],
                         f"after {log}: ref_cnt by block id, with tables {tables}")
            expect_equal(sorted(kvm.block_pool.free_queue),
                         [i for i in range(6) if all(i not in t for t in tables)],
                         f"after {log}: the free queue holds exactly the blocks in no table ({tables})")


# ---- end to end ------------------------------------------------------------------------------

WORKLOAD = [(5 + 3 * i, 6 + (i * 5) % 9) for i in range(8)]  # (prompt length, max_tokens)
SHARED_PREFIX = list(range(40, 52))  # 12 tokens: three blocks of 4
ENGINE_ARGS = dict(block_size=4, num_gpu_blocks=14, max_num_batched_tokens=32, preemption_mode="recompute",
                   swap_space=0, max_model_len=128)
COUNTS = ("num_preemptions", "prefix_cache_queries", "prefix_cache_hits")


def _requests(prefix: bool) -> list:
    return [(f"r{i}", (SHARED_PREFIX if prefix else []) + [(7 * i + j) % 500 + 3 for j in range(n)], m)
            for i, (n, m) in enumerate(WORKLOAD)]


def _run(prefix: bool):
    return run_engine([_requests(prefix)], enable_prefix_caching=prefix, **ENGINE_ARGS)


@functools.cache
def _reference(prefix: bool) -> tuple[dict, dict]:
    """The reference engine's tokens and counts on the same workload (run outside any plug)."""
    run = _run(prefix)
    return run.tokens, {k: run.stats[k] for k in COUNTS}


def _check_engine(student, prefix: bool) -> None:
    with plug(student, LAB) as plugged:
        run = _run(prefix)
    setup = (f"tiny-llama, 14 blocks of 4, budget 32, preemption by recompute, prefix caching "
             f"{'on (a shared 12-token prefix)' if prefix else 'off'}, 8 requests (prompt length, max_tokens) {WORKLOAD}")
    assert _reference(prefix)[1]["num_preemptions"] > 0, "the workload must run out of blocks (a test bug)"
    expect_equal(plugged.uncalled(), [], f"{setup}: your functions the engine never called")
    expect_equal(run.tokens, _reference(prefix)[0], f"{setup}: the tokens of each request")
    expect_equal({k: run.stats[k] for k in COUNTS}, _reference(prefix)[1],
                 f"{setup}: preemptions and prefix-cache counts (a correct allocator gives the reference engine's)")
    expect_equal(run.held, [], f"{setup}: (pool, block, ref_cnt) still held after every request finished")


@pytest.mark.points(3)
@pytest.mark.task("end_to_end")
@pytest.mark.end_to_end
def test_engine_tokens_match_under_memory_pressure(student):
    """The engine with your three pieces, 14 blocks of 4 for 8 requests: the reference tokens and
    preemptions, no leaked block."""
    _check_engine(student, prefix=False)


@pytest.mark.points(2)
@pytest.mark.task("end_to_end")
@pytest.mark.end_to_end
def test_engine_tokens_match_with_prefix_caching(student):
    """The same with a shared 12-token prefix and prefix caching: the reference tokens, preemptions and
    prefix-cache hits (hits lost to an early eviction or over-allocation show here)."""
    _check_engine(student, prefix=True)


# ---- prediction: what paging still wastes ----------------------------------------------------

@pytest.mark.points(2)
@pytest.mark.task("prediction")
def test_predicted_waste_per_request(student):
    """A length that ends at offset k = 1 .. block_size of its last block (equally likely) leaves
    block_size - k slots empty: 0 .. block_size - 1, mean (block_size - 1) / 2 (7.5 slots for blocks of 16).

    Tolerance: atol 0.5 accepts the continuous approximation block_size / 2 and rejects the bound
    (block_size - 1) or a whole block, which are off by 1.5 slots or more for every block size of 4 and up."""
    got = [student.predicted_waste_per_request(b) for b in (1, 4, 16, 128)]
    expect_prediction(got, [0.0, 1.5, 7.5, 63.5],
                 "[predicted_waste_per_request(b) for b in (1, 4, 16, 128)]: the mean empty slots of a request's "
                 "last block, its length ending at any offset of that block with equal probability", atol=0.5)
