"""The one test harness of grader/labtests/ and tests/: engine names, a fake runner, one engine run.

Every engine import the official tests need is here (and engine paths as strings in
grader/seams.py), so moving an engine file is a handful of lines.

- `FakeRunner`: a model-free runner for scheduler tests whose "KV" depends on the whole prefix.
  Each KV slot holds (position, value) with value = mix(value of the previous position, token),
  read back from the slot the block table points at; the next token is a function of the last
  value. So a request's greedy output depends on its tokens only *if* the scheduler and the cache
  gave it the right blocks: a chunk starting at the wrong position, a block shared between
  different prefixes, a lost swap copy or a block overwritten while in use changes the tokens
  (or trips the "KV of position p missing" assertion). `reference_output` runs the same chain
  without any cache: what any correct schedule must produce. It has a GPU pool and a CPU pool
  and performs `swap_out` / `swap_in` copies. With draft tokens (speculative decoding) it writes their
  KV in the lookahead slots and verifies them greedily (`verify_greedy`); `fake_continuation` gives
  the fake model's true next tokens, what a perfect draft proposes (lab 10).
- `make_scheduler`, `make_request`, `step`, `run_to_completion`, `held_blocks`.
- `build_pool`, `build_manager`: a pool or a manager in a given state, written directly (no
  seam runs), so a unit test's set-up never depends on the learner's other functions and works
  in the grading kit, where the lab's seam bodies are removed.
- `run_engine`: one workload through the real engine (tiny-llama by default), tokens and stats.
- `lab_settings`: the hypothesis settings of every property-based lab test.
- `make_paged_batch`, `CountLaunches`, `shape_of`: the kernel labs' paged batches, launch counts and
  result shapes (labs 06, 07, 09).
- `Linear`, `Int8LinearMethod`, `RTNLinearMethod`, `gguf_path`: a quantized projection built directly and
  the real model's GGUF file (lab 13).
- `CountTorchCalls`: the torch calls a function makes, so a test can tell a vectorised answer from a
  Python loop over rows or splits by counting, not timing (labs 07, 09, 14), and by name (lab 14's host syncs).
"""
from __future__ import annotations

from collections import Counter, OrderedDict
from dataclasses import dataclass
from typing import Any, Sequence

import torch
from hypothesis import HealthCheck, Phase, settings
from torch.overrides import TorchFunctionMode

from engine_core import capacity_planner, memory
from engine_core.config import EngineConfig, KVCacheConfig, ResolvedConfig
from engine_core.core.block_pool import BlockHash, BlockPool, KVCacheBlock
from engine_core.core.cost_model import PreemptionCostModel
from engine_core.core.kv_cache_manager import KVCacheManager
from engine_core.core.request_queue import PriorityRequestQueue
from engine_core.core.scheduler import Scheduler
from engine_core.core.scheduler_output import BlockTables, ScheduledChunk, SchedulerOutput
from engine_core.engine import LLMEngine
from engine_core.entrypoints.llm import LLM
from engine_core.entrypoints.request_metrics import LatencyMetrics
from engine_core.entrypoints.router.policies import HashRing, ReplicaLoad
from engine_core.lora.presets import adapter_path
from engine_core.lora.request import LoRARequest
from engine_core.lora.slots import LoRASlotPool
from engine_core.memory import ModelSpec
from engine_core.capacity_planner import GPUS
from engine_core.models.linear import Linear
from engine_core.models.lora import LoRAMapping, LoRAStack
from engine_core.models.quantization import Int8LinearMethod, RTNLinearMethod
from engine_core.outputs import ModelRunnerOutput
from engine_core.presets import preset_path
from engine_core.presets_real import gguf_path
from engine_core.request import Request, RequestStatus, SamplingParams
from engine_core.worker.kv_cache import KVCache
from engine_core.worker.kv_scales import KVAmax, save_kv_amax
from engine_core.models.attention import AttentionMetadata, AttentionPlan, LayerKV  # lab 14
from engine_core.worker.input_batch import InputBatch  # lab 14
from engine_core.worker.sampler import Sampler  # lab 14
from engine_core.core.kv_offload import OffloadTier  # lab 16

