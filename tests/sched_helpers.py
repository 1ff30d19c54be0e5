"""Scheduler test kit: a fake model runner whose "KV" depends on the whole prefix, like a transformer's.

`FakeRunner` keeps one value per KV slot: kv[pos] = H(kv[pos - 1], token[pos]), read from the
slot the block table points at. The next token is a function of the last kv value. So a
request's greedy output is a pure function of its tokens *if and only if* the scheduler gave
it the right blocks: a lost swap copy, a block shared between different prefixes, a chunk
that starts at the wrong position or an overwritten block all change the tokens (or trip an
assertion on an empty slot). `reference_output` computes the same chain without any cache.
"""
from __future__ import annotations

from collections import Counter

from engine_core.config import EngineConfig, KVCacheConfig, ResolvedConfig
from engine_core.core.cost_model import PreemptionCostModel
from engine_core.memory import ModelSpec
from engine_core.request import Request, RequestStatus, SamplingParams
from engine_core.core.scheduler import Scheduler
from engine_core.core.scheduler_output import BlockTables, SchedulerOutput

TINY_SPEC = ModelSpec(num_layers=2, hidden_size=64, num_attention_heads=4, num_kv_heads=2, head_dim=16,
                      intermediate_size=128, vocab_size=512)
VOCAB = 50
EOS = 0


def kv_value(prev: int, token: int) -> int:
    """The fake KV of a position: depends on the previous position's KV and this token."""
    return hash((prev, token)) & 0xFFFFFFFF


def next_token(kv: int) -> int:
    return kv % VOCAB


def reference_output(prompt: list[int], max_tokens: int, eos: int | None = EOS, max_model_len: int = 10**9) -> list[int]:
    """What any correct schedule must produce for this request (greedy, no cache involved)."""
    kv, out = -1, []
    tokens = list(prompt)
    for t in tokens:
        kv = kv_value(kv, t)
    while True:
        tok = next_token(kv)
        out.append(tok)
        tokens.append(tok)
        if tok == eos or len(out) >= max_tokens or len(tokens) >= max_model_len:
            return out
        kv = kv_value(kv, tok)


