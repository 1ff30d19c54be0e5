"""Official tests of lab 05_prefix_caching: chained block hashes, prefix lookup, LRU eviction.

The learner writes `hash_block_tokens` (seam: the module function in engine_core.core.kv_cache_manager
that `KVCacheManager.block_hashes` calls), `get_computed_blocks` (seam: the KVCacheManager method)
and the LRU side of `BlockPool` (`get_new_blocks`, `touch`); plus a prediction (`predicted_hit_rate`)
and a find-the-bug answer (`failing_input`, for `buggy_get_computed_blocks` below). Every test of the
four functions runs inside `plug(student, LAB)` (grader/plug.py): all four are the learner's, the
engine's own raise. The lookup and LRU tests build the cache state directly (block tables, ref
counts, the free queue, cache entries under test-made hashes), so they do not depend on the
learner's hash; the end-to-end tests compare the real engine with caching on against the reference
engine (computed after the plug ends). `harness.FakeRunner`'s tokens go wrong when a block is shared
with the wrong prefix. Every graded check is an `expect_*` observation.
"""
import functools
import random

import pytest

from grader.harness import (BlockHash, FakeRunner, build_manager, build_pool, held_blocks, make_request,
                            make_scheduler, reference_output, run_engine)
from grader.observe import expect_equal, expect_prediction
from grader.plug import plug

LAB = "05_prefix_caching"


def _hash(student, parent, tokens, extra=None):
    """hash_block_tokens' result as plain data: (hash_value is an int, token_ids, extra_keys), and the value."""
    got = student.hash_block_tokens(parent, tokens, extra)
    return (type(getattr(got, "hash_value", None)) is int, tuple(getattr(got, "token_ids", ())),
            getattr(got, "extra_keys", "missing")), getattr(got, "hash_value", None)


# ---- task 1: hash_block_tokens -----------------------------------------------------------

@pytest.mark.points(1)
@pytest.mark.task("hash_block_tokens")
def test_hash_keeps_tokens_and_chains(student):
    """Equal inputs give equal hashes; the block's tokens are kept; the parent enters the hash."""
    with plug(student, LAB, only=['hash_block_tokens']):
        (shape, a), (_, a_tuple) = _hash(student, None, [1, 2, 3, 4]), _hash(student, None, (1, 2, 3, 4))
        expect_equal(shape, (True, (1, 2, 3, 4), None),
                     "hash_block_tokens(None, [1, 2, 3, 4]): (is hash_value an int?, token_ids, extra_keys)")
        expect_equal(a == a_tuple, True, "hash_block_tokens(None, [1, 2, 3, 4]) and (None, (1, 2, 3, 4)): equal hash_values?")
        child, orphan = _hash(student, a, [5, 6, 7, 8])[1], _hash(student, None, [5, 6, 7, 8])[1]
        other_parent = _hash(student, _hash(student, None, [1, 2, 3, 9])[1], [5, 6, 7, 8])[1]
        expect_equal((child != orphan, child != other_parent), (True, True),
                     "the tokens [5, 6, 7, 8] after the block [1, 2, 3, 4], as a first block, and after [1, 2, 3, 9]: "
                     "(child differs from first block?, child differs from the one after another parent?): the "
                     "parent's hash must enter the hash (the chain is what makes it a *prefix* hash)")
        rng = random.Random(0)
        blocks = {tuple(rng.randrange(100) for _ in range(4)) for _ in range(300)}
        expect_equal(len({_hash(student, None, b)[1] for b in blocks}), len(blocks),
                     "300 random different blocks of 4 tokens (random.Random(0)): the number of distinct hash_values")
    _check_structured_blocks(student)