__all__ = ["save_kv_amax", "GPUS", "LLM", "BlockHash", "BlockPool", "EngineConfig", "EngineRun", "FakeRunner", "KVAmax", "KVCache",
           "KVCacheBlock", "KVCacheManager", "LLMEngine", "build_manager", "build_pool", "check_invariants", "ModelSpec", "Request", "RequestStatus", "SamplingParams",
           "ScheduledChunk", "Scheduler", "SchedulerOutput", "TINY_SPEC", "held_blocks", "make_engine",
           # speculative decoding (lab 10)
           "fake_continuation", "verify_greedy",
           "make_request", "make_scheduler", "capacity_planner", "memory", "reference_output", "run_engine", "run_to_completion", "step",
           # multi-LoRA (lab 09)
           "LoRAMapping", "LoRARequest", "LoRASlotPool", "LoRAStack", "adapter_path", "preset_path",
           # property tests; the kernel labs (06, 07, 09)
           "lab_settings", "CountLaunches", "CountTorchCalls", "make_paged_batch", "shape_of",
           # serving (lab 12)
           "HashRing", "LatencyMetrics", "PriorityRequestQueue", "ReplicaLoad", "make_router",
           # weight quantization (lab 13)
           "Linear", "Int8LinearMethod", "RTNLinearMethod", "gguf_path",
           # the hot loop's pieces (lab 14)
           "AttentionMetadata", "AttentionPlan", "LayerKV", "InputBatch", "Sampler",
           # long-context KV (lab 16)
           "OffloadTier"]

# tiny-llama's shape: 2 layers x 2 KV heads x 16 dims, 512 bytes of fp32 KV per token
TINY_SPEC = ModelSpec(num_layers=2, hidden_size=64, num_attention_heads=4, num_kv_heads=2, head_dim=16,
                      intermediate_size=128, vocab_size=512)
VOCAB = 50  # the fake model's vocabulary: tokens 0..49
EOS = 0


# ---- the fake model ----------------------------------------------------------------------------

def mix(prev: int, token: int) -> int:
    """The fake KV of one position: a function of the previous position's KV and this token."""
    return (prev * 1_000_003 + token * 7_919 + 12_345) % 2_147_483_647


def reference_output(prompt: Sequence[int], max_tokens: int, eos: int | None = None,
                     max_model_len: int | None = None) -> list[int]:
    """The greedy output of `prompt` computed in one go, no cache: stops at max_tokens, at `eos`
    (when given) or when prompt + output reach max_model_len (when given)."""
    kv, out = -1, []
    for t in prompt:
        kv = mix(kv, t)
    while True:
        out.append(kv % VOCAB)
        if out[-1] == eos or len(out) >= max_tokens or (max_model_len and len(prompt) + len(out) >= max_model_len):
            return out
        kv = mix(kv, out[-1])


def verify_greedy(drafts: Sequence[int], greedy: Sequence[int]) -> list[int]:
    """Greedy verification by hand: the drafts while each equals the model's token at its place
    (`greedy[j]` follows draft j - 1), then the model's own token (a correction, or the bonus token)."""
    emitted = []
    for d, g in zip(drafts, greedy):
        emitted.append(g)
        if d != g:
            return emitted
    return emitted + [greedy[len(drafts)]]


def fake_continuation(token_ids: Sequence[int], n: int) -> list[int]:
    """The fake model's next `n` greedy tokens after `token_ids` (what a perfect draft proposes)."""
    kv = -1
    for t in token_ids:
        kv = mix(kv, t)
    out = []
    for _ in range(n):
        out.append(kv % VOCAB)
        kv = mix(kv, out[-1])
    return out


Slot = tuple[int, int] | None  # (position, KV value) written there, or nothing yet