class FakeRunner:
    """Executes a SchedulerOutput against a fake paged KV cache (GPU and CPU pools)."""

    def __init__(self, num_gpu_blocks: int, num_cpu_blocks: int, block_size: int) -> None:
        self.bs = block_size
        self.gpu: list[list[tuple[int, int] | None]] = [[None] * block_size for _ in range(num_gpu_blocks)]
        self.cpu: list[list[tuple[int, int] | None]] = [[None] * block_size for _ in range(num_cpu_blocks)]
        self.tables = BlockTables()

    def execute(self, out: SchedulerOutput) -> dict[str, int]:
        self.tables.forget(out.preempted_request_ids)
        for g, c in out.swap_out:  # swap_out copies first, then swap_in, then the forward
            self.cpu[c] = list(self.gpu[g])
        for c, g in out.swap_in:
            self.gpu[g] = list(self.cpu[c])
        sampled = {}
        for chunk in out.scheduled:
            table, tokens = self.tables.update(chunk), chunk.token_ids
            assert len(table) * self.bs >= chunk.start + chunk.num_tokens, (
                f"{chunk.request.request_id}: table {table} too short for {chunk.start + chunk.num_tokens} tokens")
            kv = -1 if chunk.start == 0 else self._read(table, chunk.start - 1, chunk.request.request_id)
            for k, tok in enumerate(tokens):
                pos = chunk.start + k
                kv = kv_value(kv, tok)
                self.gpu[table[pos // self.bs]][pos % self.bs] = (pos, kv)
            if chunk.emits:
                sampled[chunk.request.request_id] = next_token(kv)
        return sampled

    def _read(self, table: list[int], pos: int, rid: str) -> int:
        slot = self.gpu[table[pos // self.bs]][pos % self.bs]
        assert slot is not None and slot[0] == pos, f"{rid}: KV of position {pos} missing (slot holds {slot})"
        return slot[1]


def make_config(**kw) -> EngineConfig:
    kw.setdefault("block_size", 4)
    kw.setdefault("max_model_len", 256)
    kw.setdefault("max_num_batched_tokens", 64)
    kw.setdefault("device", "cpu")
    return EngineConfig(**kw)


def make_scheduler(num_gpu_blocks: int, num_cpu_blocks: int = 0, **kw) -> Scheduler:
    config = make_config(**kw)
    cost_model = PreemptionCostModel.for_device(TINY_SPEC, "fp32", "cpu", config.prefill_flops_per_s,
                                                config.swap_bandwidth_bytes_per_s)
    return Scheduler(ResolvedConfig.model_free(config), KVCacheConfig(num_gpu_blocks, num_cpu_blocks, 0), cost_model)


def make_request(rid: str, prompt: list[int] | int, max_tokens: int = 4, priority: int = 0,
                 arrival: float | None = None, eos: int | None = None, lora_id: int | None = None) -> Request:
    tokens = list(range(1, prompt + 1)) if isinstance(prompt, int) else list(prompt)
    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    return Request(rid, tokens, sp, eos_token_id=eos, arrival_time=arrival, priority=priority, lora_id=lora_id)


def run_to_completion(sched: Scheduler, runner: FakeRunner | None = None,
                      max_steps: int = 10_000) -> dict[str, list[int]]:
    """Step the scheduler with a FakeRunner (pass the one that ran earlier steps: it holds their
    KV) until every request finishes; outputs by request id."""
    kvm = sched.kv_cache_manager
    runner = runner or FakeRunner(kvm.num_gpu_blocks, kvm.num_cpu_blocks, sched.block_size)
    outputs: dict[str, list[int]] = {}
    for _ in range(max_steps):
        if not sched.has_unfinished_requests():
            return outputs
        out = sched.schedule()
        for req in sched.update_from_output(out, runner.execute(out)):
            outputs[req.request_id] = list(req.output_token_ids)
    raise AssertionError(f"not finished after {max_steps} steps: {sched.stats()}")


def check_invariants(sched: Scheduler) -> None:
    """The scheduler's state between steps, whole: a GPU block's ref count equals the number of
    block tables holding it, and it sits in the free queue exactly when that is 0; a block in two
    tables is a cached full block at the same position of two requests with the same token prefix
    (and LoRA); the prefix-cache map points at blocks carrying that hash; CPU blocks belong to
    swapped requests only, once each; each request sits in the one queue its status names; a
    running request has tokens left to compute; at most max_num_seqs run."""
    kvm = sched.kv_cache_manager
    holders: Counter = Counter()
    where: dict = {}
    for rid, table in kvm.req_to_blocks.items():
        for i, b in enumerate(table):
            holders[b.block_id] += 1
            where.setdefault(b.block_id, []).append((rid, i))
    for b in kvm.block_pool.blocks:
        assert b.ref_cnt == holders[b.block_id], f"{b}: held by {where.get(b.block_id)}"
        assert (b.ref_cnt == 0) == (b.block_id in kvm.block_pool.free_queue), b
    bs = kvm.block_size
    for block_id, places in where.items():
        if len(places) > 1:
            block = kvm.block_pool.blocks[block_id]
            assert block.block_hash is not None, f"block {block_id} shared without a hash: {places}"
            (r0, i0), rest = places[0], places[1:]
            prefix0 = sched.requests[r0].all_token_ids[:(i0 + 1) * bs]
            for r, i in rest:
                assert i == i0 and sched.requests[r].all_token_ids[:(i + 1) * bs] == prefix0
                assert sched.requests[r].lora_id == sched.requests[r0].lora_id
            assert block.block_hash.token_ids == tuple(prefix0[-bs:])
    for h, b in kvm.block_pool.cached_blocks.items():
        assert b.block_hash == h
    cpu_holders = Counter(b.block_id for t in kvm.req_to_cpu_blocks.values() for b in t)
    for b in kvm.cpu_block_pool.blocks:
        assert b.ref_cnt == cpu_holders[b.block_id] <= 1
        assert (b.ref_cnt == 0) == (b.block_id in kvm.cpu_block_pool.free_queue), b
    assert {r.status for r in sched.running} <= {RequestStatus.RUNNING}
    assert {r.status for r in sched.swapped} <= {RequestStatus.SWAPPED}
    assert {r.status for r in sched.waiting} <= {RequestStatus.WAITING, RequestStatus.PREEMPTED}
    queued = [r.request_id for q in (sched.running, sched.waiting, sched.swapped) for r in q]
    assert sorted(queued) == sorted(sched.requests), f"queued {sorted(queued)}, known {sorted(sched.requests)}"
    assert all(sched.requests[r.request_id] is r for r in [*sched.running, *sched.waiting, *sched.swapped])
    assert set(kvm.req_to_cpu_blocks) <= {r.request_id for r in sched.swapped}
    assert set(kvm.req_to_blocks) <= {r.request_id for r in sched.running}
    assert all(r.num_computed_tokens < r.num_tokens for r in sched.running), sched.running
    assert len(sched.running) <= sched.max_num_seqs
