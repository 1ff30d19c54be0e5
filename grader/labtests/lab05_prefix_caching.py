"""Official tests of lab 05_prefix_caching: chained block hashes, prefix lookup, LRU eviction.

The learner writes `hash_block_tokens` (seam: the module function in engine_core.core.kv_cache_manager
that `KVCacheManager.block_hashes` calls), `get_computed_blocks` (seam: the KVCacheManager method)
and the LRU side of `BlockPool` (`get_new_blocks`, `touch`). Every test runs inside
`plug(student, LAB)` (grader/plug.py): all four are the learner's, the engine's own raise. The
lookup and LRU tests build the cache state directly (block tables, ref counts, the free queue,
cache entries under test-made hashes), so they do not depend on the learner's hash; the
end-to-end tests compare the real engine with caching on against the reference engine with
caching off (computed after the plug ends). `harness.FakeRunner`'s tokens go wrong when a block
is shared with the wrong prefix.
"""
import functools
import random

import pytest

from grader.harness import (BlockHash, FakeRunner, assert_no_leaked_blocks, build_manager, build_pool,
                            make_request, make_scheduler, reference_output, run_engine)
from grader.plug import plug

LAB = "05_prefix_caching"


def _hash(student, parent, tokens, extra=None):
    got = student.hash_block_tokens(parent, tokens, extra)
    assert isinstance(got, BlockHash), (f"hash_block_tokens({parent!r}, {list(tokens)}, {extra!r}) returned "
                                        f"{got!r}, expected a BlockHash(hash_value, token_ids, extra_keys)")
    return got


def run_all(sched, runner, outputs=None):
    """Step until every request finished; tokens by request id."""
    outputs = {} if outputs is None else outputs
    for _ in range(1000):
        if not sched.has_unfinished_requests():
            return outputs
        out = sched.schedule()
        for r in sched.update_from_output(out, runner.execute(out)):
            outputs[r.request_id] = list(r.output_token_ids)
    raise AssertionError(f"not finished after 1000 steps: running {sched.running}, waiting {list(sched.waiting)}")


# ---- task 1: hash_block_tokens -----------------------------------------------------------

@pytest.mark.points(1)
@pytest.mark.task("hash_block_tokens")
def test_hash_keeps_tokens_and_chains(student):
    """Equal inputs give equal hashes; the block's tokens are kept; the parent enters the hash."""
    with plug(student, LAB):
        a = _hash(student, None, [1, 2, 3, 4])
        assert a == _hash(student, None, (1, 2, 3, 4)), "a list and a tuple of the same tokens must hash alike"
        assert a.token_ids == (1, 2, 3, 4) and a.extra_keys is None, (
            f"hash_block_tokens(None, [1, 2, 3, 4]) must keep token_ids=(1, 2, 3, 4) and extra_keys=None, got {a}")
        assert isinstance(a.hash_value, int), f"hash_value must be an int, got {a.hash_value!r}"
        child, orphan = _hash(student, a.hash_value, [5, 6, 7, 8]), _hash(student, None, [5, 6, 7, 8])
        assert child.hash_value != orphan.hash_value, (
            "the same tokens [5, 6, 7, 8] after the block [1, 2, 3, 4] and as a first block got the same hash_value "
            f"{child.hash_value}: the parent's hash must enter the hash (the chain is what makes it a *prefix* hash)")
        other_parent = _hash(student, _hash(student, None, [1, 2, 3, 9]).hash_value, [5, 6, 7, 8])
        assert child.hash_value != other_parent.hash_value, "different parents, same tokens: the hash_values must differ"
        rng = random.Random(0)
        blocks = {tuple(rng.randrange(100) for _ in range(4)) for _ in range(300)}
        values = {_hash(student, None, b).hash_value for b in blocks}
        assert len(values) == len(blocks), f"{len(blocks)} different blocks gave only {len(values)} hash values"
    _check_structured_blocks(student)


