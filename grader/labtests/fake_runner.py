"""A model-free runner for the scheduler labs (04, 05): KV that depends on the whole prefix.

Each KV slot holds (position, value) with value = mix(value of the previous position, token),
read back from the slot the block table points at, and the next token is a function of the
last value. So a request's greedy output depends on its tokens only *if* the scheduler and
the cache gave it the right blocks: a chunk starting at the wrong position, a block shared
between different prefixes, or a block overwritten while still in use changes the tokens
(or trips the "KV of position p missing" assertion). `reference_output` runs the same chain
with no cache at all: what any correct schedule must produce.
"""
from __future__ import annotations

from engine_core.config import EngineConfig, KVCacheConfig, ResolvedConfig
from engine_core.core.cost_model import PreemptionCostModel
from engine_core.memory import ModelSpec
from engine_core.request import Request, SamplingParams
from engine_core.core.scheduler import Scheduler
from engine_core.core.scheduler_output import BlockTables, SchedulerOutput

TINY_SPEC = ModelSpec(num_layers=2, hidden_size=64, num_attention_heads=4, num_kv_heads=2, head_dim=16,
                      intermediate_size=128, vocab_size=512)
VOCAB = 50


def mix(prev: int, token: int) -> int:
    """The fake KV of one position: a function of the previous position's KV and this token."""
    return (prev * 1_000_003 + token * 7_919 + 12_345) % 2_147_483_647


def reference_output(prompt: list[int], max_tokens: int) -> list[int]:
    """The greedy output of `prompt` computed in one go, no cache (no EOS: runs max_tokens)."""
    kv, out = -1, []
    for t in prompt:
        kv = mix(kv, t)
    while len(out) < max_tokens:
        out.append(kv % VOCAB)
        kv = mix(kv, out[-1])
    return out


class FakeRunner:
    """Executes a SchedulerOutput against a fake paged KV cache of `num_blocks` blocks."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.bs = block_size
        self.slots: list[list[tuple[int, int] | None]] = [[None] * block_size for _ in range(num_blocks)]
        self.tables = BlockTables()

    def execute(self, out: SchedulerOutput) -> dict[str, int]:
        sampled = {}
        self.tables.forget(out.preempted_request_ids)
        for chunk in out.scheduled:
            rid, table = chunk.request.request_id, self.tables.update(chunk)
            end = chunk.start + chunk.num_tokens
            assert len(table) * self.bs >= end, f"request {rid}: block table {table} is too short for {end} tokens"
            kv = -1 if chunk.start == 0 else self.read(table, chunk.start - 1, rid)
            for pos, tok in enumerate(chunk.token_ids, start=chunk.start):
                kv = mix(kv, tok)
                self.slots[table[pos // self.bs]][pos % self.bs] = (pos, kv)
            if chunk.emits:
                sampled[rid] = kv % VOCAB
        return sampled

    def read(self, table: list[int], pos: int, rid: str) -> int:
        slot = self.slots[table[pos // self.bs]][pos % self.bs]
        assert slot is not None and slot[0] == pos, (
            f"request {rid}: the KV of position {pos} is missing from block {table[pos // self.bs]} "
            f"(the slot holds {slot}): the block was never written or was overwritten")
        return slot[1]


def make_scheduler(num_gpu_blocks: int, **kw) -> Scheduler:
    """A Scheduler with no model behind it (block_size 4, budget 16, max_model_len 256 unless given)."""
    kw = {"block_size": 4, "max_model_len": 256, "max_num_batched_tokens": 16, "device": "cpu",
          "preemption_mode": "recompute", **kw}
    cost_model = PreemptionCostModel.for_device(TINY_SPEC, "fp32", "cpu")
    return Scheduler(ResolvedConfig.model_free(EngineConfig(**kw)), KVCacheConfig(num_gpu_blocks, 0, 0), cost_model)


def make_request(rid: str, prompt: list[int] | int, max_tokens: int = 4, arrival: float | None = None,
                 lora_id: int | None = None, priority: int = 0) -> Request:
    """A greedy request; an int prompt means tokens 1..n."""
    tokens = list(range(1, prompt + 1)) if isinstance(prompt, int) else list(prompt)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return Request(rid, tokens, params, arrival_time=arrival, lora_id=lora_id, priority=priority)


def step(sched: Scheduler, runner: FakeRunner) -> SchedulerOutput:
    """One schedule + execute + update; returns what was scheduled."""
    out = sched.schedule()
    sched.update_from_output(out, runner.execute(out))
    return out


def assert_no_leaked_blocks(sched: Scheduler, what: str) -> None:
    kvm = sched.kv_cache_manager
    held = {rid: [b.block_id for b in blocks] for rid, blocks in kvm.req_to_blocks.items() if blocks}
    assert not held and kvm.num_free_blocks == kvm.num_gpu_blocks, (
        f"{what}: every request finished, yet {kvm.num_gpu_blocks - kvm.num_free_blocks} of "
        f"{kvm.num_gpu_blocks} blocks are not free (block tables still held: {held})")