def _check_structured_blocks(student):
    """Structured blocks, not random ones: a block's tokens in another order are another block, and a
    chain that repeats a block must not cancel out (hash_value = parent ^ hash(tokens) maps block 4 of
    [A, B, B, C] onto block 2 of [A, C]: a lookup of [A, C] would take KV computed after [A, B, B])."""
    a, b, c = [1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12]
    kvm = build_manager(8, caching=True)
    with plug(student, LAB, only=["hash_block_tokens"]):
        expect_equal(_hash(student, None, a)[1] != _hash(student, None, a[::-1])[1], True,
                     f"hash_block_tokens(None, {a}) and (None, {a[::-1]}): do the hash_values differ? The order "
                     f"of the tokens must enter the hash")
        abbc = kvm.block_hashes(make_request("abbc", a + b + b + c + [13]), 4)  # the engine's chain, your hash
        ac = kvm.block_hashes(make_request("ac", a + c + [13]), 2)
    expect_equal([abbc[0] == ac[0], abbc[3] == ac[1]], [True, False],
                 f"A = {a}, B = {b}, C = {c}, blocks of 4: (is block A of [A, B, B, C] hashed like block A of [A, C]?, "
                 f"is block C of [A, B, B, C] hashed like block C of [A, C]?): C after [A, B, B] and C after [A] "
                 f"have different KV, so a lookup of [A, C] must not find the block cached for [A, B, B, C]")


@pytest.mark.points(1)
@pytest.mark.task("hash_block_tokens")
def test_hash_extra_keys_separate_loras(student):
    """The LoRA id (extra_keys) is kept and changes the hash: adapters never share KV."""
    with plug(student, LAB, only=['hash_block_tokens']):
        (plain_shape, plain), (lora1_shape, lora1), (_, lora2) = (_hash(student, None, [1, 2, 3, 4], e)
                                                                  for e in (None, (1,), (2,)))
    expect_equal(lora1_shape, (True, (1, 2, 3, 4), (1,)),
                 "hash_block_tokens(None, [1, 2, 3, 4], (1,)): (is hash_value an int?, token_ids, extra_keys)")
    expect_equal(len({plain, lora1, lora2}), 3,
                 "the block [1, 2, 3, 4] with extra_keys None, (1,), (2,): the number of distinct hash_values "
                 "(extra_keys must enter the hash)")


@pytest.mark.points(1)
@pytest.mark.task("hash_block_tokens")
def test_block_hashes_of_requests(student):
    """In the engine's KVCacheManager: requests that share 8 tokens share exactly 2 block hashes (blocks of 4)."""
    kvm = build_manager(16, caching=True)
    a = make_request("a", list(range(1, 13)))
    b = make_request("b", list(range(1, 9)) + [50, 51, 52, 53])
    c = make_request("c", [99, 2, 3, 4] + list(range(5, 13)))  # differs from a in the first token only
    with plug(student, LAB, only=['hash_block_tokens']):
        ha, hb, hc = (kvm.block_hashes(r, 3) for r in (a, b, c))
    expect_equal([x == y for x, y in zip(ha, hb)], [True, True, False],
                 "a = tokens 1..12 and b = 1..8 + [50..53], blocks of 4: is each of their 3 block hashes equal?")
    expect_equal([x == y for x, y in zip(ha, hc)], [False, False, False],
                 "a = tokens 1..12 and c = [99, 2, 3, 4] + 5..12 (blocks 2 and 3 have the same tokens, after a "
                 "different prefix): is each of their 3 block hashes equal?")


# ---- task 2: get_computed_blocks ---------------------------------------------------------