def _check_structured_blocks(student):
    """Structured blocks, not random ones: a block's tokens in another order are another block, and a
    chain that repeats a block must not cancel out (hash_value = parent ^ hash(tokens) maps block 4 of
    [A, B, B, C] onto block 2 of [A, C]: a lookup of [A, C] would take KV computed after [A, B, B])."""
    a, b, c = [1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12]
    kvm = build_manager(8, {"abbc": [0, 1, 2, 3, 4]}, caching=True)
    with plug(student, LAB):
        first, reordered = _hash(student, None, a), _hash(student, None, a[::-1])
        assert first.hash_value != reordered.hash_value, (
            f"hash_block_tokens(None, {a}) and (None, {a[::-1]}) got the same hash_value {first.hash_value}: the "
            f"order of the tokens must enter the hash")
        kvm.cache_blocks(make_request("abbc", a + b + b + c + [13]), 16)  # 4 full blocks cached, with your hash
        blocks, num = kvm.get_computed_blocks(make_request("ac", a + c + [13]))
    assert (len(blocks), num) == (1, 4), (
        f"[A, B, B, C] is cached (A = {a}, B = {b}, C = {c}); a request [A, C, 13] may reuse only block A, got "
        f"{len(blocks)} blocks ({num} tokens): its second block [C] after [A] hashed like C after [A, B, B]")


@pytest.mark.points(1)
@pytest.mark.task("hash_block_tokens")
def test_hash_extra_keys_separate_loras(student):
    """The LoRA id (extra_keys) is kept and changes the hash: adapters never share KV."""
    with plug(student, LAB):
        tokens = [1, 2, 3, 4]
        plain, lora1, lora2 = (_hash(student, None, tokens, e) for e in (None, (1,), (2,)))
        assert lora1.extra_keys == (1,), f"extra_keys (1,) must be kept in the BlockHash, got {lora1}"
        values = {plain.hash_value, lora1.hash_value, lora2.hash_value}
        assert len(values) == 3, (f"the block {tokens} with extra_keys None, (1,), (2,) got hash_values "
                                  f"{[plain.hash_value, lora1.hash_value, lora2.hash_value]}: extra_keys must enter the hash")


@pytest.mark.points(1)
@pytest.mark.task("hash_block_tokens")
def test_block_hashes_of_requests(student):
    """In the engine's KVCacheManager: requests that share 8 tokens share exactly 2 block hashes (blocks of 4)."""
    kvm = build_manager(16, caching=True)
    a = make_request("a", list(range(1, 13)))
    b = make_request("b", list(range(1, 9)) + [50, 51, 52, 53])
    c = make_request("c", [99, 2, 3, 4] + list(range(5, 13)))  # differs from a in the first token only
    with plug(student, LAB):
        ha, hb, hc = (kvm.block_hashes(r, 3) for r in (a, b, c))
    assert ha[:2] == hb[:2] and ha[2] != hb[2], "a and b share tokens 1..8: their first 2 block hashes must be equal"
    assert all(x != y for x, y in zip(ha, hc)), (
        "c differs from a in its first token only: none of its 3 blocks may hash like a's (blocks 2 and 3 have the "
        "same tokens, but a different prefix)")


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


def _lookup(student, kvm, request):
    _memoize_hashes(kvm, request)
    with plug(student, LAB):
        got = kvm.get_computed_blocks(request)
    assert isinstance(got, tuple) and len(got) == 2, f"get_computed_blocks returned {got!r}, expected (blocks, num_tokens)"
    return list(got[0]), got[1]


@pytest.mark.points(2)
@pytest.mark.task("get_computed_blocks")
def test_lookup_longest_cached_prefix(student):
    """Hits are the cached blocks from the start of the request, as long as they match (blocks of 4)."""
    a_tokens = list(range(1, 14))  # 13 tokens: blocks [1-4] [5-8] [9-12] full and cached, [13] partial
    kvm = _warm(a_tokens)
    a_blocks = kvm.req_to_blocks["a"]
    cases = [("b", list(range(1, 11)), 2), ("c", list(range(1, 6)) + [40] * 6, 1), ("d", [40] + a_tokens[1:], 0),
             ("e", a_tokens + [60, 61], 3)]
    for rid, tokens, want in cases:
        blocks, num = _lookup(student, kvm, make_request(rid, tokens))
        assert [b.block_id for b in blocks] == [b.block_id for b in a_blocks[:want]] and num == 4 * want, (
            f"a = tokens 1..13 is cached in blocks {[b.block_id for b in a_blocks[:3]]}; request {tokens} should hit "
            f"blocks {[b.block_id for b in a_blocks[:want]]} ({4 * want} tokens), got "
            f"{[b.block_id for b in blocks]} ({num} tokens)")
    got = _lookup(student, build_manager(8), make_request("f", 8))
    assert got == ([], 0), f"with enable_caching=False the lookup must return ([], 0), got {got}"


