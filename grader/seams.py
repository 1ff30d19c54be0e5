"""The seam table: for each lab, the engine attributes the learner's functions replace.

A seam is one attribute of an engine class or module (`owner.attr`) that a lab strips and the
learner rewrites as a plain function named `student_name` (a method takes `self` first). Owners
are dotted-path strings resolved when used, so moving an engine file is a string edit here and
in grader/harness.py, nowhere else. `private_state` names the engine state the learner's
function may read or write (attributes, private helpers): it is the contract, and
tests/grader/test_seams.py fails when one of them is renamed. `helpers` are further engine functions
whose bodies are the same answer (weight_bytes is num_params x bytes): grading treats them like
the seam itself (tripwired while the lab is plugged, removed from the batch grading kit).
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

# The engine's places, named once (the rename point).
BLOCK_POOL_MODULE = "engine_core.core.block_pool"
KV_CACHE_MANAGER_MODULE = "engine_core.core.kv_cache_manager"
SCHEDULER_MODULE = "engine_core.core.scheduler"
MEMORY = "engine_core.memory"
CAPACITY_PLANNER = "engine_core.capacity_planner"
DECODE_ATTENTION = "kernels.triton.decode_attention"
KERNELS_REFERENCE = "kernels.reference"
BLOCK_POOL = f"{BLOCK_POOL_MODULE}.BlockPool"
BLOCK = f"{BLOCK_POOL_MODULE}.KVCacheBlock"
KV_CACHE_MANAGER = f"{KV_CACHE_MANAGER_MODULE}.KVCacheManager"
SCHEDULER = f"{SCHEDULER_MODULE}.Scheduler"
COST_MODEL = "engine_core.core.cost_model.PreemptionCostModel"
COUNTERS = "engine_core.metrics.Stats"
MODELS_LORA = "engine_core.models.lora"
LORA_REFERENCE = "kernels.lora_reference"
LORA_SLOT_POOL = "engine_core.lora.slots.LoRASlotPool"


@dataclass(frozen=True)
class Seam:
    """`owner.attr` of the engine, replaced by the notebook's `student_name` in lab `lab`."""

    lab: str
    owner: str  # dotted path of a class or a module
    attr: str
    student_name: str
    private_state: tuple[str, ...] = ()  # dotted "Class.attr" paths the learner's function may touch
    helpers: tuple[str, ...] = ()  # dotted paths of engine functions that hold the same answer
    same_parameter_names: bool = True  # False only where the engine names its parameters differently

    @property
    def qualname(self) -> str:
        """`BlockPool.get_new_blocks` or `memory.weight_bytes`: how messages name the seam."""
        return f"{self.owner.rsplit('.', 1)[-1]}.{self.attr}"

    @property
    def dotted(self) -> str:
        return f"{self.owner}.{self.attr}"


def _state(owner: str, *names: str) -> tuple[str, ...]:
    return tuple(f"{owner}.{name}" for name in names)


