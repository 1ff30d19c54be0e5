"""The model runner: owns the model, the KV cache tensors, the sampler and the CUDA graphs, and turns each
SchedulerOutput into one flat varlen forward.

Built in vLLM's order: weights (`__init__`), the KV cache size from the memory budget
(`determine_kv_cache_config`), then the cache and CUDA graphs (`initialize_kv_cache`). Per step
(`execute_model`, the step's one message) it forgets the requests the message names, copies swapped blocks,
applies new block ids (`InputBatch`), builds the batch tensors, runs the model and samples only the rows that
emit (every row of a speculating request). In a worker of a parallel engine it holds one rank's shard and
samples only where the model returns logits; a forward that raises there ends the step (no per-request
retry: the ranks must meet in the same collectives). The step in full: docs/architecture.md.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

import kernels
from engine_core import memory
from engine_core.config import KVCacheConfig, ResolvedConfig
from engine_core.core.kv_cache_manager import cdiv
from engine_core.core.scheduler_output import ScheduledChunk, SchedulerOutput
from engine_core.distributed.parallel_state import ParallelContext
from engine_core.lora.adapter import LoRAAdapter
from engine_core.lora.manager import LoRAManager
from engine_core.lora.request import LoRARequest
from engine_core.models.attention import AttentionMetadata
from engine_core.models.config import ModelConfig, check_draft_model
from engine_core.models.llama import LlamaForCausalLM, load_model
from engine_core.outputs import ModelRunnerOutput
from engine_core.request import Request, SamplingParams
from engine_core.worker.cuda_graphs import DecodeGraphs
from engine_core.worker.draft_model import DraftModel
from engine_core.worker.input_batch import InputBatch
from engine_core.worker.kv_cache import KVCache
from engine_core.worker.kv_scales import DynamicScales, static_kv_amax
from engine_core.worker.rejection_sampler import RejectionSampler
from engine_core.worker.sampler import INVALID_TOKEN, Sampler
from kernels import split_policy

DEFAULT_CPU_KV_BYTES = 2**30


@dataclass
class ModelInput:
    input_ids: torch.Tensor  # [num_tokens]
    positions: torch.Tensor  # [num_tokens]
    attn_metadata: AttentionMetadata  # .output_rows: the rows whose hidden state gives a new token
    emitting: list[Request]  # the requests of those rows, in row order
    # with draft tokens: the rows of the forward's output to take logits of (output_rows is then None, as
    # a speculating request needs every row); each emitting request has 1 + len(drafts[i]) of them
    logits_indices: torch.Tensor | None = None
    drafts: list[list[int]] | None = None  # per emitting request


def weight_bytes(runner: "ModelRunner") -> tuple[int, dict[str, int]]:
    """The runner's model weight bytes as stored, and the same by scheme or dtype
    (`LlamaForCausalLM.weight_bytes_by_scheme`); for `collective_rpc`: a module-level function."""
    return runner.weight_bytes, runner.model.weight_bytes_by_scheme()


def check_lora(runner: "ModelRunner", lora_request: LoRARequest) -> LoRAAdapter:
    """The adapter, read and checked against the runner's model; changes nothing (`LoRAManager.check`)."""
    if runner.lora is None:
        raise ValueError(f"lora_request {lora_request.lora_name!r} given, but the engine was built with "
                         f"enable_lora=False; pass enable_lora=True (with max_loras, max_lora_rank) to serve "
                         f"adapters")
    return runner.lora.check(lora_request)


def add_lora(runner: "ModelRunner", lora_request: LoRARequest, adapter: LoRAAdapter | None = None) -> None:
    """Keep an adapter (checked here unless `adapter` is the checked one): its id names its folder from now on."""
    adapter = check_lora(runner, lora_request) if adapter is None else adapter
    runner.lora.remember(lora_request, adapter)


