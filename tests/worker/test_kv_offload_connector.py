"""The CPU offload connector in the engine: a returning session's blocks come back from the tier instead of being
recomputed, with the same greedy tokens; a torn copy, a copy that never signals, or a hash collision is detected
and recomputed, never served; a prefetch leaves the running requests' blocks free and its copy is finished first when
they need more; bad settings are refused. (Its speed: `make bench-kv-offload`, not a timed test.)"""
from __future__ import annotations

import threading

import pytest
import torch

from engine_core import LLMEngine, SamplingParams
from engine_core.core.block_pool import BlockHash
from engine_core.worker import kv_offload

A = list(range(1, 31))  # 30 tokens: 7 full blocks of 4
B = list(range(200, 230))


def engine(offload: int = 1 << 20, **kw) -> LLMEngine:
    torch.set_num_threads(1)
    args = dict(model="tiny-llama", enable_prefix_caching=True, num_gpu_blocks=12, block_size=4,
                kv_offload_bytes=offload)
    return LLMEngine.from_kwargs(**{**args, **kw})


def run(e: LLMEngine, rid: str, prompt: list[int]) -> list[int]:
    e.add_request(rid, {"prompt_token_ids": prompt}, SamplingParams(max_tokens=4, temperature=0.0))
    out = None
    while e.has_unfinished_requests():
        for o in e.step():
            if o.finished:
                out = list(o.outputs[0].token_ids)
    assert out is not None
    return out


def session(e: LLMEngine, before_return=None) -> list[list[int]]:
    """Session A, then B (its blocks push A's out of the 12-block device cache), then A returns with more."""
    first = run(e, "a1", A)
    other = run(e, "b1", B)
    if before_return is not None:
        before_return(e)
    again = run(e, "a2", A + first + [77, 78, 79, 80, 81])
    return [first, other, again]


@pytest.fixture(scope="module")
def reference() -> list[list[int]]:
    e = engine(0)
    try:
        return session(e)
    finally:
        e.shutdown()


def test_returning_session_loads_its_blocks_and_tokens_match(reference):
    e = engine()
    try:
        assert session(e) == reference
        stats = e.stats()
        # A wrote 33 tokens' KV (8 full blocks), B 8 more; freed tail first, A's first 3 blocks outlive B in the
        # 12-block device cache, blocks 3-7 come back from the tier: 8 blocks = 32 tokens of prefix hits
        assert stats["kv_offload_saved_blocks"] >= 16
        assert stats["kv_offload_loaded_blocks"] == 5 and stats["prefix_cache_hits"] == 32
        assert stats["kv_offload_failed_loads"] == 0 and stats["kv_offload_collisions"] == 0
        assert stats["external_prefix_cache_hits"] == 5
        text = e.prometheus_metrics()
        assert "inference_labs:kv_offload_hit_blocks 5.0\n" in text
        assert "inference_labs:kv_offload_loaded_blocks 5.0\n" in text
    finally:
        e.shutdown()


def test_client_hint_prefetches_before_the_request(reference):
    started = []

    def hint(e: LLMEngine) -> None:
        started.append(e.prefetch({"prompt_token_ids": A + reference[0] + [77, 78, 79, 80, 81]}))

    e = engine()
    try:
        assert session(e, hint) == reference
        assert started[0] == 5 and e.stats()["kv_offload_loaded_blocks"] == 5
    finally:
        e.shutdown()


