"""Prefix caching rules: chained hashes of full blocks, hits shared by ref count, cached only once
written, LRU eviction, never a full hit, no sharing across a hash collision or across LoRAs."""
import random

import pytest
from grader.harness import EOS, FakeRunner, make_request, make_scheduler, reference_output, run_to_completion

from engine_core.core import kv_cache_manager as kvm_module
from engine_core.core.block_pool import BlockHash
from engine_core.core.kv_cache_manager import hash_block_tokens


def step(sched, runner):
    out = sched.schedule()
    sched.update_from_output(out, runner.execute(out))
    return out


def make(num_gpu_blocks=32, **kw):
    sched = make_scheduler(num_gpu_blocks, enable_prefix_caching=True, **kw)
    return sched, FakeRunner(num_gpu_blocks, sched.block_size)


def test_hash_chains_on_the_parent_and_keeps_the_tokens():
    a = hash_block_tokens(None, [1, 2, 3, 4])
    assert a == hash_block_tokens(None, (1, 2, 3, 4)) and a.token_ids == (1, 2, 3, 4)
    assert hash_block_tokens(a.hash_value, [5, 6]) != hash_block_tokens(None, [5, 6])  # same tokens, other prefix
    assert hash_block_tokens(None, [1, 2], (7,)) != hash_block_tokens(None, [1, 2], (8,))  # LoRA ids


def test_a_second_request_reuses_the_first_ones_full_blocks():
    sched, runner = make()
    sched.add_request(make_request("a", 10, max_tokens=8))  # blocks [1-4] [5-8] and a partial one
    step(sched, runner)
    sched.add_request(b := make_request("b", list(range(1, 9)) + [40, 41], max_tokens=3))
    out = step(sched, runner)
    kvm = sched.kv_cache_manager
    assert kvm.get_block_ids("b")[:2] == kvm.get_block_ids("a")[:2]
    assert kvm.get_block_ids("b")[2] != kvm.get_block_ids("a")[2]  # the partial block is never shared
    assert [b.ref_cnt for b in kvm.req_to_blocks["b"][:2]] == [2, 2]
    assert [(c.request.request_id, c.start, c.num_tokens) for c in out.scheduled][-1] == ("b", 8, 2)
    assert b.num_cached_tokens == 8
    s = sched.stats()
    assert (s["prefix_cache_queries"], s["prefix_cache_hits"]) == (20, 8) and s["prefix_cache_hit_rate"] == 0.4


def test_never_a_full_hit_the_last_token_is_always_computed():
    sched, runner = make()
    sched.add_request(make_request("a", 8, max_tokens=2))
    step(sched, runner)
    sched.add_request(make_request("b", 8, max_tokens=2))  # identical prompt: 2 full cached blocks
    hits, n = sched.kv_cache_manager.get_computed_blocks(sched.waiting[0])
    assert (len(hits), n) == (1, 4)  # capped at 7 tokens -> 1 block; the last block is recomputed


def test_blocks_are_cached_only_after_their_kv_is_written():
    sched, runner = make()
    sched.add_request(make_request("a", 8, max_tokens=2))
    out = sched.schedule()
    assert sched.kv_cache_manager.block_pool.cached_blocks == {}  # scheduled, not yet computed
    sched.update_from_output(out, runner.execute(out))
    assert len(sched.kv_cache_manager.block_pool.cached_blocks) == 2


def test_chunked_prefill_caches_each_chunks_full_blocks():
    sched, runner = make(max_num_batched_tokens=6)
    sched.add_request(make_request("a", 12, max_tokens=2))
    step(sched, runner)  # 6 tokens: 1 full block
    assert len(sched.kv_cache_manager.block_pool.cached_blocks) == 1
    step(sched, runner)
    assert len(sched.kv_cache_manager.block_pool.cached_blocks) == 3


def test_freed_blocks_stay_cached_until_evicted_least_recently_used_first():
    sched, runner = make(num_gpu_blocks=6)
    sched.add_request(make_request("a", [1, 1, 1, 1, 2, 2, 2, 2, 3], max_tokens=1))
    step(sched, runner)  # a finishes; its 2 full blocks stay cached in the free queue
    sched.add_request(make_request("b", [5, 5, 5, 5, 6], max_tokens=1))
    step(sched, runner)  # b finishes later: its block is more recently used than a's
    pool = sched.kv_cache_manager.block_pool
    assert len(pool.cached_blocks) == 3 and pool.num_free_blocks == 6
    sched.add_request(make_request("c", 16, max_tokens=1))  # needs 5 fresh blocks: evicts a's two first
    out = sched.schedule()
    hashes = {h.token_ids for h in pool.cached_blocks}
    assert hashes == {(5, 5, 5, 5)} and out.scheduled[0].start == 0