LAB00, LAB01, LAB02, LAB03 = "00_warmup", "01_kv_cache_math", "02_paged_kv_blocks", "03_preemption"
LAB04, LAB05, LAB06 = "04_chunked_prefill", "05_prefix_caching", "06_paged_attention_kernel"
LAB09 = "09_multi_lora"
_LORA_OPS = ("bgmv_shrink", "bgmv_expand", "sgmv_shrink", "sgmv_expand")
LAB08 = "08_fp8_kv_cache"
FP8 = "kernels.fp8"
KV_SCALES = "engine_core.worker.kv_scales"
LAB07 = "07_flash_decoding"
FLASH_DECODING = "kernels.flash_decoding"
SPLIT_POLICY = "kernels.split_policy"
LAB10 = "10_speculative_decoding"
REJECTION_SAMPLER = "engine_core.worker.rejection_sampler"
NGRAM_PROPOSER = "engine_core.spec_decode.ngram_proposer"
LAB11 = "11_parallelism"
PARALLEL_LINEAR = "engine_core.models.parallel_linear"
ROW_PARALLEL, VOCAB_PARALLEL = f"{PARALLEL_LINEAR}.RowParallelLinear", f"{PARALLEL_LINEAR}.VocabParallelEmbedding"
LAB12 = "12_serving"
PRIORITY_QUEUE = "engine_core.core.request_queue.PriorityRequestQueue"
REQUEST_METRICS = "engine_core.entrypoints.request_metrics"
ROUTER_POLICIES = "engine_core.entrypoints.router.policies"
HASH_RING = f"{ROUTER_POLICIES}.HashRing"
LAB13 = "13_weight_quantization"
QUANT = "engine_core.models.quantization"
LAB14 = "14_find_the_bottleneck"
ATTENTION_PLAN = "engine_core.models.attention.AttentionPlan"
SAMPLER = "engine_core.worker.sampler.Sampler"
INPUT_BATCH = "engine_core.worker.input_batch.InputBatch"
LAB15 = "15_fine_tune_to_serve"
NF4 = "engine_core.models.quantization.nf4"
LAB16 = "16_long_context_kv"
SLIDING_WINDOW = "engine_core.core.sliding_window"
KV_EVICTION = "engine_core.core.kv_eviction"
OFFLOAD_TIER = "engine_core.core.kv_offload.OffloadTier"
OFFLOAD_COUNTERS = "engine_core.core.kv_offload.OffloadCounters"
LAB18 = "18_flash_attention"
TILED_ATTENTION = "kernels.tiled_attention"
PREFILL_ATTENTION = "kernels.triton.prefill_attention"