def test_prefetch_leaves_the_running_requests_blocks(reference, monkeypatch):
    """A hint while request R decodes: the copy back holds its device blocks until it ends (here: until the engine
    waits for it, so the test decides nothing by timing). Without the reserve the hint took all 8 free blocks and
    R, needing one more for its next token, was preempted at once; without finishing the copy first, R was
    preempted when it needed its 6th block three steps later."""
    r_prompt = list(range(400, 416))  # 4 full blocks; its 17th token needs a 5th, its 21st a 6th
    r_params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    e = engine(0)
    try:
        e.add_request("r", {"prompt_token_ids": r_prompt}, r_params)
        r_reference = [list(o.outputs[0].token_ids) for _ in range(9) for o in e.step() if o.finished]
    finally:
        e.shutdown()
    gate = threading.Event()  # set when the engine first waits for the prefetch's copy; the copy thread waits on it

    class EngineWaits(threading.Event):
        def wait(self, timeout=None):
            gate.set()
            return super().wait(timeout)

    e = engine()
    try:
        first = run(e, "a1", A)
        run(e, "b1", B)
        e.add_request("r", {"prompt_token_ids": r_prompt}, r_params)
        e.step()  # R's prompt: it holds 4 blocks (A's 3 device hits evicted for them), 8 are free
        c, pool = e.kv_offload, e.scheduler.kv_cache_manager.block_pool
        copy, submit = c.copier._copy, c.copier.submit

        def gated_copy(job):
            if job.kind == "load":
                gate.wait(60)
            copy(job)

        def signalling_submit(job):
            if job.kind == "load":
                job.done = EngineWaits()
            return submit(job)

        monkeypatch.setattr(c.copier, "_copy", gated_copy)
        monkeypatch.setattr(c.copier, "submit", signalling_submit)
        started = e.prefetch({"prompt_token_ids": A + first + [77, 78, 79, 80, 81]})
        # 8 of A's blocks are in the tier, 8 device blocks free; R's next token needs 1: 7 copies start, 1 skipped
        assert (started, e.stats()["kv_offload_prefetch_skipped_blocks"]) == (7, 1)
        assert pool.num_free_blocks == c.reserve_blocks() == 1
        r_tokens = None
        for i in range(9):
            for o in e.step():
                r_tokens = list(o.outputs[0].token_ids) if o.finished else r_tokens
            if i == 0:
                assert not gate.is_set()  # R's block was free: the step did not wait for the copy
        stats = e.stats()
        assert stats["num_preemptions"] == 0 and r_tokens == r_reference[0]
        assert gate.is_set() and stats["kv_offload_loaded_blocks"] == 7  # finished when R needed its 6th block
        assert "inference_labs:kv_offload_prefetch_skipped_blocks 1.0\n" in e.prometheus_metrics()
        assert run(e, "a2", A + first + [77, 78, 79, 80, 81]) == reference[2]
    finally:
        gate.set()
        e.shutdown()


def test_torn_copy_is_recomputed_not_served(reference):
    def corrupt(e: LLMEngine) -> None:
        e.kv_offload.before_forward()  # B's saves end first (they run on the copy thread)
        copier = e.kv_offload.copier
        for slot in list(copier.checksums):
            copier.key[0][slot].add_(1.0)  # the CPU copy no longer matches its checksum

    e = engine()
    try:
        assert session(e, corrupt) == reference
        stats = e.stats()
        assert stats["kv_offload_loaded_blocks"] == 0 and stats["kv_offload_failed_loads"] == 5
    finally:
        e.shutdown()


def test_copy_that_never_signals_is_recomputed(reference, monkeypatch):
    def never_signalled(e: LLMEngine) -> None:
        e.kv_offload.copy_timeout_s = 0.05  # the wait is on the event; nothing will ever set it
        monkeypatch.setattr(e.kv_offload.copier, "submit", lambda transfer: transfer)

    e = engine()
    try:
        assert session(e, never_signalled) == reference
        stats = e.stats()
        assert stats["kv_offload_loaded_blocks"] == 0 and stats["kv_offload_failed_loads"] == 5
    finally:
        e.shutdown()


def test_hash_collision_is_a_miss(reference):
    def collide(e: LLMEngine) -> None:
        tier = e.kv_offload.tier
        for value, (slot, block_hash) in list(tier.entries.items()):
            tier.entries[value] = (slot, BlockHash(value, tuple(t + 1 for t in block_hash.token_ids)))

    e = engine()
    try:
        assert session(e, collide) == reference
        stats = e.stats()
        assert stats["kv_offload_loaded_blocks"] == 0 and stats["kv_offload_collisions"] == 1
        assert stats["prefix_cache_hits"] == 12  # the 3 blocks still on the device, as without offload
    finally:
        e.shutdown()


def test_block_chain_is_the_prefix_cache_chain():
    e = engine()
    try:
        request = e.add_request("x", {"prompt_token_ids": A})
        kvm = e.scheduler.kv_cache_manager
        assert kv_offload.block_chain(A, 7, 4, None) == kvm.block_hashes(request, 7)
    finally:
        e.shutdown()


@pytest.mark.parametrize("kw, match", [
    (dict(offload=1 << 20, enable_prefix_caching=False), "needs enable_prefix_caching"),
    (dict(offload=16), "at least one block"),
    (dict(offload=1 << 60), r"kv_offload_bytes must be an int in \[0, \d+\].*host's memory"),
    (dict(offload=-1), "kv_offload_bytes"),
])
def test_bad_settings_refused(kw, match):
    with pytest.raises(ValueError, match=match):
        engine(kw.pop("offload"), **kw)