def test_hit_on_a_free_cached_block_takes_it_back_from_the_free_queue():
    sched, runner = make(num_gpu_blocks=8)
    sched.add_request(make_request("a", 9, max_tokens=1))
    step(sched, runner)
    pool = sched.kv_cache_manager.block_pool
    cached = {b.block_id for b in pool.cached_blocks.values()}
    sched.add_request(make_request("b", 10, max_tokens=2))
    step(sched, runner)
    assert set(sched.kv_cache_manager.get_block_ids("b")[:2]) == cached
    assert not cached & set(pool.free_queue)


def test_hash_collision_does_not_share_kv(monkeypatch):
    """A hash that ignores the tokens makes every block at one depth collide; the token ids kept in
    BlockHash must still keep different blocks apart (the outputs would change otherwise)."""
    def weak(parent_hash, token_ids, extra_keys=None):
        return BlockHash(hash((parent_hash, "depth")) & 0xFF, tuple(token_ids), extra_keys)
    monkeypatch.setattr(kvm_module, "hash_block_tokens", weak)
    sched, runner = make()
    prompts = {"a": [1, 2, 3, 4, 5, 6, 7, 8, 9], "b": [1, 2, 3, 4, 9, 9, 9, 9, 9]}
    for rid, p in prompts.items():
        sched.add_request(make_request(rid, p, max_tokens=6, eos=EOS))
        step(sched, runner)
    kvm = sched.kv_cache_manager
    assert kvm.get_block_ids("a")[0] == kvm.get_block_ids("b")[0]  # a real shared prefix
    assert kvm.get_block_ids("a")[1] != kvm.get_block_ids("b")[1]
    outs = run_to_completion(sched, runner)
    assert outs == {rid: reference_output(p, 6, EOS) for rid, p in prompts.items()}


def test_different_loras_never_share_blocks():
    sched, runner = make()
    sched.add_request(make_request("a", 9, lora_id=1))
    step(sched, runner)
    sched.add_request(make_request("b", 9, lora_id=2))
    sched.add_request(make_request("c", 9, lora_id=1))
    step(sched, runner)
    kvm = sched.kv_cache_manager
    assert kvm.get_block_ids("b")[0] != kvm.get_block_ids("a")[0] == kvm.get_block_ids("c")[0]


@pytest.mark.parametrize("chunked", [True, False])
def test_shared_system_prompt_saves_exactly_the_shared_prefill(chunked):
    rng = random.Random(5)
    system = [rng.randrange(1, 50) for _ in range(64)]  # 16 blocks of 4
    reqs = {f"r{i}": system + [rng.randrange(1, 50) for _ in range(rng.randrange(1, 12))] for i in range(32)}

    def run(prefix):
        sched = make_scheduler(512, enable_prefix_caching=prefix, enable_chunked_prefill=chunked,
                               max_num_batched_tokens=128)
        runner = FakeRunner(512, 4)
        sched.add_request(make_request("r0", reqs["r0"], max_tokens=1, eos=None))  # warms the cache
        run_to_completion(sched, runner)
        for rid, p in reqs.items():
            sched.add_request(make_request(rid + "'", p, max_tokens=5, eos=EOS))
        return run_to_completion(sched, runner), sched.stats()

    on, s_on = run(True)
    off, s_off = run(False)
    assert on == off == {rid + "'": reference_output(p, 5, EOS) for rid, p in reqs.items()}
    # every one of the 32 requests (r0 too, warmed by its twin) skips the 64 shared tokens, and r0' its own full blocks
    own = (len(reqs["r0"]) - 1) // 4 * 4 - 64
    assert s_off["num_prefill_tokens"] - s_on["num_prefill_tokens"] == 32 * 64 + own
    assert s_on["prefix_cache_hits"] == 32 * 64 + own


def test_engine_32_requests_sharing_a_system_prompt():
    """Issue #4: identical outputs with caching on and off; the prefill tokens computed drop by the
    shared part. One earlier request served the system prompt (as in a running server), so each
    of the 32 finds its 96 tokens (6 blocks of 16) cached."""
    from engine_core.entrypoints.llm import LLM
    from engine_core.request import SamplingParams

    rng = random.Random(3)
    system = [rng.randrange(3, 512) for _ in range(96)]
    # each suffix starts with its own token, so only the system prompt is shared
    prompts = [system + [3 + i] + [rng.randrange(3, 512) for _ in range(rng.randrange(4, 24))] for i in range(32)]
    sp = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)

    def run(prefix):
        llm = LLM(model="tiny-llama", enable_prefix_caching=prefix, num_gpu_blocks=512, max_model_len=256)
        llm.generate([system + [511]], sp, use_tqdm=False)
        before = llm.engine.stats()["num_prefill_tokens"]
        outs = llm.generate(prompts, sp, use_tqdm=False)
        stats = llm.engine.stats()
        return [o.outputs[0].token_ids for o in outs], stats["num_prefill_tokens"] - before, stats, outs

    on, prefill_on, stats_on, outs_on = run(True)
    off, prefill_off, _, _ = run(False)
    assert on == off
    assert prefill_off - prefill_on == 32 * 96
    assert stats_on["prefix_cache_hits"] == 32 * 96
    assert [o.num_cached_tokens for o in outs_on] == [96] * 32