SEAMS: tuple[Seam, ...] = (
    # engine call sites pass cdiv's two arguments positionally; the exercise names them
    Seam(LAB00, KV_CACHE_MANAGER_MODULE, "cdiv", "num_blocks_needed", same_parameter_names=False),

    Seam(LAB01, MEMORY, "kv_cache_bytes_per_token", "kv_cache_bytes_per_token"),
    Seam(LAB01, MEMORY, "weight_bytes", "weight_bytes",
         helpers=(f"{MEMORY}.num_params", f"{MEMORY}._layer_params")),
    Seam(LAB01, CAPACITY_PLANNER, "int4_weight_bytes", "int4_weight_bytes"),  # graded on its own: no engine path
    Seam(LAB01, MEMORY, "activation_bytes", "activation_bytes"),
    Seam(LAB01, CAPACITY_PLANNER, "max_concurrent_requests", "max_concurrent_requests"),
    Seam(LAB01, CAPACITY_PLANNER, "allreduce_seconds", "allreduce_seconds"),
    Seam(LAB01, CAPACITY_PLANNER, "decode_step_lower_bound", "decode_step_lower_bound"),
    Seam(LAB01, CAPACITY_PLANNER, "prefill_lower_bound", "prefill_lower_bound"),
    Seam(LAB01, CAPACITY_PLANNER, "capacity_plan", "capacity_plan",
         helpers=(f"{CAPACITY_PLANNER}._replica_plan", f"{CAPACITY_PLANNER}.replica_estimates")),

    Seam(LAB02, BLOCK_POOL, "get_new_blocks", "get_new_blocks",
         _state(BLOCK_POOL, "free_queue", "_evict") + _state(BLOCK, "ref_cnt")),
    Seam(LAB02, BLOCK_POOL, "free_blocks", "free_blocks",
         _state(BLOCK_POOL, "free_queue") + _state(BLOCK, "ref_cnt", "block_id")),
    Seam(LAB02, KV_CACHE_MANAGER, "allocate_slots", "allocate_slots",
         _state(KV_CACHE_MANAGER, "req_to_blocks", "num_cached_blocks", "block_pool", "block_size")
         + _state(BLOCK, "ref_cnt")),

    Seam(LAB03, SCHEDULER, "choose_preemption_mode", "choose_preemption_mode",
         _state(SCHEDULER, "config", "kv_cache_manager", "cost_model")
         + _state(COST_MODEL, "model_spec", "kv_cache_dtype", "prefill_flops_per_s", "swap_bytes_per_s")),
    Seam(LAB03, SCHEDULER, "_preempt", "_preempt",
         _state(SCHEDULER, "running", "waiting", "swapped", "counters", "kv_cache_manager")
         + _state(COUNTERS, "num_preemptions_recompute", "num_preemptions_swap", "num_blocks_swapped_out")),
    Seam(LAB03, KV_CACHE_MANAGER, "swap_out", "swap_out",
         _state(KV_CACHE_MANAGER, "block_size", "req_to_blocks", "req_to_cpu_blocks", "num_cached_blocks",
                "block_pool", "cpu_block_pool")),
    Seam(LAB03, KV_CACHE_MANAGER, "swap_in", "swap_in",
         _state(KV_CACHE_MANAGER, "req_to_blocks", "req_to_cpu_blocks", "block_pool", "cpu_block_pool")),

    Seam(LAB04, SCHEDULER, "_num_new_tokens", "_num_new_tokens", _state(SCHEDULER, "chunked_prefill", "config")),
    Seam(LAB04, SCHEDULER, "_admit_waiting", "_admit_waiting",
         _state(SCHEDULER, "kv_cache_manager", "waiting", "running", "max_num_seqs", "counters",
                "_num_new_tokens", "_schedule_chunk")
         + _state(COUNTERS, "prefix_cache_queries", "prefix_cache_hits")),
    Seam(LAB04, SCHEDULER, "_schedule_tokens", "schedule",
         _state(SCHEDULER, "max_num_batched_tokens", "running", "swapped", "kv_cache_manager", "_num_new_tokens",
                "_preempt", "_schedule_chunk", "_swap_in", "_admit_waiting")),

    Seam(LAB05, KV_CACHE_MANAGER_MODULE, "hash_block_tokens", "hash_block_tokens"),
    Seam(LAB05, KV_CACHE_MANAGER, "get_computed_blocks", "get_computed_blocks",
         _state(KV_CACHE_MANAGER, "enable_caching", "block_size", "block_pool")),
    Seam(LAB05, BLOCK_POOL, "get_new_blocks", "get_new_blocks",
         _state(BLOCK_POOL, "free_queue", "cached_blocks") + _state(BLOCK, "ref_cnt", "block_hash"),
         helpers=(f"{BLOCK_POOL}._evict",)),
    Seam(LAB05, BLOCK_POOL, "touch", "touch", _state(BLOCK_POOL, "free_queue") + _state(BLOCK, "ref_cnt", "block_id")),

    Seam(LAB06, DECODE_ATTENTION, "paged_attention_decode", "paged_attention_decode",
         helpers=(f"{DECODE_ATTENTION}._decode_kernel", f"{DECODE_ATTENTION}._merge_kernel",
                  f"{KERNELS_REFERENCE}.paged_attention_decode")),

    # the merge is graded on its own: no engine path calls merge_partials (the Triton path merges in
    # _merge_kernel); the learner's launcher calls their own merge_partials by name
    Seam(LAB07, FLASH_DECODING, "merge_partials", "merge_partials"),
    Seam(LAB07, SPLIT_POLICY, "choose_num_splits", "choose_num_splits"),
    # the decode seam of lab 06, now with num_splits >= 1; the PyTorch split decode holds the answer too
    Seam(LAB07, DECODE_ATTENTION, "paged_attention_decode", "paged_attention_decode",
         helpers=(f"{DECODE_ATTENTION}._decode_kernel", f"{DECODE_ATTENTION}._merge_kernel",
                  f"{KERNELS_REFERENCE}.paged_attention_decode", f"{FLASH_DECODING}.paged_attention_decode_split",
                  f"{FLASH_DECODING}.attend_range")),

    # the delta in PyTorch: the engine's SGMV / BGMV ops (dispatch and reference) hold the answer
    Seam(LAB09, MODELS_LORA, "add_lora", "add_lora",
         helpers=(f"{MODELS_LORA}._slices",) + tuple(f"{LORA_REFERENCE}.{op}" for op in _LORA_OPS)
         + tuple(f"kernels.{op}" for op in _LORA_OPS)),
    Seam(LAB09, LORA_SLOT_POOL, "assign", "assign", _state(LORA_SLOT_POOL, "num_slots", "slot_of", "free_slots")),
    Seam(LAB09, SCHEDULER, "_lora_slot_available", "_lora_slot_available", _state(SCHEDULER, "config")),
    Seam(LAB08, FP8, "scale_from_amax", "scale_from_amax"),
    Seam(LAB08, FP8, "quantize_fp8", "quantize_fp8"),
    Seam(LAB08, FP8, "dequantize_fp8", "dequantize_fp8"),
    Seam(LAB08, KV_SCALES, "amax_per_head", "amax_per_head"),
    Seam(LAB08, f"{KV_SCALES}.KVAmax", "scales", "scales", _state(f"{KV_SCALES}.KVAmax", "key", "value")),
    Seam(LAB08, KERNELS_REFERENCE, "reshape_and_cache", "reshape_and_cache"),
    # kv_cache_dtype="int8": the engine's cache write and every attention read call these two
    Seam(LAB08, "kernels.int8_kv", "quantize_int8", "quantize_int8"),
    Seam(LAB08, "kernels.int8_kv", "dequantize_int8", "dequantize_int8"),
    # graded on its own: the engine's int8 cache keeps static scales, not one per token and head
    Seam(LAB08, "kernels.int8_kv", "quantize_int8_per_token_head", "quantize_int8_per_token_head"),

    # the verifiers (the engine's RejectionSampler calls greedy_verify and rejection_sample on every speculating
    # request) and the proposer; residual_probs is graded on its own: only a draft distribution q reaches it,
    # and the engine's n-gram drafts are one-hot (verified against the row's own sample)
    Seam(LAB10, REJECTION_SAMPLER, "greedy_verify", "greedy_verify",
         helpers=(f"{REJECTION_SAMPLER}._valid", f"{REJECTION_SAMPLER}._emit")),
    Seam(LAB10, REJECTION_SAMPLER, "residual_probs", "residual_probs"),
    Seam(LAB10, REJECTION_SAMPLER, "rejection_sample", "rejection_sample"),
    Seam(LAB10, f"{NGRAM_PROPOSER}.NgramProposer", "propose", "propose",
         _state(f"{NGRAM_PROPOSER}.NgramProposer", "min_n", "max_n", "k"),
         helpers=(f"{NGRAM_PROPOSER}._first_occurrence",)),
    Seam(LAB10, SCHEDULER, "_schedule_drafts", "_schedule_drafts",
         _state(SCHEDULER, "max_num_batched_tokens", "max_model_len", "proposer", "kv_cache_manager", "_sent_tables")
         + _state(KV_CACHE_MANAGER, "req_to_blocks")),
    Seam(LAB10, SCHEDULER, "_commit_verified_tokens", "_commit_verified_tokens",
         _state(SCHEDULER, "max_model_len", "kv_cache_manager")),
    # lab 11: the engine calls these in its worker processes (grader/worker_plug.py plugs them there too)
    Seam(LAB11, PARALLEL_LINEAR, "layer_shards", "layer_shards"),
    Seam(LAB11, ROW_PARALLEL, "forward", "row_parallel_forward", _state(ROW_PARALLEL, "tp")),
    Seam(LAB11, VOCAB_PARALLEL, "forward", "embedding_forward", _state(VOCAB_PARALLEL, "weight", "tp", "start", "end")),
    Seam(LAB11, "engine_core.distributed.parallel_state", "get_pp_indices", "get_pp_indices"),
    # priority scheduling: the waiting queue's order (admission) and the preemption victim
    Seam(LAB12, PRIORITY_QUEUE, "append", "append", _state(PRIORITY_QUEUE, "_keys", "_requests")),
    Seam(LAB12, SCHEDULER, "_select_victim", "_select_victim", _state(SCHEDULER, "running")),
    # the load generator's per-request metrics, percentiles and goodput
    Seam(LAB12, REQUEST_METRICS, "request_metrics", "request_metrics"),
    Seam(LAB12, REQUEST_METRICS, "percentile", "percentile"),
    Seam(LAB12, REQUEST_METRICS, "meets_slos", "meets_slos"),
    # the router's consistent hashing with bounded loads
    Seam(LAB12, HASH_RING, "lookup", "lookup", _state(HASH_RING, "_hashes", "_urls")),
    Seam(LAB12, ROUTER_POLICIES, "load_bound", "load_bound"),
    Seam(LAB12, ROUTER_POLICIES, "prefix_aware", "prefix_aware"),
    Seam(LAB12, ROUTER_POLICIES, "length_aware", "length_aware"),
    # W8A8: the engine's Int8LinearMethod calls the learner's quantizers, int32 GEMM and epilogue
    Seam(LAB13, f"{QUANT}.int8", "quantize_per_channel", "quantize_per_channel"),
    Seam(LAB13, f"{QUANT}.int8", "quantize_per_token", "quantize_per_token"),
    Seam(LAB13, f"{QUANT}.int8", "int8_mm", "int8_mm", helpers=(f"{QUANT}.int8.int8_mm_float64",)),
    Seam(LAB13, f"{QUANT}.int8.Int8LinearMethod", "apply", "int8_linear_apply"),
    # graded on its own: the engine quantizes fused modules per row, so no engine path expands scales yet
    Seam(LAB13, f"{QUANT}.int8", "convert_to_channelwise", "convert_to_channelwise"),
    Seam(LAB13, f"{QUANT}.smoothquant", "smoothquant_scales", "smoothquant_scales"),
    # W4A16 in GPTQ's layout: RTNLinearMethod calls all four on its reference path
    Seam(LAB13, f"{QUANT}.rtn", "quantize_groupwise", "quantize_groupwise"),
    Seam(LAB13, f"{QUANT}.rtn", "dequantize_groupwise", "dequantize_groupwise"),
    Seam(LAB13, f"{QUANT}.rtn", "pack_along_k", "pack_along_k"),
    Seam(LAB13, f"{QUANT}.rtn", "unpack_along_k", "unpack_along_k"),
    # checkpoint formats, graded on their own (no loader calls them yet)
    Seam(LAB13, f"{QUANT}.gptq", "unpack_gptq_qzeros", "unpack_gptq_qzeros"),
    Seam(LAB13, f"{QUANT}.gguf_q4_1", "dequantize_q4_1", "dequantize_q4_1"),
    # calibrated 4-bit, graded on their own on one layer (no engine path quantizes with calibration data yet)
    Seam(LAB13, f"{QUANT}.gptq_update", "gptq_quantize", "gptq_quantize"),
    Seam(LAB13, f"{QUANT}.awq_search", "awq_search_scale", "awq_search_scale",
         helpers=(f"{QUANT}.awq_search.awq_fake_quantize",)),
    # lab 14: the hot loop's pieces, each with a slow variant in grader/slow_engine (the learner's fix)
    Seam(LAB14, ATTENTION_PLAN, "write_kv", "write_kv", _state(ATTENTION_PLAN, "ops", "meta")),
    Seam(LAB14, ATTENTION_PLAN, "attend", "attend",
         _state(ATTENTION_PLAN, "ops", "meta", "num_decode_seqs", "num_seqs", "decode", "prefill")),
    Seam(LAB14, SAMPLER, "__call__", "sample", _state(SAMPLER, "generator", "seeded", "_exponential_noise")),
    Seam(LAB14, INPUT_BATCH, "block_tables", "block_tables", _state(INPUT_BATCH, "block_table", "num_blocks")),
    Seam(LAB14, SCHEDULER, "_remove_finished", "remove_finished", _state(SCHEDULER, "running")),

    # QLoRA's NF4: the engine calls both for quantization="nf4" (at load, at every GEMM)
    Seam(LAB15, NF4, "nf4_quantize", "nf4_quantize"),
    Seam(LAB15, NF4, "nf4_dequantize", "nf4_dequantize"),
    # graded on its own: no engine path runs QLoRA's training forward
    Seam(LAB15, NF4, "qlora_linear", "qlora_linear"),

    # pure block choices the KV cache manager calls (window, kv_eviction); the offload tier's plans (connector)
    Seam(LAB16, SLIDING_WINDOW, "num_blocks_out_of_window", "num_blocks_out_of_window"),
    Seam(LAB16, KV_EVICTION, "evict_tokens", "evict_tokens"),
    Seam(LAB16, OFFLOAD_TIER, "save", "save",
         _state(OFFLOAD_TIER, "entries", "free_slots", "counters") + _state(OFFLOAD_COUNTERS, "num_saved_blocks")),
    Seam(LAB16, OFFLOAD_TIER, "load", "load",
         _state(OFFLOAD_TIER, "entries", "counters")
         + _state(OFFLOAD_COUNTERS, "num_collisions", "external_prefix_cache_queries", "external_prefix_cache_hits")),

    # graded on their own: no engine path calls the PyTorch loop nest (the Triton prefill kernel is its GPU form)
    Seam(LAB18, TILED_ATTENTION, "tiled_attention", "tiled_attention"),
    Seam(LAB18, TILED_ATTENTION, "causal_kv_tiles", "causal_kv_tiles"),
    # the Triton backend's prefill attention: the engine calls it for every prefill chunk
    Seam(LAB18, PREFILL_ATTENTION, "paged_attention", "paged_attention",
         helpers=(f"{PREFILL_ATTENTION}._prefill_kernel", f"{KERNELS_REFERENCE}.paged_attention")),
)