@pytest.mark.points(1)
@pytest.mark.task("get_computed_blocks")
def test_lookup_never_full_hit(student):
    """The last token is always computed (its logits give the next token): hits cover <= num_tokens - 1,
    generated tokens included."""
    kvm = _warm(list(range(1, 9)) + [70])  # blocks [1-4] and [5-8] cached
    for tokens, want in ((list(range(1, 9)), 1), (list(range(1, 10)), 2), (list(range(1, 5)), 0)):
        blocks, num = _lookup(student, kvm, make_request("b", tokens))
        assert (len(blocks), num) == (want, 4 * want), (
            f"blocks [1-4] and [5-8] are cached; a request of {len(tokens)} tokens {tokens} may reuse at most "
            f"{len(tokens) - 1} tokens: expected {want} blocks ({4 * want} tokens), got {len(blocks)} ({num})")
    # a request preempted by recompute comes back with the tokens it generated: they can hit the cache too
    req = make_request("c", list(range(1, 6)))  # a 5-token prompt that generated 6 tokens: [1..11]
    req.output_token_ids = list(range(6, 12))
    blocks, num = _lookup(student, kvm, req)
    assert (len(blocks), num) == (2, 8), (
        f"blocks [1-4] and [5-8] are cached; a request with prompt [1..5] and generated tokens [6..11] has 11 tokens "
        f"and may reuse 2 blocks (8 tokens: the cap is num_tokens - 1, not the prompt), got {len(blocks)} ({num})")


@pytest.mark.points(1)
@pytest.mark.task("get_computed_blocks")
def test_lookup_stops_at_first_miss(student):
    """A prefix hit is contiguous: after an evicted block, later cached blocks cannot be used."""
    kvm = _warm(list(range(1, 14)))
    pool = kvm.block_pool
    middle = kvm.req_to_blocks["a"][1]
    del pool.cached_blocks[middle.block_hash]  # as if block [5-8] had been evicted and reused
    middle.block_hash = None
    blocks, num = _lookup(student, kvm, make_request("b", list(range(1, 14))))
    assert num == 4 and len(blocks) == 1, (
        f"blocks [1-4] and [9-12] are cached but [5-8] is not: the hit must stop at the miss (1 block, 4 tokens), "
        f"got blocks {[b.block_id for b in blocks]} ({num} tokens); block [9-12]'s KV needs [5-8]'s KV first")


# ---- task 3: LRU eviction in BlockPool ---------------------------------------------------

def _cached_pool(n):
    """A pool of n blocks, all in use (ref_cnt 1) and cached under hashes h0..h{n-1}, built directly."""
    pool = build_pool(n, held={i: 1 for i in range(n)}, cached={i: (i,) for i in range(n)})
    return pool, list(pool.blocks), [BlockHash(1000 + i, (i,)) for i in range(n)]


@pytest.mark.points(2)
@pytest.mark.task("lru_eviction")
def test_evicts_least_recently_used_first(student):
    """Free cached blocks are evicted in the order they were freed; a hit makes a block most recent."""
    pool, blocks, hashes = _cached_pool(6)
    pool.free_blocks([blocks[3], blocks[1], blocks[5]])  # free queue, front to back: 3, 1, 5
    with plug(student, LAB):
        got = pool.get_new_blocks(1)
    assert [b.block_id for b in got] == [3], (
        f"blocks were freed in the order 3, 1, 5; the least recently used (3) must be evicted first, got "
        f"{[b.block_id for b in got]}")
    with plug(student, LAB):
        pool.touch([blocks[1]])  # a prefix hit on block 1: in use again
        pool.free_blocks([blocks[1]])  # freed again: now the most recently used; queue 5, 1
        got = pool.get_new_blocks(2)
    assert [b.block_id for b in got] == [5, 1], (
        f"after a hit on block 1 and its release the free queue is 5, 1: expected [5, 1], got "
        f"{[b.block_id for b in got]}")
    assert all(b.ref_cnt == 1 for b in got), f"new blocks have ref_cnt 1: {got}"