class ModelRunner:
    def __init__(self, config: ResolvedConfig, model_config: ModelConfig,
                 parallel: ParallelContext | None = None) -> None:
        self.config = config
        self.parallel = parallel  # None: one process holds the whole model
        self.model_config = model_config
        self.device = config.device
        self.block_size = config.engine.block_size
        engine, args = config.engine, model_config.args
        # fp8 scales from a file or the checkpoint, checked against the model before the weights load
        self.kv_amax = static_kv_amax(engine.kv_cache_dtype, engine.calculate_kv_scales, engine.kv_cache_scales,
                                      engine.kv_scales_per_head, model_config.path, args.num_layers, args.num_kv_heads)
        # the kernel backend, resolved once before the weights load ("torch", "cpu" or "triton"); each step's
        # ops come from kernels.kernel_ops on it
        # a model whose sliding window matters runs the torch backend's windowed attention (LlamaArgs.check_sliding_window)
        self.sliding_window = args.window(config.max_model_len)
        # kv_eviction "h2o" needs the attention each block gets: the torch path sums it (AttentionPlan.attend_scored)
        self.h2o = engine.kv_eviction == "h2o"
        self.attention_backend = kernels.resolve_backend(
            "torch" if self.sliding_window is not None or self.h2o else engine.attention_backend, self.device)
        if engine.kv_cache_dtype == "int8":
            self._check_int8_kv(engine.calculate_kv_scales)
        self.num_sms = torch.cuda.get_device_properties(self.device).multi_processor_count \
            if self.device.type == "cuda" else 0  # flash-decoding's split policy; 0: never split
        self.model: LlamaForCausalLM = load_model(model_config.path, model_config.args, config.dtype, config.device,
                                                  max_positions=config.max_model_len, parallel=parallel,
                                                  quant=engine.quant_config)
        self.weight_bytes = self.model.weight_bytes()  # as stored: a quantized model's are fewer
        self.lora = LoRAManager(self.model, model_config.args, config, self.attention_backend) \
            if config.engine.enable_lora else None
        self.sampler = Sampler(config.engine.seed)
        self.rejection_sampler = RejectionSampler(self.sampler)
        spec = config.engine.speculative_config
        self.drafter = None  # method "draft_model": fills the scheduler's lookahead slots
        if spec is not None and spec.method == "draft_model":
            draft = check_draft_model(spec.model, model_config.args.vocab_size, config.max_model_len)
            self.drafter = DraftModel(draft, spec.num_speculative_tokens, config.dtype, config.device,
                                      config.max_model_len, self.block_size, self.attention_backend)
        self.input_batch = InputBatch(config.engine.max_num_seqs, cdiv(config.max_model_len, self.block_size))
        self.kv_cache: KVCache | None = None  # initialize_kv_cache
        self.cuda_graphs: DecodeGraphs | None = None

    def _check_int8_kv(self, calculate_kv_scales: bool) -> None:
        """An int8 cache needs real scales (scale 1.0 would round every |value| < 0.5 to 0) and a backend that
        reads it: refused here, before the weights load."""
        if self.attention_backend == "triton":
            raise ValueError("kv_cache_dtype='int8' runs on the cpu and torch backends only (the Triton attention "
                             "kernels read fp8 or model-dtype caches): use kv_cache_dtype='fp8' on a GPU, or "
                             "attention_backend='torch'")
        if not calculate_kv_scales and self.kv_amax is None:
            raise ValueError("kv_cache_dtype='int8' needs scales: calculate_kv_scales=True, a kv_cache_scales file "
                             "(python -m engine_core.calibrate), or a checkpoint with k_scale / v_scale; with the "
                             "fp8 cache's default scale of 1.0 int8 would round every |value| < 0.5 to 0")

    # ---- memory --------------------------------------------------------------------------
    def determine_kv_cache_config(self) -> KVCacheConfig:
        """Blocks on the device (explicit, or the budget over the bytes of one block) and in the swap
        pool (`swap_space` GiB, capped at the device's count: a larger pool could never fill)."""
        engine = self.config.engine
        spec = dataclasses.replace(self.model_config.args.model_spec(), num_layers=len(self.model.layers),
                                   num_kv_heads=self.model.num_kv_heads)  # this rank's share of the cache
        block_bytes = memory.kv_cache_bytes_per_token(spec, self.config.kv_cache_dtype) * self.block_size
        # a draft model's cache has as many blocks as the target's (the same block tables): the budget holds both
        draft_bytes = self.drafter.block_bytes() if self.drafter is not None else 0
        num_gpu_blocks = engine.num_gpu_blocks or self._budget_bytes() // (block_bytes + draft_bytes)
        if num_gpu_blocks < 1:
            raise ValueError(f"no room for the KV cache: a budget of {self._budget_bytes()} bytes holds no block of "
                             f"{block_bytes} bytes; raise gpu_memory_utilization / kv_cache_memory_bytes / cpu_memory_bytes or set "
                             f"num_gpu_blocks")
        num_cpu_blocks = int(min(engine.swap_space * 2**30, num_gpu_blocks * block_bytes) // block_bytes)
        return KVCacheConfig(int(num_gpu_blocks), int(num_cpu_blocks), block_bytes)

    def _budget_bytes(self) -> int:
        engine = self.config.engine
        if self.device.type != "cuda":
            if engine.cpu_memory_bytes is not None:  # what the weights as stored and a forward's activations leave
                return engine.cpu_memory_bytes - self.weight_bytes - self._activation_bytes()
            return engine.kv_cache_memory_bytes or DEFAULT_CPU_KV_BYTES
        total = torch.cuda.get_device_properties(self.device).total_memory
        return int(total * engine.gpu_memory_utilization) - self._profile_peak_bytes()

    def _activation_bytes(self) -> int:
        """The activation peak of a forward of max_num_batched_tokens tokens, estimated (memory.activation_bytes:
        the CPU has no peak-memory counter to profile it with, as CUDA does)."""
        n = min(self.config.max_num_batched_tokens, self.config.max_model_len)
        return memory.activation_bytes(self.model_config.args.model_spec(), self.config.dtype, n)

    @torch.inference_mode()
    def _profile_peak_bytes(self) -> int:
        """Peak device memory of a forward of max_num_batched_tokens tokens (weights included), on a
        scratch KV cache just big enough: what the KV cache must leave room for."""
        n = min(self.config.max_num_batched_tokens, self.config.max_model_len)
        num_blocks = cdiv(n, self.block_size)
        scratch = self._new_kv_cache(num_blocks, 0)
        chunk = ScheduledChunk(Request("profile", [0] * n, SamplingParams(max_tokens=1)), 0, n, list(range(num_blocks)), True)
        batch = InputBatch(1, num_blocks)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        model_input = build_model_input([chunk], [batch.add_chunk(chunk)], batch, self.block_size, self.device,
                                        self.config.engine.kv_cache_dtype, self.attention_backend)
        model_input.attn_metadata.sliding_window = self.sliding_window
        hidden = self.model(model_input.input_ids, model_input.positions, scratch, model_input.attn_metadata)
        self.model.compute_logits(hidden)
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device)
        del scratch, hidden
        torch.cuda.empty_cache()
        return peak

    def initialize_kv_cache(self, kv_cache_config: KVCacheConfig) -> None:
        """Allocate the KV tensors, give an fp8 cache its scales (or the observer that sets them from the
        first batch), and, on CUDA unless enforce_eager, set up decode CUDA graphs."""
        c = kv_cache_config
        try:
            self.kv_cache = self._new_kv_cache(c.num_gpu_blocks, c.num_cpu_blocks)
        except (RuntimeError, MemoryError) as e:  # torch.OutOfMemoryError is a RuntimeError
            raise ValueError(f"cannot allocate the KV cache: {c.num_gpu_blocks} blocks of {c.block_bytes} bytes on "
                             f"{self.device} and {c.num_cpu_blocks} in the CPU swap pool ({e}); lower num_gpu_blocks, "
                             f"kv_cache_memory_bytes, gpu_memory_utilization or swap_space") from None
        if self.drafter is not None:
            self.drafter.allocate(c.num_gpu_blocks)
        engine = self.config.engine
        if engine.calculate_kv_scales:
            self.kv_cache.observer = DynamicScales(self.kv_cache, engine.kv_scales_per_head)
        elif self.kv_amax is not None:
            self.kv_cache.set_scales(*self.kv_amax.scales(self.kv_cache.dtype, engine.kv_scales_per_head))
        if (self.device.type == "cuda" and not engine.enforce_eager and self.sliding_window is None
                and engine.kv_eviction is None):
            self.cuda_graphs = DecodeGraphs(self.model, self.kv_cache, engine.max_num_seqs,
                                            cdiv(self.config.max_model_len, self.block_size), self.device,
                                            self.attention_backend)

    def _new_kv_cache(self, num_gpu_blocks: int, num_cpu_blocks: int) -> KVCache:
        args, engine = self.model_config.args, self.config.engine
        return KVCache(len(self.model.layers), num_gpu_blocks, self.block_size, self.model.num_kv_heads, args.head_dim,
                       self.config.dtype, self.device, engine.kv_cache_dtype, num_cpu_blocks,
                       engine.kv_scales_per_head)

    # ---- requests --------------------------------------------------------------------------
    def _forget(self, request_ids: list[str]) -> None:
        """Drop the block-table rows, adapter slot pins and draft caches of requests the step names as gone."""
        for rid in request_ids:
            self.input_batch.remove(rid)
        if self.lora is not None:
            self.lora.forget(request_ids)
        if self.drafter is not None:
            self.drafter.forget(request_ids)

    def forget_all_requests(self) -> None:
        """After a step that raised part-way (the engine requeues every request to be recomputed): no
        block-table rows, no adapter pins, no adapter slot trusted (one may be half-copied)."""
        self._forget(list(self.input_batch.row_of))
        if self.lora is not None:
            self.lora.forget_all()

    # ---- one step --------------------------------------------------------------------------
    @torch.inference_mode()
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step: forget the requests it names, the KV block copies, then the forward and sampling
        of every scheduled chunk.

        A forward that raises is retried one chunk at a time, so the fault is pinned on the requests
        whose chunks raise alone (`ModelRunnerOutput.failed`) while the rest of the batch still gets its
        tokens. Each retry recomputes the KV slots the failed batch may have half-written (they lie
        past every request's num_computed_tokens, in blocks no other request holds)."""
        self._forget([*scheduler_output.finished_req_ids, *scheduler_output.preempted_request_ids])
        self.kv_cache.swap_out(scheduler_output.swap_out)
        self.kv_cache.swap_in(scheduler_output.swap_in)
        if not scheduler_output.scheduled:
            return ModelRunnerOutput()
        spec = scheduler_output.scheduled_spec_decode_tokens
        # one-row sequences (decodes without drafts) first (stable)
        chunks = sorted(scheduler_output.scheduled,
                        key=lambda c: c.num_tokens + len(spec.get(c.request.request_id, ())) != 1)
        rows = [self.input_batch.add_chunk(c) for c in chunks]
        draft_probs = None
        if self.drafter is not None and spec:
            spec, draft_probs = self._draft(chunks, spec)
        try:
            return self._run(chunks, rows, spec, draft_probs)
        except Exception as error:
            if self.parallel is not None:  # every rank would have to retry in step: the engine stops instead
                raise
            self._distrust_lora_slots()
            if len(chunks) == 1:
                return ModelRunnerOutput(failed={chunks[0].request.request_id: _fault(chunks[0], error)})
        return self._run_one_by_one(chunks, rows, spec, draft_probs)

    def _draft(self, chunks: list[ScheduledChunk], slots: dict[str, list[int]]
               ) -> tuple[dict[str, list[int]], dict[str, torch.Tensor | None]]:
        """The draft model's tokens for the scheduler's lookahead slots (as many per request), and their q."""
        requests = [c.request for c in chunks if c.request.request_id in slots]
        tables = self.input_batch.block_tables([self.input_batch.row_of[r.request_id] for r in requests])
        drafts, probs = self.drafter.propose(requests, [len(slots[r.request_id]) for r in requests], tables,
                                             self.sampler)
        ids = [r.request_id for r in requests]
        return dict(zip(ids, drafts)), dict(zip(ids, probs))

    def _run_one_by_one(self, chunks: list[ScheduledChunk], rows: list[int], spec: dict[str, list[int]],
                        draft_probs: dict[str, torch.Tensor | None] | None = None) -> ModelRunnerOutput:
        out = ModelRunnerOutput()
        for chunk, row in zip(chunks, rows):
            try:
                alone = self._run([chunk], [row], spec, draft_probs)
            except Exception as error:
                self._distrust_lora_slots()
                out.failed[chunk.request.request_id] = _fault(chunk, error)
            else:
                out.sampled_token_ids.update(alone.sampled_token_ids)
                out.failed.update(alone.failed)
                out.block_scores.update(alone.block_scores)
        return out

    def _distrust_lora_slots(self) -> None:
        """A run that raised may have stopped part-way through copying an adapter into its slot (a
        disk read that failed raises before any slot changes): the next run copies every one again."""
        if self.lora is not None:
            self.lora.slots.clear()

    def _run(self, chunks: list[ScheduledChunk], rows: list[int], spec: dict[str, list[int]],
             draft_probs: dict[str, torch.Tensor | None] | None = None) -> ModelRunnerOutput:
        """Forward and sample `chunks` (their block-table rows already applied; `spec`: their draft tokens;
        `draft_probs`: a draft model's q per speculating request, None for n-gram drafts)."""
        batch = build_model_input(chunks, rows, self.input_batch, self.block_size, self.device,
                                  self.config.engine.kv_cache_dtype, self.attention_backend, spec)
        batch.attn_metadata.sliding_window = self.sliding_window
        if self.h2o:
            batch.attn_metadata.block_scores = torch.zeros(batch.attn_metadata.block_tables.shape, dtype=torch.float32,
                                                           device=self.device)
        if self.num_sms:
            self._choose_num_splits(chunks, batch.attn_metadata)
        if self.lora is not None:
            num_rows = [c.num_tokens + len(spec.get(c.request.request_id, ())) for c in chunks] if spec else None
            batch.attn_metadata.lora = self.lora.prepare(chunks, batch.attn_metadata, num_rows)
        hidden = self._forward(batch)
        out = ModelRunnerOutput(block_scores=self._block_scores(chunks, batch.attn_metadata))
        if not batch.emitting or hidden is None:  # only mid-prompt chunks; or a pipeline stage before the last
            return out
        if batch.logits_indices is not None:
            hidden = hidden[batch.logits_indices]
        logits = self.model.compute_logits(hidden)  # the emitting rows only
        if logits is None:  # a TP rank other than 0: rank 0 gathered the logits and samples
            return out
        for request, tokens in zip(batch.emitting, self._sample(logits, batch, draft_probs)):
            if tokens[0] == INVALID_TOKEN:
                out.failed[request.request_id] = (
                    f"request {request.request_id!r}: its logits are NaN or infinite, so no token can be sampled "
                    f"(the weights or activations overflow in {self.config.dtype}?)")
            else:
                out.sampled_token_ids[request.request_id] = tokens
        return out

    def _block_scores(self, chunks: list[ScheduledChunk], meta: AttentionMetadata) -> dict[str, list[float]]:
        """kv_eviction "h2o": each request's accumulated attention per block of its row (one copy to the host)."""
        if meta.block_scores is None:
            return {}
        scores = meta.block_scores.tolist()
        lens = meta.seq_lens.tolist()
        return {c.request.request_id: scores[i][:cdiv(lens[i], self.block_size)] for i, c in enumerate(chunks)}

    def _sample(self, logits: torch.Tensor, batch: ModelInput,
                draft_probs: dict[str, torch.Tensor | None] | None = None) -> list[list[int]]:
        """Each emitting request's tokens: the plain sampler's one for a row of its own, the rejection
        sampler's verdict over its 1 + k rows for a speculating request."""
        if batch.drafts is None:
            return [[t] for t in self.sampler(logits, batch.emitting)]
        plain, spec, plain_rows, spec_rows, row = [], [], [], [], 0
        for i, d in enumerate(batch.drafts):
            (spec if d else plain).append(i)
            (spec_rows if d else plain_rows).extend(range(row, row + 1 + len(d)))
            row += 1 + len(d)
        result: list[list[int]] = [[]] * len(batch.drafts)
        if plain:
            tokens = self.sampler(logits[plain_rows], [batch.emitting[i] for i in plain])
            for i, t in zip(plain, tokens):
                result[i] = [t]
        if spec:
            reqs = [batch.emitting[i] for i in spec]
            q = None if draft_probs is None else [draft_probs[r.request_id] for r in reqs]
            verdicts = self.rejection_sampler(logits[spec_rows], reqs, [batch.drafts[i] for i in spec], q)
            for i, tokens in zip(spec, verdicts):
                result[i] = tokens
        return result

    def _choose_num_splits(self, chunks: list[ScheduledChunk], meta: AttentionMetadata) -> None:
        """Flash-decoding's split count for the step's two decode-op calls: the decode rows, and the
        emitting rows of a step with prefill chunks (each a sequence's last row). Host-side lengths only."""
        lens = [c.start + c.num_tokens for c in chunks]
        kv_heads, nd = self.model_config.args.num_kv_heads, meta.num_decode_seqs
        if nd:
            meta.decode_num_splits = split_policy.choose_num_splits(nd, kv_heads, max(lens[:nd]), self.num_sms)
        emitting = [n for n, c in zip(lens, chunks) if c.emits]
        if meta.output_rows is not None and emitting:
            meta.output_num_splits = split_policy.choose_num_splits(len(emitting), kv_heads, max(emitting),
                                                                    self.num_sms)

    def _forward(self, batch: ModelInput) -> torch.Tensor:
        meta = batch.attn_metadata
        if self.cuda_graphs is not None and self.cuda_graphs.can_run(meta):
            return self.cuda_graphs.run(batch.input_ids, batch.positions, meta)
        return self.model(batch.input_ids, batch.positions, self.kv_cache, meta)


def _fault(chunk: ScheduledChunk, error: Exception) -> str:
    rid = chunk.request.request_id
    return (f"request {rid!r}: its forward raised {type(error).__name__}: {error} (tokens "
            f"{chunk.start}..{chunk.start + chunk.num_tokens - 1}, run alone)")


def build_model_input(chunks: list[ScheduledChunk], rows: list[int], input_batch: InputBatch, block_size: int,
                      device: torch.device, kv_cache_dtype: str, backend: str,
                      spec_tokens: dict[str, list[int]] | None = None) -> ModelInput:
    """The flat batch for `chunks` (one-row sequences first, so attention runs all of them through
    the decode op at once); sequence i owns rows query_start_loc[i]:query_start_loc[i+1] and its block
    table is `input_batch` row `rows[i]`. A chunk with draft tokens (`spec_tokens`) has them as extra
    rows after its own, in the lookahead slots of its table."""
    drafts = [spec_tokens.get(c.request.request_id, []) for c in chunks] if spec_tokens else None
    if drafts is not None and not any(drafts):
        drafts = None
    if drafts is None:
        decode = _decode_model_input(chunks, rows, input_batch, block_size, device, kv_cache_dtype, backend)
        if decode is not None:
            return decode
    starts = torch.tensor([c.start for c in chunks], dtype=torch.int64)
    nums = torch.tensor([c.num_tokens + (len(drafts[i]) if drafts else 0) for i, c in enumerate(chunks)],
                        dtype=torch.int64)
    token_ids: list[int] = []
    for i, c in enumerate(chunks):
        token_ids += c.token_ids
        if drafts:
            token_ids += drafts[i]
    block_tables = input_batch.block_tables(rows)
    query_start_loc = torch.zeros(len(chunks) + 1, dtype=torch.int64)
    torch.cumsum(nums, 0, out=query_start_loc[1:])
    total = int(query_start_loc[-1])
    seq_idx = torch.repeat_interleave(torch.arange(len(chunks)), nums)
    positions = torch.arange(total) - query_start_loc[seq_idx] + starts[seq_idx]
    cache_positions, seq_starts = positions, starts  # where each token's K/V sits in the row: its position ...
    if any(c.num_evicted_tokens for c in chunks):  # ... less the evicted tokens before it (kv_eviction)
        evicted = torch.tensor([c.num_evicted_tokens for c in chunks], dtype=torch.int64)
        cache_positions, seq_starts = positions - evicted[seq_idx], starts - evicted
    slot_mapping = (block_tables[seq_idx, cache_positions // block_size].long() * block_size
                    + cache_positions % block_size)
    emits = torch.tensor([c.emits for c in chunks], dtype=torch.bool)
    emit_seqs = emits.nonzero().flatten()
    logits_indices = (query_start_loc[1:] - 1)[emit_seqs]
    every_row_emits = len(emit_seqs) == total
    spec_rows = None
    if drafts:  # every row of a speculating request gives logits: the last layer runs every row
        spec_rows = torch.cat([torch.arange(int(query_start_loc[i + 1]) - 1 - len(drafts[i]),
                                            int(query_start_loc[i + 1])) for i in emit_seqs.tolist()])
        every_row_emits = True
    meta = AttentionMetadata(
        slot_mapping=slot_mapping.to(device), block_tables=block_tables.to(device),
        seq_lens=(seq_starts + nums).to(device=device, dtype=torch.int32),
        query_start_loc=query_start_loc.to(device=device, dtype=torch.int32),
        num_decode_seqs=int((nums == 1).sum()), kv_cache_dtype=kv_cache_dtype, backend=backend,
        output_rows=None if every_row_emits else logits_indices.to(device),
        output_seqs=None if every_row_emits else emit_seqs.to(device))
    return ModelInput(torch.tensor(token_ids, dtype=torch.int64, device=device), positions.to(device), meta,
                      [c.request for c in chunks if c.emits],
                      None if spec_rows is None else spec_rows.to(device),
                      None if drafts is None else [d for d, c in zip(drafts, chunks) if c.emits])


def _decode_model_input(chunks: list[ScheduledChunk], rows: list[int], input_batch: InputBatch, block_size: int,
                        device: torch.device, kv_cache_dtype: str, backend: str) -> ModelInput | None:
    """`build_model_input` of a plain decode step (one row per sequence, every one emitting, nothing evicted),
    from Python ints: the general path's ~20 small tensor ops took 0.37 ms, 3% of a SmolLM2 batch-1 step
    (docs/benchmarks.md). None when the step is anything else."""
    for c in chunks:
        if c.num_tokens != 1 or c.num_evicted_tokens or not c.emits:
            return None
    table = input_batch.block_table
    starts = [c.start for c in chunks]
    slots = [int(table[r, s // block_size]) * block_size + s % block_size for r, s in zip(rows, starts)]
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        block_tables=input_batch.block_tables(rows).to(device),
        seq_lens=torch.tensor([s + 1 for s in starts], dtype=torch.int32, device=device),
        query_start_loc=torch.arange(len(chunks) + 1, dtype=torch.int32, device=device),
        num_decode_seqs=len(chunks), kv_cache_dtype=kv_cache_dtype, backend=backend)
    return ModelInput(torch.tensor([c.token_ids[0] for c in chunks], dtype=torch.int64, device=device),
                      torch.tensor(starts, dtype=torch.int64, device=device), meta, [c.request for c in chunks])