def fused_block_switch(seams: list[Seam]) -> tuple[Any, str] | None:
    """(holder, attribute) to set False while `seams` are plugged, when the engine's fused decode block
    (`AttentionPlan.fused_decode_block`) would otherwise run in their place; None when it runs none of them."""
    if any(s.owner == ATTENTION_PLAN for s in seams):
        return resolve(ATTENTION_PLAN), "fused_decode_block"
    return None


# Labs graded without any seam: the learner writes whole classes from a blank page and nothing of the engine is
# replaced (lab 17's coding round: its reference solutions live in the solution notebook only). No test of theirs
# plugs; their batch kit removes nothing; the selftest runs no engine variant for them.
SEAMLESS_LABS = ("17_coding_round",)


def seams_of(lab: str) -> tuple[Seam, ...]:
    """The lab's seams in table order: () for a lab of SEAMLESS_LABS, ValueError for any other lab without any."""
    found = tuple(s for s in SEAMS if s.lab == lab)
    if not found and lab not in SEAMLESS_LABS:
        raise ValueError(f"lab {lab!r} has no seams; labs with seams: {sorted({s.lab for s in SEAMS})}")
    return found


def labs_with_seams() -> list[str]:
    return sorted({s.lab for s in SEAMS})


def _split(dotted: str) -> tuple[str, list[str]]:
    """(the longest importable module prefix, the attribute names after it)."""
    parts = dotted.split(".")
    for split in range(len(parts), 0, -1):
        name = ".".join(parts[:split])
        try:
            importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name is None or not name.startswith(exc.name):
                raise  # a module the engine imports is missing, not a prefix that is no module
            continue
        return name, parts[split:]
    raise ModuleNotFoundError(f"no module on the path {dotted!r}")


def resolve(dotted: str) -> Any:
    """The object at `package.module.Class.attr`: imports the longest module prefix, then getattr."""
    module, names = _split(dotted)
    obj = importlib.import_module(module)
    for name in names:
        obj = getattr(obj, name)
    return obj


def module_of(dotted: str) -> str:
    """The module part of a dotted path (`engine_core.core.block_pool` of `engine_core.core.block_pool.BlockPool.touch`)."""
    return _split(dotted)[0]


def current(seam: Seam) -> Any:
    """What the owner holds at `attr` now: the engine's function, or the learner's while plugged."""
    owner = resolve(seam.owner)
    return vars(owner)[seam.attr] if isinstance(owner, type) else getattr(owner, seam.attr)