@pytest.mark.points(1)
@pytest.mark.task("lru_eviction")
def test_touch_takes_hits_out_of_the_free_queue(student):
    """touch: a free cached block leaves the free queue (never handed out while used); a used block gains a holder."""
    pool, blocks, hashes = _cached_pool(4)
    pool.free_blocks([blocks[0], blocks[2]])
    with plug(student, LAB):
        pool.touch([blocks[2], blocks[1]])  # 2 was free and cached; 1 is in use by someone else
    assert (blocks[2].ref_cnt, blocks[1].ref_cnt) == (1, 2), (
        f"touch([block 2 (free), block 1 (ref_cnt 1)]) must give ref_cnt 1 and 2, got {blocks[2].ref_cnt} and "
        f"{blocks[1].ref_cnt}")
    assert pool.num_free_blocks == 1, f"only block 0 is free after the hit on block 2, num_free_blocks={pool.num_free_blocks}"
    with plug(student, LAB):
        got = pool.get_new_blocks(1)
    assert [b.block_id for b in got] == [0] and pool.get_cached_block(hashes[2]) is blocks[2], (
        f"the touched block 2 must stay cached and out of reach of get_new_blocks; got {got}")


@pytest.mark.points(1)
@pytest.mark.task("lru_eviction")
def test_eviction_forgets_the_hash(student):
    """Handing out a cached block evicts it: its hash leaves the map, so no later request hits stale KV."""
    pool, blocks, hashes = _cached_pool(3)
    pool.free_blocks([blocks[1], blocks[0]])
    with plug(student, LAB):
        got = pool.get_new_blocks(1)
    assert got == [blocks[1]] and blocks[1].block_hash is None, (
        f"evicting block 1 must clear its block_hash (got {blocks[1].block_hash}); handed out {got}")
    assert pool.get_cached_block(hashes[1]) is None, (
        "block 1 was handed out for new tokens, yet its old hash still finds it: a request with that prefix would "
        "read KV that is being overwritten")
    assert pool.get_cached_block(hashes[0]) is blocks[0], "block 0 (still free, not evicted) must stay cached"


def _shared_prompt_workload():
    system = [(11 * k) % 400 + 3 for k in range(40)]  # a 40-token system prompt, blocks of 16
    users = [[(31 * i + 7 * k) % 400 + 3 for k in range(10)] for i in range(5)]
    return [system + u for u in users]


@pytest.mark.points(2)
@pytest.mark.task("get_computed_blocks")
def test_hit_rate_shared_system_prompt(student):
    """Five 50-token prompts share a 40-token system prompt; the first runs alone, then the other four."""
    requests = [(f"r{i}", p, 3) for i, p in enumerate(_shared_prompt_workload())]
    with plug(student, LAB):
        run = run_engine([requests[:1], requests[1:]], num_gpu_blocks=64, swap_space=0, enable_prefix_caching=True)
    # By hand: blocks of 16; the shared 40 tokens fill blocks 0 and 1 (tokens 0-31); block 2 mixes 8 system
    # tokens with the user's. The first request hits nothing; each of the other four, admitted together
    # after it finished, hits its 2 full blocks = 32 tokens (they cannot hit each other: a block is cached
    # once its KV is computed). Queries count every admitted prompt token: 5 x 50 = 250; hits 4 x 32 = 128.
    cached = [run.cached[rid] for rid, _, _ in requests]
    assert cached == [0, 32, 32, 32, 32], f"prompt tokens served from the cache per request: expected [0, 32, 32, 32, 32], got {cached}"
    stats = run.stats
    want = 128 / 250
    assert stats["prefix_cache_hit_rate"] == pytest.approx(want), (
        f"hit rate: expected 128 / 250 = {want}, got {stats['prefix_cache_hits']} / {stats['prefix_cache_queries']}")


# ---- end to end --------------------------------------------------------------------------