class FakeRunner:
    """Executes a SchedulerOutput against a fake paged KV cache: swap copies first, then the chunks. A
    chunk with draft tokens (speculative decoding) writes their KV in its lookahead slots too and emits
    what greedy verification of them against the fake model gives (`verify_greedy`)."""

    def __init__(self, num_gpu_blocks: int, block_size: int, num_cpu_blocks: int = 0) -> None:
        self.bs = block_size
        self.gpu: list[list[Slot]] = [[None] * block_size for _ in range(num_gpu_blocks)]
        self.cpu: list[list[Slot]] = [[None] * block_size for _ in range(num_cpu_blocks)]
        self.tables = BlockTables()  # each request's block table, rebuilt from the scheduler's handover

    @classmethod
    def for_scheduler(cls, sched: Scheduler) -> "FakeRunner":
        kvm = sched.kv_cache_manager
        return cls(kvm.num_gpu_blocks, sched.block_size, kvm.num_cpu_blocks)

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        self.tables.apply(out)
        for g, c in out.swap_out:
            self.cpu[c] = list(self.gpu[g])
        for c, g in out.swap_in:
            self.gpu[g] = list(self.cpu[c])
        sampled = {}
        for chunk in out.scheduled:
            rid, table = chunk.request.request_id, self.tables.update(chunk)
            drafts = out.scheduled_spec_decode_tokens.get(rid, [])
            end = chunk.start + chunk.num_tokens + len(drafts)
            assert len(table) * self.bs >= end, f"request {rid}: block table {table} is too short for {end} tokens"
            kv = -1 if chunk.start == 0 else self.read(table, chunk.start - 1, rid)
            greedy = []  # the model's next token after the chunk's last token and after each draft
            for pos, tok in enumerate(chunk.token_ids + list(drafts), start=chunk.start):
                kv = mix(kv, tok)
                self.gpu[table[pos // self.bs]][pos % self.bs] = (pos, kv)
                if pos >= chunk.start + chunk.num_tokens - 1:
                    greedy.append(kv % VOCAB)
            if chunk.emits:
                sampled[rid] = verify_greedy(drafts, greedy)
        return ModelRunnerOutput(sampled)

    def read(self, table: list[int], pos: int, rid: str) -> int:
        slot = self.gpu[table[pos // self.bs]][pos % self.bs]
        assert slot is not None and slot[0] == pos, (
            f"request {rid}: the KV of position {pos} is missing from block {table[pos // self.bs]} "
            f"(the slot holds {slot}): the block was never written or was overwritten")
        return slot[1]


# ---- pools and managers in a given state --------------------------------------------------------

def build_pool(num_blocks: int, held: dict[int, int] | None = None, free_order: Sequence[int] | None = None,
               cached: dict[int, tuple[int, ...]] | None = None, pool: BlockPool | None = None) -> BlockPool:
    """A pool (new, or `pool` reset) whose blocks `held` {id: ref_cnt} are in use and the others free in
    `free_order` (default: by id); `cached` {id: tokens} are in the prefix cache under
    BlockHash(1000 + id, tokens)."""
    held, cached = held or {}, cached or {}
    pool = pool or BlockPool(num_blocks)
    for block in pool.blocks:
        block.ref_cnt = held.get(block.block_id, 0)
    free = [i for i in range(num_blocks) if i not in held] if free_order is None else list(free_order)
    pool.free_queue = OrderedDict((i, pool.blocks[i]) for i in free)
    pool.cache_full_blocks([pool.blocks[i] for i in cached], [BlockHash(1000 + i, t) for i, t in cached.items()])
    return pool


def build_manager(num_gpu_blocks: int, tables: dict[str, list[int]] | None = None, *, block_size: int = 4,
                  free_order: Sequence[int] | None = None, cached: dict[int, tuple[int, ...]] | None = None,
                  caching: bool = False, num_cpu_blocks: int = 0, cpu_tables: dict[str, list[int]] | None = None,
                  kvm: KVCacheManager | None = None) -> KVCacheManager:
    """A manager (new, or `kvm` set) whose requests hold GPU `tables` and CPU `cpu_tables`
    {request id: block ids}; a block's ref_cnt is the number of tables holding it; the free GPU
    blocks are in `free_order` (default: by id), the free CPU blocks by id."""
    tables, cpu_tables = tables or {}, cpu_tables or {}
    kvm = kvm or KVCacheManager(num_gpu_blocks, block_size, enable_caching=caching, num_cpu_blocks=num_cpu_blocks)
    for pool, owned, order in ((kvm.block_pool, tables, free_order), (kvm.cpu_block_pool, cpu_tables, None)):
        counts: dict[int, int] = {}
        for ids in owned.values():
            for i in ids:
                counts[i] = counts.get(i, 0) + 1
        build_pool(pool.num_blocks, counts, order, cached if pool is kvm.block_pool else None, pool=pool)
    kvm.req_to_blocks = {rid: [kvm.block_pool.blocks[i] for i in ids] for rid, ids in tables.items()}
    kvm.req_to_cpu_blocks = {rid: [kvm.cpu_block_pool.blocks[i] for i in ids] for rid, ids in cpu_tables.items()}
    return kvm


# ---- schedulers and requests -------------------------------------------------------------------

def make_config(**config: Any) -> EngineConfig:
    """An EngineConfig for a model-free scheduler: blocks of 4, budget 16, max_model_len 256, CPU,
    preemption by recompute, unless given."""
    return EngineConfig(**{"block_size": 4, "max_model_len": 256, "max_num_batched_tokens": 16, "device": "cpu",
                           "preemption_mode": "recompute", **config})


def make_scheduler(num_gpu_blocks: int, num_cpu_blocks: int = 0, spec: ModelSpec = TINY_SPEC,
                   kv_dtype: str = "fp32", **config: Any) -> Scheduler:
    """A Scheduler with no model behind it (see `make_config` for the defaults); the preemption
    cost model is the CPU's, for `spec` in `kv_dtype`."""
    cfg = make_config(**config)
    cost_model = PreemptionCostModel.for_device(spec, kv_dtype, "cpu", cfg.prefill_flops_per_s,
                                                cfg.swap_bandwidth_bytes_per_s)
    return Scheduler(ResolvedConfig.model_free(cfg), KVCacheConfig(num_gpu_blocks, num_cpu_blocks, 0), cost_model)


def make_request(rid: str, prompt: Sequence[int] | int, max_tokens: int = 4, priority: int = 0,
                 arrival: float | None = None, eos: int | None = None, lora_id: int | None = None) -> Request:
    """A greedy request; an int prompt means tokens 1..n; `eos` stops it when sampled."""
    tokens = list(range(1, prompt + 1)) if isinstance(prompt, int) else list(prompt)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    return Request(rid, tokens, params, eos_token_id=eos, arrival_time=arrival, priority=priority, lora_id=lora_id)


def step(sched: Scheduler, runner: FakeRunner) -> SchedulerOutput:
    """One schedule + execute + update; returns what was scheduled."""
    out = sched.schedule()
    sched.update_from_output(out, runner.execute(out))
    return out


def run_to_completion(sched: Scheduler, runner: FakeRunner | None = None, max_steps: int = 10_000,
                      outputs: dict[str, list[int]] | None = None) -> dict[str, list[int]]:
    """Steps until every request finished (pass the runner that ran earlier steps: it holds their KV);
    the output tokens by request id."""
    runner = runner or FakeRunner.for_scheduler(sched)
    outputs = {} if outputs is None else outputs
    for _ in range(max_steps):
        if not sched.has_unfinished_requests():
            return outputs
        out = sched.schedule()
        for req in sched.update_from_output(out, runner.execute(out)):
            outputs[req.request_id] = list(req.output_token_ids)
    raise AssertionError(f"not finished after {max_steps} steps: {sched.stats()}")


def held_blocks(kvm: KVCacheManager) -> list[tuple[str, int, int]]:
    """(pool, block id, ref_cnt) of every GPU and CPU block someone still holds."""
    return [(name, b.block_id, b.ref_cnt) for name, pool in (("GPU", kvm.block_pool), ("CPU", kvm.cpu_block_pool))
            for b in pool.blocks if b.ref_cnt]


def assert_no_leaked_blocks(sched: Scheduler, what: str) -> None:
    kvm = sched.kv_cache_manager
    tables = {rid: [b.block_id for b in blocks] for rid, blocks in kvm.req_to_blocks.items() if blocks}
    held = held_blocks(kvm)
    assert not held and not tables, (f"{what}: every request finished, yet these (pool, block, ref_cnt) are held: "
                                     f"{held} (block tables still held: {tables})")


# ---- the real engine ---------------------------------------------------------------------------

def make_router(urls: Sequence[str], policy: str = "prefix_aware", balance_factor: float = 1.25) -> Any:
    """The real router's state (engine_core.entrypoints.router.app.Router; its FastAPI app is not
    started): `choose(body)` picks a replica; set `replicas[i].in_flight` to model requests in flight.
    Imported here, not at the top, so labs without a router do not load FastAPI."""
    from engine_core.entrypoints.router.app import Router

    return Router(list(urls), policy=policy, balance_factor=balance_factor)


def make_engine(model: str = "tiny-llama", **engine_args: Any) -> LLMEngine:
    """An engine on CPU unless `device` is given."""
    return LLMEngine.from_kwargs(model, **{"device": "cpu", **engine_args})


Wave = Sequence[tuple[str, Sequence[int], int]]  # (request id, prompt token ids, max_tokens)


@dataclass
class EngineRun:
    """What one workload did: tokens and prompt tokens served from the cache by request, stats, the engine."""

    tokens: dict[str, list[int]]
    cached: dict[str, int]
    stats: dict[str, float]
    engine: LLMEngine

    @property
    def held(self) -> list[tuple[str, int, int]]:
        """(pool, block id, ref_cnt) of blocks still held after the run (none when nothing leaked)."""
        return held_blocks(self.engine.scheduler.kv_cache_manager)


def run_engine(waves: Sequence[Wave], *, model: str = "tiny-llama", steps_per_wave: int | None = None,
               max_steps: int = 2000, num_sms: int | None = None, **engine_args: Any) -> EngineRun:
    """Runs greedy requests (ignore_eos) through the engine: each wave is added (arrival times 0, 1, 2 ...
    in order), then `steps_per_wave` steps run (None: until every request finished) before the next
    wave; at the end, every request runs to completion. `num_sms`: the SM count the model runner
    believes it has (on CPU it is 0 and flash-decoding never splits; > 0 makes the runner ask the split
    policy every step, as on a GPU)."""
    engine = make_engine(model, **engine_args)
    if num_sms is not None:
        engine.runner.num_sms = num_sms
    tokens: dict[str, list[int]] = {}
    cached: dict[str, int] = {}
    steps, arrival = 0, 0

    def one_step() -> None:
        nonlocal steps
        if steps >= max_steps:
            raise AssertionError(f"the engine made no progress: unfinished after {max_steps} steps ({engine.stats()})")
        steps += 1
        for out in engine.step():
            if out.finished:
                tokens[out.request_id] = list(out.outputs[0].token_ids)
                cached[out.request_id] = out.num_cached_tokens

    for wave in waves:
        for rid, prompt, max_tokens in wave:
            engine.add_request(rid, list(prompt), SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                                                 ignore_eos=True), arrival_time=float(arrival))
            arrival += 1
        for _ in range(steps_per_wave if steps_per_wave is not None else max_steps):
            if not engine.has_unfinished_requests():
                break
            one_step()
    while engine.has_unfinished_requests():
        one_step()
    return EngineRun(tokens, cached, engine.stats(), engine)


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
            if b.block_id < 0:  # NULL_BLOCK: a slot freed by a sliding window or an eviction
                continue
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


def lab_settings(max_examples: int) -> settings:
    """Hypothesis settings for a lab test (use with `@seed(N)`, so the reference run and the kit see the
    same examples): no example database, no deadline (a loaded machine), fixtures per test allowed, and
    no explain phase, which replays variations of a failing example to annotate the report: 8 s for one
    failing stub test in lab 09, and a learner's message does not need it (the shrunk example is kept)."""
    return settings(max_examples=max_examples, deadline=None, database=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
                    phases=(Phase.explicit, Phase.reuse, Phase.generate, Phase.shrink))


UNUSED_V = 1e4  # V in cache rows no sequence owns (their K is 0, a score of 0): reading one wrecks the output
FP8 = torch.float8_e4m3fn


@dataclass
class PagedKV:
    """A paged KV cache with its block tables, as the kernels take them."""

    key_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor
    block_tables: torch.Tensor  # int32 [num_seqs, max_blocks + 1], padded with 0 as the engine pads
    seq_lens: torch.Tensor  # int32 [num_seqs]
    k_scale: float | torch.Tensor = 1.0  # a float, or one per KV head ([num_kv_heads], on the cache's device)
    v_scale: float | torch.Tensor = 1.0


def make_paged_kv(gen: torch.Generator, seq_lens: list[int], num_kv_heads: int, head_dim: int, block_size: int,
                  dtype: torch.dtype, device: torch.device | str, fp8: bool = False, fp8_dtype: torch.dtype = FP8,
                  per_head_scales: bool = False) -> PagedKV:
    """The one paged-batch builder of the kernel tests and labs. Physical blocks are handed out shuffled
    (reading block `t // block_size` without the table reads another sequence's K/V), rows no sequence owns
    hold K = 0 and V = UNUSED_V (any weight on one shows), and the table has a spare column padded with 0
    as the engine pads it. fp8: codes of `fp8_dtype` written with torch's own cast; `per_head_scales`: KV
    head h's values are 4^h times larger and its scales too, so a kernel that reads the wrong head's scale
    is off by 4x or more."""
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + 2
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    key = torch.randn(shape, generator=gen, dtype=torch.float64)
    value = torch.randn(shape, generator=gen, dtype=torch.float64)
    owned = torch.zeros(num_blocks * block_size, dtype=torch.bool)
    tables = torch.zeros(len(seq_lens), max(blocks_per_seq + [0]) + 1, dtype=torch.int32)
    perm = torch.randperm(num_blocks, generator=gen)
    taken = 0
    for i, (n, nb) in enumerate(zip(seq_lens, blocks_per_seq)):
        tables[i, :nb] = perm[taken:taken + nb].to(torch.int32)
        taken += nb
        slots = tables[i, :nb].long()[:, None] * block_size + torch.arange(block_size)
        owned[slots.flatten()[:n]] = True
    key.view(-1, num_kv_heads, head_dim)[~owned] = 0.0
    value.view(-1, num_kv_heads, head_dim)[~owned] = UNUSED_V
    k_scale: float | torch.Tensor = 1.0
    v_scale: float | torch.Tensor = 1.0
    if fp8:
        k_scale, v_scale = 0.05, 0.03  # e4m3 codes up to 448: randn / scale stays well inside
        if per_head_scales:
            head_gain = 4.0 ** torch.arange(num_kv_heads, dtype=torch.float64)[:, None]  # [H_kv, 1]
            key, value = key * head_gain, value * head_gain
            k_scale, v_scale = k_scale * head_gain[:, 0].float(), v_scale * head_gain[:, 0].float()
        limit = torch.finfo(fp8_dtype).max
        key = (key / _per_head(k_scale)).clamp(-limit, limit)
        value = (value / _per_head(v_scale)).clamp(-limit, limit)
        dtype = fp8_dtype
        if per_head_scales:
            k_scale, v_scale = k_scale.to(device), v_scale.to(device)
    return PagedKV(key.to(dtype).to(device), value.to(dtype).to(device), tables.to(device),
                   torch.tensor(seq_lens, dtype=torch.int32, device=device), k_scale, v_scale)


def _per_head(scale: float | torch.Tensor) -> float | torch.Tensor:
    """A per-head scale `[H_kv]` as `[H_kv, 1]` (float64), to broadcast over `[..., H_kv, D]`."""
    return scale.double().cpu()[:, None] if isinstance(scale, torch.Tensor) else scale


def make_paged_batch(seq_lens: list[int], num_heads: int, num_kv_heads: int, head_dim: int, block_size: int,
                     dtype: torch.dtype = torch.float32, seed: int = 0) -> dict:
    """Query and caches for `seq_lens` (make_paged_kv), as `paged_attention_decode`'s keyword arguments, on the
    GPU when there is one (the kernel labs' tests run there compiled, and under the Triton interpreter
    otherwise)."""
    gen = torch.Generator().manual_seed(seed)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    kv = make_paged_kv(gen, seq_lens, num_kv_heads, head_dim, block_size, dtype, device)
    query = torch.randn(len(seq_lens), num_heads, head_dim, generator=gen, dtype=torch.float64)
    return dict(query=query.to(dtype).to(device), key_cache=kv.key_cache, value_cache=kv.value_cache,
                block_tables=kv.block_tables, seq_lens=kv.seq_lens)


class CountLaunches:
    """Stands in for the learner's kernel inside their launcher: counts `kernel[grid](...)` launches."""

    def __init__(self, kernel: Any) -> None:
        self.kernel, self.launches = kernel, 0

    def __getitem__(self, grid: Any) -> Any:
        self.launches += 1
        return self.kernel[grid]

    def __getattr__(self, name: str) -> Any:
        return getattr(self.kernel, name)


HOST_SYNCS = ("item", "tolist", "__int__", "__float__", "__bool__", "__index__")  # a tensor read back to Python


class CountTorchCalls(TorchFunctionMode):
    """`with CountTorchCalls() as counted:` counts the torch functions, tensor methods, operators and
    indexing called inside (`counted.calls`; the calls those make in turn are not counted). A vectorised
    function makes as many calls for 64 rows as for 2; a Python loop over them makes more. `counted.names`
    counts them by name (`cat`, `clone`), `counted.host_syncs` the tensors read back to Python."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0
        self.names: Counter = Counter()

    @property
    def host_syncs(self) -> int:
        """Tensors read back to Python (`.item()`, `.tolist()`, `int(t)`, `bool(t)`...): each a device sync."""
        return sum(self.names[name] for name in HOST_SYNCS)

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        self.calls += 1
        self.names[getattr(func, "__name__", repr(func))] += 1
        return func(*args, **(kwargs or {}))


def shape_of(out: Any) -> list:
    """What came back, as plain data: [type name, shape, dtype] for a tensor, else [type name]."""
    if isinstance(out, torch.Tensor):
        return ["Tensor", list(out.shape), str(out.dtype).removeprefix("torch.")]
    return [type(out).__name__]