def _memoize_hashes(kvm, request):
    """Writes the request's block hashes into the manager's memo, made here from the token prefix (no
    hash function runs): equal prefixes give equal hashes, so lookups do not depend on the learner's hash."""
    tokens, bs = request.all_token_ids, kvm.block_size
    kvm.req_to_block_hashes[request.request_id] = [
        BlockHash(hash(tuple(tokens[:(i + 1) * bs])), tuple(tokens[i * bs:(i + 1) * bs]), None)
        for i in range(len(tokens) // bs)]


def _warm(tokens, num_blocks=32):
    """A caching manager (blocks of 4) whose request 'a' (`tokens`) holds blocks 0.., its full ones cached."""
    a = make_request("a", tokens)
    kvm = build_manager(num_blocks, {"a": list(range(-(-len(tokens) // 4)))}, caching=True)
    _memoize_hashes(kvm, a)
    full = len(tokens) // 4
    kvm.block_pool.cache_full_blocks(kvm.req_to_blocks["a"][:full], kvm.req_to_block_hashes["a"][:full])
    return kvm


def _lookup(kvm, request):
    """get_computed_blocks on the request (its hashes memoized first) as plain data: (block ids, tokens)."""
    _memoize_hashes(kvm, request)
    got = kvm.get_computed_blocks(request)
    blocks, num = got if isinstance(got, tuple) and len(got) == 2 else (None, got)
    return (None if blocks is None else [b.block_id for b in blocks]), num


@pytest.mark.points(2)
@pytest.mark.task("get_computed_blocks")
def test_lookup_longest_cached_prefix(student):
    """Hits are the cached blocks from the start of the request, as long as they match (blocks of 4)."""
    a_tokens = list(range(1, 14))  # 13 tokens: blocks [1-4] [5-8] [9-12] full and cached in blocks 0, 1, 2
    cases = [("b", list(range(1, 11)), ([0, 1], 8)), ("c", list(range(1, 6)) + [40] * 6, ([0], 4)),
             ("d", [40] + a_tokens[1:], ([], 0)), ("e", a_tokens + [60, 61], ([0, 1, 2], 12))]
    with plug(student, LAB, only=['get_computed_blocks']):
        kvm = _warm(a_tokens)
        for rid, tokens, want in cases:
            expect_equal(_lookup(kvm, make_request(rid, tokens)), want,
                         f"a = tokens 1..13 is cached in blocks 0, 1, 2 (blocks of 4); get_computed_blocks of a request "
                         f"{tokens}: (hit block ids, tokens)")
        expect_equal(_lookup(build_manager(8), make_request("f", 8)), ([], 0),
                     "enable_caching=False: get_computed_blocks of a request of 8 tokens")


@pytest.mark.points(1)
@pytest.mark.task("get_computed_blocks")
def test_lookup_never_full_hit(student):
    """The last token is always computed (its logits give the next token): hits cover <= num_tokens - 1,
    generated tokens included."""
    req = make_request("c", list(range(1, 6)))  # a 5-token prompt that generated 6 tokens: [1..11]
    req.output_token_ids = list(range(6, 12))
    with plug(student, LAB, only=['get_computed_blocks']):
        kvm = _warm(list(range(1, 9)) + [70])  # blocks [1-4] and [5-8] cached in blocks 0 and 1
        for tokens, want in ((list(range(1, 9)), ([0], 4)), (list(range(1, 10)), ([0, 1], 8)),
                             (list(range(1, 5)), ([], 0))):
            expect_equal(_lookup(kvm, make_request("b", tokens)), want,
                         f"blocks [1-4] and [5-8] are cached; a request of {len(tokens)} tokens {tokens} may reuse at "
                         f"most {len(tokens) - 1}: (hit block ids, tokens)")
        # a request preempted by recompute comes back with the tokens it generated: they can hit the cache too
        expect_equal(_lookup(kvm, req), ([0, 1], 8),
                     "blocks [1-4] and [5-8] are cached; a request with prompt [1..5] and generated tokens [6..11] "
                     "(11 tokens; the cap is num_tokens - 1, not the prompt): (hit block ids, tokens)")


@pytest.mark.points(1)
@pytest.mark.task("get_computed_blocks")
def test_lookup_stops_at_first_miss(student):
    """A prefix hit is contiguous: after an evicted block, later cached blocks cannot be used."""
    kvm = _warm(list(range(1, 14)))
    pool = kvm.block_pool
    middle = kvm.req_to_blocks["a"][1]
    del pool.cached_blocks[middle.block_hash]  # as if block [5-8] had been evicted and reused
    middle.block_hash = None
    with plug(student, LAB, only=['get_computed_blocks']):
        got = _lookup(kvm, make_request("b", list(range(1, 14))))
    expect_equal(got, ([0], 4), "blocks [1-4] and [9-12] are cached (blocks 0 and 2) but [5-8] is not: a request of "
                                "tokens 1..13, (hit block ids, tokens); block [9-12]'s KV needs [5-8]'s KV first")


# ---- find the bug: buggy_get_computed_blocks ---------------------------------------------

def buggy_get_computed_blocks(self, request):
    """The longest run of cached full blocks from the start of the request, and the tokens they
    cover; capped at num_tokens - 1 tokens so the last token is always computed."""
    if not self.enable_caching:
        return [], 0
    max_blocks = (request.num_tokens - 1) // self.block_size
    hits = [self.block_pool.get_cached_block(h) for h in self.block_hashes(request, max_blocks)]
    hits = [block for block in hits if block is not None]
    return hits, len(hits) * self.block_size


def _lookup_verdict(args) -> str:
    """Runs buggy_get_computed_blocks on the learner's (num_tokens, cached block indices): a request of tokens
    1..num_tokens, blocks of 4, whose full block i (i in the set) is cached in physical block i; compares it
    with the specification: blocks 0, 1, ... up to the first index not cached, at most (num_tokens - 1) // 4."""
    if not (isinstance(args, tuple) and len(args) == 2 and type(args[0]) is int
            and isinstance(args[1], (set, frozenset, list, tuple)) and all(type(i) is int for i in args[1])):
        return "not a pair (num_tokens, set of block indices)"
    num_tokens, cached = args[0], set(args[1])
    if not (1 <= num_tokens <= 64 and all(0 <= i < num_tokens // 4 for i in cached)):
        return "out of range: need 1 <= num_tokens <= 64 and indices of full blocks (0 <= i < num_tokens // 4)"
    request = make_request("r", list(range(1, num_tokens + 1)))
    kvm = build_manager(16, caching=True)
    _memoize_hashes(kvm, request)
    hashes = kvm.req_to_block_hashes["r"]
    kvm.block_pool.cache_full_blocks([kvm.block_pool.blocks[i] for i in sorted(cached)], [hashes[i] for i in sorted(cached)])
    blocks, num = buggy_get_computed_blocks(kvm, request)
    want = 0
    while want < (num_tokens - 1) // 4 and want in cached:
        want += 1
    right = [b.block_id for b in blocks] == list(range(want)) and num == 4 * want
    return "buggy_get_computed_blocks is right on this input" if right else "buggy_get_computed_blocks is wrong here"


@pytest.mark.points(2)
@pytest.mark.task("find_the_bug")
def test_failing_input_exposes_buggy_lookup(student):
    """failing_input() returns (num_tokens, cached block indices) on which buggy_get_computed_blocks (shown in
    the notebook; this module's copy is the one that runs) returns the wrong hits. Your own
    get_computed_blocks is the fix, graded by the lookup tests."""
    expect_equal(_lookup_verdict(student.failing_input()), "buggy_get_computed_blocks is wrong here",
                 "buggy_get_computed_blocks run on failing_input() (a request of tokens 1..num_tokens, blocks of 4, "
                 "the given full blocks cached), compared with the hits the specification asks for")


# ---- task 3: LRU eviction in BlockPool ---------------------------------------------------

def _cached_pool(n):
    """A pool of n blocks, all in use (ref_cnt 1) and cached under hashes h0..h{n-1}, built directly."""
    pool = build_pool(n, held={i: 1 for i in range(n)}, cached={i: (i,) for i in range(n)})
    return pool, list(pool.blocks), [BlockHash(1000 + i, (i,)) for i in range(n)]


def _free(pool, blocks):
    """Frees blocks (ref_cnt 1 -> 0) onto the free queue's tail, written directly (no seam runs)."""
    for b in blocks:
        b.ref_cnt -= 1
        if b.ref_cnt == 0:
            pool.free_queue[b.block_id] = b


def _ids(blocks):
    return [b.block_id for b in blocks]


@pytest.mark.points(2)
@pytest.mark.task("lru_eviction")
def test_evicts_least_recently_used_first(student):
    """Free cached blocks are evicted in the order they were freed; a hit makes a block most recent."""
    pool, blocks, hashes = _cached_pool(6)
    _free(pool, [blocks[3], blocks[1], blocks[5]])  # free queue, front to back: 3, 1, 5
    with plug(student, LAB, only=['get_new_blocks', 'touch']):
        expect_equal(_ids(pool.get_new_blocks(1)), [3],
                     "blocks 0..5 cached, freed in the order 3, 1, 5 (free queue [3, 1, 5]): get_new_blocks(1), the "
                     "least recently used first")
        pool.touch([blocks[1]])  # a prefix hit on block 1: in use again
        _free(pool, [blocks[1]])  # freed again: now the most recently used; queue 5, 1
        got = pool.get_new_blocks(2)
    expect_equal((_ids(got), [b.ref_cnt for b in got]), ([5, 1], [1, 1]),
                 "then a hit on block 1 (touch) and its release (free queue [5, 1]): get_new_blocks(2), (block ids, "
                 "their ref_cnt)")


@pytest.mark.points(1)
@pytest.mark.task("lru_eviction")
def test_touch_takes_hits_out_of_the_free_queue(student):
    """touch: a free cached block leaves the free queue (never handed out while used); a used block gains a holder."""
    pool, blocks, hashes = _cached_pool(4)
    _free(pool, [blocks[0], blocks[2]])
    with plug(student, LAB, only=['get_new_blocks', 'touch']):
        pool.touch([blocks[2], blocks[1]])  # 2 was free and cached; 1 is in use by someone else
        expect_equal(([b.ref_cnt for b in blocks], list(pool.free_queue)), ([0, 2, 1, 1], [0]),
                     "blocks 0..3 cached, 0 and 2 free (free queue [0, 2]): touch([block 2, block 1]), then (ref_cnt "
                     "by block id, the free queue)")
        got = pool.get_new_blocks(1)
    expect_equal((_ids(got), pool.get_cached_block(hashes[2]) is blocks[2]), ([0], True),
                 "then get_new_blocks(1): (the block handed out, does the touched block 2 stay cached?)")


@pytest.mark.points(1)
@pytest.mark.task("lru_eviction")
def test_eviction_forgets_the_hash(student):
    """Handing out a cached block evicts it: its hash leaves the map, so no later request hits stale KV."""
    pool, blocks, hashes = _cached_pool(3)
    _free(pool, [blocks[1], blocks[0]])
    with plug(student, LAB, only=['get_new_blocks', 'touch']):
        got = pool.get_new_blocks(1)
    expect_equal((_ids(got), blocks[1].block_hash, pool.get_cached_block(hashes[1]) is None,
                  pool.get_cached_block(hashes[0]) is blocks[0]), ([1], None, True, True),
                 "blocks 0..2 cached, 1 and 0 free (free queue [1, 0]): get_new_blocks(1), then (the block handed out, "
                 "its block_hash, is its old hash gone from the cache?, does block 0, still free, stay cached?)")


def _shared_prompt_workload():
    system = [(11 * k) % 400 + 3 for k in range(40)]  # a 40-token system prompt, blocks of 16
    users = [[(31 * i + 7 * k) % 400 + 3 for k in range(10)] for i in range(5)]
    return [system + u for u in users]


@pytest.mark.points(2)
@pytest.mark.task("end_to_end")
@pytest.mark.end_to_end
def test_hit_rate_shared_system_prompt(student):
    """Five 50-token prompts share a 40-token system prompt; the first runs alone, then the other four.

    By hand: blocks of 16; the shared 40 tokens fill blocks 0 and 1 (tokens 0-31); block 2 mixes 8 system
    tokens with the user's. The first request hits nothing; each of the other four, admitted together
    after it finished, hits its 2 full blocks = 32 tokens (they cannot hit each other: a block is cached
    once its KV is computed). Queries count every admitted prompt token: 5 x 50 = 250; hits 4 x 32 = 128."""
    requests = [(f"r{i}", p, 3) for i, p in enumerate(_shared_prompt_workload())]
    with plug(student, LAB):
        run = run_engine([requests[:1], requests[1:]], num_gpu_blocks=64, swap_space=0, enable_prefix_caching=True)
    expect_equal([run.cached[rid] for rid, _, _ in requests], [0, 32, 32, 32, 32],
                 "five 50-token prompts sharing 40 tokens, blocks of 16, the first alone: prompt tokens served from "
                 "the cache per request")
    expect_equal((run.stats["prefix_cache_hits"], run.stats["prefix_cache_queries"]), (128, 250),
                 "(prefix-cache hits, queries) of the same run")


# ---- prediction --------------------------------------------------------------------------

def wave_hit_rate(prefix_len, num_requests=6, question_len=16, block_size=16):
    """The hit rate of one wave of the experiment: a warm-up request, then `num_requests` together, each a
    shared prefix of `prefix_len` tokens plus its own question: only whole blocks of the prefix hit."""
    shared = prefix_len // block_size * block_size
    return num_requests * shared / ((num_requests + 1) * (prefix_len + question_len))


@pytest.mark.points(2)
@pytest.mark.task("prediction")
def test_predicted_hit_rate(student):
    """Your predicted_hit_rate() against 6 x 240 / (7 x 264) = 0.779.

    Tolerance 0.01 (absolute): the answer is an exact fraction; 0.01 accepts it rounded to two decimals.
    The usual slips are further away: caching the partial block too (6 x 248 / 1848 = 0.805), leaving
    the warm-up request out of the queries (1440 / 1584 = 0.909), or counting the question tokens as hits."""
    assert abs(wave_hit_rate(248) - 1440 / 1848) < 1e-12, "the formula (a test bug)"
    expect_prediction(float(student.predicted_hit_rate()), wave_hit_rate(248),
                 "the prefix-cache hit rate of one wave of the experiment with P = 248: a warm-up request, then 6 "
                 "together, each 248 shared tokens + a 16-token question, blocks of 16", atol=0.01)


# ---- end to end --------------------------------------------------------------------------

@pytest.mark.points(2)
@pytest.mark.task("end_to_end")
@pytest.mark.end_to_end
def test_collision_cannot_share_kv(student):
    """A bad hash (every hash_value 0) makes all blocks collide; your BlockHash must still keep blocks
    with different tokens apart: the tokens stay the reference ones."""
    def colliding(parent_hash, token_ids, extra_keys=None):
        return student.hash_block_tokens(parent_hash, token_ids, extra_keys)._replace(hash_value=0)

    with plug(student, LAB, overrides={"hash_block_tokens": colliding}):
        tables, outputs = _collision_workload()
    expect_equal(tables, {"b": (True, False), "c": (True, False)},
                 "blocks of 4, every hash_value 0; a = [1..9], b = [1, 2, 3, 4, 9, 9, 9, 9, 9], c = [1..7, 9, 9] "
                 "arrive one per step: (does the request share a's first block [1-4]?, does it share a's second "
                 "block [5-8]?) for b and c")
    expect_equal(outputs, {rid: reference_output(p, 6) for rid, p in COLLISION_PROMPTS.items()},
                 "the fake model's greedy tokens of a, b and c (each one's own prompt, computed without a cache)")


COLLISION_PROMPTS = {"a": [1, 2, 3, 4, 5, 6, 7, 8, 9], "b": [1, 2, 3, 4, 9, 9, 9, 9, 9], "c": [1, 2, 3, 4, 5, 6, 7, 9, 9]}


def _collision_workload():
    """Blocks of 4; every block's tokens are unique to its request except the shared first block [1-4]."""
    sched = make_scheduler(32, enable_prefix_caching=True)
    runner = FakeRunner(32, 4)
    outputs = {}
    for rid, prompt in COLLISION_PROMPTS.items():  # one arrives per step, after the previous one's blocks are cached
        sched.add_request(make_request(rid, prompt, max_tokens=6))
        out = sched.schedule()
        for r in sched.update_from_output(out, runner.execute(out)):
            outputs[r.request_id] = list(r.output_token_ids)
    kvm = sched.kv_cache_manager
    a = kvm.get_block_ids("a")
    tables = {rid: (kvm.get_block_ids(rid)[0] == a[0], kvm.get_block_ids(rid)[1] == a[1]) for rid in "bc"}
    for _ in range(200):
        if not sched.has_unfinished_requests():
            break
        out = sched.schedule()
        for r in sched.update_from_output(out, runner.execute(out)):
            outputs[r.request_id] = list(r.output_token_ids)
    return tables, outputs


ENGINE_PROMPTS = [[(13 * k) % 300 + 3 for k in range(n_sys)] + [(29 * i + 5 * k) % 300 + 3 for k in range(n_user)]
                  for i, (n_sys, n_user) in enumerate(((48, 6), (48, 20), (48, 3), (20, 30), (48, 9), (70, 5),
                                                       (48, 6), (20, 1)))]
COUNTS = ("prefix_cache_queries", "prefix_cache_hits", "num_prefill_tokens", "num_preemptions")


def _engine_run(caching: bool):
    """tiny-llama, 12 blocks of 16 (evictions happen), the prompts in three waves."""
    requests = [(f"r{i}", p, 5) for i, p in enumerate(ENGINE_PROMPTS)]
    return run_engine([requests[:1], requests[1:4], requests[4:]], num_gpu_blocks=12, swap_space=0,
                      enable_prefix_caching=caching, max_num_batched_tokens=64)


@functools.cache
def reference_engine(caching: bool) -> tuple[dict, dict]:
    """The reference engine's tokens and counts (once per process: the planted-bug runs share them)."""
    run = _engine_run(caching)
    return run.tokens, {k: run.stats[k] for k in COUNTS}


@pytest.mark.points(3)
@pytest.mark.task("end_to_end")
@pytest.mark.end_to_end
def test_engine_same_tokens_with_and_without_cache(student):
    """The real engine with your four pieces and caching on gives the tokens of caching off, under
    eviction pressure (12 blocks), with the reference engine's prefix-cache hits, and frees every block."""
    with plug(student, LAB) as plugged:
        run = _engine_run(True)
    assert reference_engine(True)[1]["prefix_cache_hits"] > 0, "the shared prompts must hit (a test bug)"
    assert reference_engine(True)[0] == reference_engine(False)[0], "caching must not change tokens (a test bug)"
    setup = ("tiny-llama, 12 blocks of 16, budget 64, prefix caching on, 8 prompts sharing 20 to 70 tokens in "
             "three waves")
    expect_equal(plugged.uncalled(), [], f"{setup}: your functions the engine never called")
    expect_equal(run.tokens, reference_engine(False)[0], f"{setup}: each request's tokens (those of caching off)")
    expect_equal({k: run.stats[k] for k in COUNTS}, reference_engine(True)[1],
                 f"{setup}: prefix-cache queries and hits, prefill tokens computed, preemptions (the reference "
                 f"engine's: hits lost to a wrong eviction order show here)")
    expect_equal(held_blocks(run.engine.scheduler.kv_cache_manager), [],
                 f"{setup}: (pool, block, ref_cnt) still held after every request finished")