@pytest.mark.points(2)
@pytest.mark.task("end_to_end")
def test_collision_cannot_share_kv(student):
    """A bad hash (every hash_value 0) makes all blocks collide; your BlockHash must still keep blocks
    with different tokens apart: the tokens stay the reference ones."""
    def colliding(parent_hash, token_ids, extra_keys=None):
        return student.hash_block_tokens(parent_hash, token_ids, extra_keys)._replace(hash_value=0)

    with plug(student, LAB, overrides={"hash_block_tokens": colliding}):
        _collision_workload()


def _collision_workload():
    # blocks of 4; every block's tokens are unique to its request except the shared first block [1-4]
    prompts = {"a": [1, 2, 3, 4, 5, 6, 7, 8, 9], "b": [1, 2, 3, 4, 9, 9, 9, 9, 9], "c": [1, 2, 3, 4, 5, 6, 7, 9, 9]}
    sched = make_scheduler(32, enable_prefix_caching=True)
    runner = FakeRunner(32, 4)
    outputs = {}
    for rid, prompt in prompts.items():  # one arrives per step, after the previous one's blocks are cached
        sched.add_request(make_request(rid, prompt, max_tokens=6))
        out = sched.schedule()
        for r in sched.update_from_output(out, runner.execute(out)):
            outputs[r.request_id] = list(r.output_token_ids)
    kvm = sched.kv_cache_manager
    assert kvm.get_block_ids("b")[0] == kvm.get_block_ids("a")[0], "b shares a's real first block [1-4]"
    for rid in "bc":
        assert kvm.get_block_ids(rid)[1] != kvm.get_block_ids("a")[1], (
            f"{rid}'s second block {prompts[rid][4:8]} differs from a's {prompts['a'][4:8]}; with every hash_value "
            f"colliding they still must not share a block (tables: a {kvm.get_block_ids('a')}, "
            f"{rid} {kvm.get_block_ids(rid)})")
    outputs = run_all(sched, runner, outputs)
    for rid, prompt in prompts.items():
        assert outputs[rid] == reference_output(prompt, 6), f"request {rid}: {outputs[rid]}, reference {reference_output(prompt, 6)}"


ENGINE_PROMPTS = [[(13 * k) % 300 + 3 for k in range(n_sys)] + [(29 * i + 5 * k) % 300 + 3 for k in range(n_user)]
                  for i, (n_sys, n_user) in enumerate(((48, 6), (48, 20), (48, 3), (20, 30), (48, 9), (70, 5),
                                                       (48, 6), (20, 1)))]


def _engine_run(caching: bool):
    """tiny-llama, 12 blocks of 16 (evictions happen), the prompts in three waves."""
    requests = [(f"r{i}", p, 5) for i, p in enumerate(ENGINE_PROMPTS)]
    return run_engine([requests[:1], requests[1:4], requests[4:]], num_gpu_blocks=12, swap_space=0,
                      enable_prefix_caching=caching, max_num_batched_tokens=64)


@functools.cache
def reference_engine_tokens() -> dict:
    """The engine's tokens with caching off (once per process: the planted-bug runs share them)."""
    return _engine_run(False).tokens


@pytest.mark.points(3)
@pytest.mark.task("end_to_end")
@pytest.mark.end_to_end
def test_engine_same_tokens_with_and_without_cache(student):
    """The real engine with your four pieces and caching on gives the tokens of caching off, under
    eviction pressure (12 blocks), and frees every block."""
    with plug(student, LAB) as plugged:
        run = _engine_run(True)
    engine, got, want = run.engine, run.tokens, reference_engine_tokens()
    assert not plugged.uncalled(), f"the engine never called your {plugged.uncalled()}"
    for rid in want:
        assert got.get(rid) == want[rid], (f"request {rid} ({len(ENGINE_PROMPTS[int(rid[1:])])}-token prompt) with "
                                           f"caching on produced {got.get(rid)}, with caching off {want[rid]}")
    stats = engine.stats()
    assert stats["prefix_cache_hits"] > 0, f"the shared prompts never hit the cache: {stats['prefix_cache_queries']} queries"
    assert_no_leaked_blocks(engine.scheduler, "engine with prefix caching")
