"""Engine configuration: what the user asked for (`EngineConfig`, vLLM's parameter names, validated
before anything is built), what the engine resolved it to (`ResolvedConfig`: device, dtypes,
max_model_len, the token budget, decided once), and the KV cache the model runner sized
(`KVCacheConfig`). A leaf of the engine: it knows the checkpoint only by the numbers it is given, and
names kernels only by the names users pass (the model runner resolves the backend)."""
from __future__ import annotations

import os
import re
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import torch

from engine_core.validation import SEED_RANGE, check_bool, check_choice, check_int, check_real, fail
from kernels.fp8 import KV_CACHE_DTYPES, kv_storage_dtype

_PREEMPTION_MODES = ("auto", "recompute", "swap")
SCHEDULING_POLICIES = ("fcfs", "priority")  # vLLM's names (engine_core/core/request_queue.py)
KV_EVICTION_POLICIES = ("streaming_llm", "h2o")  # engine_core/core/kv_eviction.py
_ATTENTION_BACKENDS = ("auto", "torch", "cpu", "triton")
# vLLM's executor backends: "uni" (one process, the model in the engine's), "mp" (a worker process per
# rank, engine_core/executor); None picks "uni" for one rank and "mp" for more
_EXECUTOR_BACKENDS = (None, "uni", "mp")
_SPEC_METHODS = ("ngram", "draft_model")
MAX_SPECULATIVE_TOKENS = 16  # drafts per step; acceptance of the k-th draft is alpha^k, so more rarely pays
_DTYPES = {"auto": None, "float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def _need(ok: bool, name: str, allowed: str, value: Any) -> None:
    if not ok:
        fail(name, allowed, value)


@dataclass(frozen=True)
class SpeculativeConfig:
    """vLLM's `speculative_config` (a dict of these names): `method` "ngram" (prompt lookup) drafts up to
    `num_speculative_tokens` tokens per step from the longest suffix of length in [prompt_lookup_min,
    prompt_lookup_max] that appeared earlier in the request (engine_core.spec_decode.ngram_proposer);
    `method` "draft_model" drafts them with a smaller checkpoint `model` (a preset or a folder) of the
    same vocabulary (engine_core.worker.draft_model; its vocabulary and context are checked against the
    target's when the engine is built)."""

    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int = 0  # ngram only
    prompt_lookup_max: int = 0
    model: str | None = None  # draft_model only

    @classmethod
    def from_dict(cls, value: Any) -> "SpeculativeConfig":
        """Check the dict: known keys, the method, k in [1, MAX_SPECULATIVE_TOKENS]; ngram: 1 <= min <= max
        (as in vLLM, a missing prompt_lookup_min / prompt_lookup_max takes the other's value; both missing:
        an error); draft_model: `model` a non-empty string."""
        if isinstance(value, SpeculativeConfig):
            return value
        _need(isinstance(value, dict), "speculative_config",
              "None or a dict like {'method': 'ngram', 'num_speculative_tokens': 3, 'prompt_lookup_max': 4}", value)
        method = check_choice("speculative_config['method']", value.get("method"), _SPEC_METHODS)
        known = ("method", "num_speculative_tokens") + (
            ("prompt_lookup_min", "prompt_lookup_max") if method == "ngram" else ("model",))
        unknown = sorted(str(k) for k in value if k not in known)
        if unknown:
            raise ValueError(f"speculative_config has unknown key(s) {unknown} for method {method!r}; "
                             f"allowed: {list(known)}")
        k = check_int("speculative_config['num_speculative_tokens']", value.get("num_speculative_tokens"), 1,
                      MAX_SPECULATIVE_TOKENS)
        if method == "draft_model":
            model = value.get("model")
            if isinstance(model, os.PathLike):
                model = os.fspath(model)
            _need(isinstance(model, str) and bool(model), "speculative_config['model']",
                  "a preset name or a model folder with the target's vocabulary", model)
            return cls(method, k, model=model)
        lo, hi = value.get("prompt_lookup_min"), value.get("prompt_lookup_max")
        if lo is None and hi is None:
            raise ValueError("speculative_config needs prompt_lookup_min or prompt_lookup_max (an int >= 1) with "
                             "method 'ngram'")
        lo = check_int("speculative_config['prompt_lookup_min']", hi if lo is None else lo, 1)
        hi = check_int("speculative_config['prompt_lookup_max']", lo if hi is None else hi, lo,
                       hint=f"at least prompt_lookup_min={lo}")
        return cls(method, k, lo, hi)


# vLLM's names: W8A8 int8, online round-to-nearest W4A16 (or W8A16), GPTQ and AWQ checkpoints
QUANTIZATION_METHODS = ("int8", "rtn", "gptq", "awq", "gguf", "fp8", "nf4")
_FP8_OPTIONS = {"weight_strategy": ("tensor", "channel"), "activation_strategy": ("tensor", "token"),
                "activation_scheme": ("dynamic",)}  # the first of each is the default (vLLM's online fp8)
_RTN_BITS = (4, 8)
_RTN_GROUP_SIZES = (32, 64, 128, 256)  # the group sizes torch's int4 kernels take


@dataclass(frozen=True)
class QuantizationConfig:
    """Weight quantization (engine_core/models/quantization): `method` "int8" (W8A8: per-channel int8 weights,
    dynamic per-token int8 activations; bits 8, no groups) or "rtn" (group-wise asymmetric `bits`-bit weights
    with zero points, activations in the model dtype; `quantization_config={"bits": 4, "group_size": 128}`
    are the defaults), or "gptq" / "awq" (a pre-quantized checkpoint; its options come from its config.json), or
    "gguf" (the projections' Q4_1 blocks from a GGUF file served as int4), or "fp8" (float8_e4m3fn weights quantized
    at load, dynamic fp8 activations; `quantization_config={"weight_strategy": "tensor" or "channel",
    "activation_strategy": "tensor" or "token"}`, "tensor" both by default, as vLLM's online fp8), or "nf4" (QLoRA's
    NormalFloat4 weights in blocks of 64 with fp32 absmax, quantized at load, dequantized at each GEMM)."""

    method: str
    bits: int
    group_size: int | None  # None: per output channel
    # int8 only: a file of calibrated per-input-channel activation maxima (`python -m engine_core.calibrate
    # --linear-out`) turns on SmoothQuant's migration with strength `alpha`
    smoothquant: str | None = None
    alpha: float = 0.5
    # gptq/awq: bits 0 and group_size None until load_model reads config.json's quantization_config
    # (models/quantization/packed.py); group_size -1 there is one group per row
    desc_act: bool = False  # GPTQ act-order: groups given by g_idx
    zeros_minus_one: bool = False  # GPTQ's original format stores each zero point minus one
    # gguf: the GGUF file whose Q4_1 blocks are served (`quantization_config={"file": PATH}`; the blocks are read
    # by models/quantization/scheme.py, never kept here)
    file: str | None = None
    # fp8 (models/quantization/fp8.py): one weight scale per "tensor" or "channel", activations per "tensor" or "token"
    weight_strategy: str | None = None
    activation_strategy: str | None = None

    @classmethod
    def of(cls, quantization: Any, quantization_config: Any) -> "QuantizationConfig | None":
        """Check `quantization` and its `quantization_config` dict; None when quantization is None."""
        if quantization is None:
            _need(quantization_config is None, "quantization_config", "None when quantization is None",
                  quantization_config)
            return None
        method = check_choice("quantization", quantization, QUANTIZATION_METHODS)
        if method in ("gptq", "awq"):
            _need(quantization_config is None, "quantization_config", f"None with quantization={method!r} (the "
                  f"checkpoint's config.json carries its quantization_config)", quantization_config)
            return cls(method, 0, None)
        if method == "gguf":
            path = quantization_config.get("file") if isinstance(quantization_config, dict) else None
            _need(isinstance(quantization_config, dict) and set(quantization_config) == {"file"} and isinstance(
                path, (str, os.PathLike)) and Path(path).is_file(), "quantization_config",
                  "{'file': PATH} with quantization='gguf' (an existing GGUF file of the same model, its projections "
                  "in Q4_1: engine_core.presets_real.gguf_path() for smollm2-135m-instruct)", quantization_config)
            return cls(method, 4, 32, file=str(path))
        options = {} if quantization_config is None else quantization_config
        _need(isinstance(options, dict), "quantization_config", "None or a dict like {'bits': 4, 'group_size': 128}",
              options)
        known = {"rtn": ("bits", "group_size"), "int8": ("smoothquant", "alpha"), "fp8": tuple(_FP8_OPTIONS),
                 "nf4": ()}[method]
        unknown = sorted(str(k) for k in options if k not in known)
        if unknown:
            raise ValueError(f"quantization_config has unknown key(s) {unknown} for quantization={method!r}; "
                             f"allowed: {list(known)}")
        if method == "int8":
            return cls._int8(options)
        if method == "nf4":  # QLoRA's NormalFloat4, blocks of 64 along each row (models/quantization/nf4.py)
            return cls("nf4", 4, 64)
        if method == "fp8":
            chosen = {k: check_choice(f"quantization_config[{k!r}]", options.get(k, allowed[0]), allowed)
                      for k, allowed in _FP8_OPTIONS.items()}
            return cls("fp8", 8, None, weight_strategy=chosen["weight_strategy"],
                       activation_strategy=chosen["activation_strategy"])
        bits = options.get("bits", 4)
        _need(bits in _RTN_BITS and check_int("quantization_config['bits']", bits) == bits,
              "quantization_config['bits']", f"one of {_RTN_BITS}", bits)
        group_size = options.get("group_size", 128)
        _need(group_size in _RTN_GROUP_SIZES and check_int("quantization_config['group_size']", group_size) > 0,
              "quantization_config['group_size']", f"one of {_RTN_GROUP_SIZES}", group_size)
        return cls(method, bits, group_size)

    @classmethod
    def _int8(cls, options: dict) -> "QuantizationConfig":
        path = options.get("smoothquant")
        if path is None:
            _need("alpha" not in options, "quantization_config['alpha']", "set only with 'smoothquant' (a file of "
                  "calibrated activation maxima)", options.get("alpha"))
            return cls("int8", 8, None)
        _need(isinstance(path, (str, os.PathLike)) and Path(path).is_file(), "quantization_config['smoothquant']",
              "an existing file of activation maxima (python -m engine_core.calibrate --linear-out FILE)", path)
        alpha = check_real("quantization_config['alpha']", options.get("alpha", 0.5), 0.0, 1.0)
        return cls("int8", 8, None, str(path), alpha)


def _host_memory_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


@dataclass
class EngineConfig:
    """Everything `LLM(...)` / `LLMEngine(...)` accept besides the model.

    `None` means "derive it": `max_model_len` from the checkpoint, `num_gpu_blocks`
    from `gpu_memory_utilization` (CUDA) or `kv_cache_memory_bytes` / `cpu_memory_bytes` (CPU).
    """

    model: str = "tiny-llama"
    block_size: int = 16
    num_gpu_blocks: int | None = None
    gpu_memory_utilization: float = 0.9
    kv_cache_memory_bytes: int | None = None  # CPU budget for the KV cache; default 1 GiB
    # CPU: one limit for the weights (as their scheme stores them), a forward's activation peak and the KV cache
    # together (CUDA's memory x gpu_memory_utilization); the KV cache gets what is left. None: kv_cache_memory_bytes
    cpu_memory_bytes: int | None = None
    max_model_len: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int = 0  # 0: no per-request cap beyond the budget
    enable_prefix_caching: bool = False
    preemption_mode: str = "auto"
    # admission order: "fcfs", or "priority" (lower `priority` first, then arrival; requests with a
    # priority other than 0 are an error under fcfs, as in vLLM)
    scheduling_policy: str = "fcfs"
    swap_space: float = 4.0  # GiB of CPU memory for swapped-out KV blocks
    # CPU offload tier for finished sessions' KV (engine_core/worker/kv_offload.py), in bytes; 0 = off. Needs
    # enable_prefix_caching (keyed by its block hashes) and one process; at most the host's memory
    kv_offload_bytes: int = 0
    # Token eviction (docs/long_context.md): "streaming_llm" (attention sinks + a recent window) or "h2o" (heavy
    # hitters by accumulated attention + a recent window), at block granularity, each request holding at most
    # kv_budget_tokens of KV (whole blocks) at the start of a step; None = off (every token kept)
    kv_eviction: str | None = None
    kv_budget_tokens: int | None = None
    kv_sink_tokens: int = 0  # the first tokens, always kept (rounded up to whole blocks)
    kv_recent_tokens: int | None = None  # the last tokens, always kept (whole blocks); None = one block
    # Cost-model rates for choose_preemption_mode; None = documented default of the device.
    prefill_flops_per_s: float | None = None
    swap_bandwidth_bytes_per_s: float | None = None
    # fp8 KV cache (docs/fp8_kv_cache.md): "fp8" (= "fp8_e4m3") or "fp8_e5m2", or symmetric "int8" (the CPU
    # backends only; the Triton kernels refuse it before the weights load). Scales: dynamic from the first
    # batch (calculate_kv_scales), a calibration file (kv_cache_scales, from python -m engine_core.calibrate),
    # else the checkpoint's k_scale/v_scale, else 1.0; per KV head with kv_scales_per_head.
    kv_cache_dtype: str = "auto"
    calculate_kv_scales: bool = False
    kv_cache_scales: str | None = None
    kv_scales_per_head: bool = False
    # Multi-LoRA (engine_core/lora): max_loras GPU slots, ranks up to max_lora_rank, a host cache of
    # max_cpu_loras loaded adapters (None: max_loras). Like vLLM, the three are accepted and ignored
    # without enable_lora; a request with a lora_request is then an error.
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    # Parallelism (docs/parallelism.md): tensor_parallel_size x pipeline_parallel_size worker
    # processes; shapes the model must divide are checked before any process starts
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    distributed_executor_backend: str | None = None
    # scheduled steps in flight at once (vLLM v1's batch queue): None = pipeline_parallel_size, so stage 0 runs
    # step n + 1 while stage 1 runs step n; 1 = one step at a time (faster when the stages share too few cores:
    # docs/benchmarks.md, "Pipeline stages overlapping")
    max_concurrent_batches: int | None = None
    # machines the ranks span (vLLM's nnodes): this engine is node 0; the others run
    # `python -m engine_core.executor.launch` (MASTER_ADDR, MASTER_PORT, NODE_RANK)
    nnodes: int = 1
    device: str = "auto"
    dtype: str = "auto"
    attention_backend: str = "auto"
    enforce_eager: bool = False  # True: no CUDA graphs
    seed: int = 0
    # Speculative decoding (vLLM's dict; parsed into a SpeculativeConfig): None = off
    speculative_config: dict | SpeculativeConfig | None = None
    # Weight quantization (docs/weight_quantization.md): None, "int8" (W8A8), "rtn" (W4A16 group-wise), "fp8" (W8A8
    # float8_e4m3fn), "gptq" / "awq" / "gguf" (pre-quantized); options in quantization_config ({"bits": 4 or 8,
    # "group_size": 32 ... 256} for "rtn"). The LM head stays dense.
    quantization: str | None = None
    quantization_config: dict | None = None

    def __post_init__(self) -> None:
        """Every argument checked for type and range once, here (engine_core.validation's rules)."""
        if isinstance(self.model, os.PathLike):
            self.model = os.fspath(self.model)
        _need(isinstance(self.model, str) and bool(self.model), "model", "a preset name or a model folder", self.model)
        self.block_size = check_int("block_size", self.block_size, 1, 256)
        self.num_gpu_blocks = check_int("num_gpu_blocks", self.num_gpu_blocks, 1, optional=True)
        self.gpu_memory_utilization = check_real("gpu_memory_utilization", self.gpu_memory_utilization, 0.0, 1.0,
                                                 lo_open=True)
        self.kv_cache_memory_bytes = check_int("kv_cache_memory_bytes", self.kv_cache_memory_bytes, 1, optional=True)
        self.cpu_memory_bytes = check_int("cpu_memory_bytes", self.cpu_memory_bytes, 1, optional=True)
        _need(self.cpu_memory_bytes is None or self.kv_cache_memory_bytes is None, "cpu_memory_bytes",
              "None when kv_cache_memory_bytes is given (a total budget and a KV-only one are alternatives)",
              self.cpu_memory_bytes)
        self.max_model_len = check_int("max_model_len", self.max_model_len, 1, optional=True)
        self.max_num_seqs = check_int("max_num_seqs", self.max_num_seqs, 1)
        self.max_num_batched_tokens = check_int("max_num_batched_tokens", self.max_num_batched_tokens, 1)
        for name in ("enable_chunked_prefill", "enable_prefix_caching", "calculate_kv_scales", "enforce_eager"):
            setattr(self, name, check_bool(name, getattr(self, name)))
        self.long_prefill_token_threshold = check_int("long_prefill_token_threshold",
                                                      self.long_prefill_token_threshold, 0, hint="0 = off")
        self.preemption_mode = check_choice("preemption_mode", self.preemption_mode, _PREEMPTION_MODES)
        self.scheduling_policy = check_choice("scheduling_policy", self.scheduling_policy, SCHEDULING_POLICIES)
        self.swap_space = check_real("swap_space", self.swap_space, 0.0, hint="GiB")
        self.kv_offload_bytes = check_int("kv_offload_bytes", self.kv_offload_bytes, 0, _host_memory_bytes(),
                                          hint="the CPU offload tier, at most the host's memory; 0 = off")
        for name in ("prefill_flops_per_s", "swap_bandwidth_bytes_per_s"):
            setattr(self, name, check_real(name, getattr(self, name), 0.0, lo_open=True, optional=True))
        self.kv_cache_dtype = check_choice("kv_cache_dtype", self.kv_cache_dtype, KV_CACHE_DTYPES)
        self._check_kv_scales()
        self.enable_lora = check_bool("enable_lora", self.enable_lora)
        self.max_loras = check_int("max_loras", self.max_loras, 1, hint="GPU slots: distinct adapters running at once")
        self.max_lora_rank = check_int("max_lora_rank", self.max_lora_rank, 1)
        self.max_cpu_loras = check_int("max_cpu_loras", self.max_cpu_loras, self.max_loras, optional=True,
                                       hint=f"max_loras={self.max_loras}: the host cache holds every slot's adapter; "
                                            f"None = max_loras")
        self._check_parallel()
        if isinstance(self.device, torch.device):
            self.device = str(self.device)
        _need(isinstance(self.device, str) and re.fullmatch(r"auto|cpu|cuda(:\d+)?", self.device) is not None,
              "device", "'auto', 'cpu', 'cuda' or 'cuda:N'", self.device)
        self.dtype = check_choice("dtype", self.dtype, _DTYPES)
        self.attention_backend = check_choice("attention_backend", self.attention_backend, _ATTENTION_BACKENDS)
        self.seed = check_int("seed", self.seed, *SEED_RANGE)
        if self.speculative_config is not None:
            self.speculative_config = SpeculativeConfig.from_dict(self.speculative_config)
            _need(self.world_size == 1, "speculative_config",
                  f"None with tensor_parallel_size x pipeline_parallel_size = {self.world_size} > 1 (the workers do "
                  f"not verify drafts yet)", self.speculative_config)

        self.quant_config: QuantizationConfig | None = QuantizationConfig.of(self.quantization,
                                                                             self.quantization_config)
        _need(self.quantization is None or self.world_size == 1, "quantization",
              f"None with tensor_parallel_size x pipeline_parallel_size = {self.world_size} > 1 (quantized shards "
              f"are not tested yet)", self.quantization)
        self._check_kv_eviction()

    def _check_kv_eviction(self) -> None:
        """The eviction settings, in whole blocks: a budget of at least sinks + recent + the block being written."""
        if self.kv_eviction is not None:
            self.kv_eviction = check_choice("kv_eviction", self.kv_eviction, KV_EVICTION_POLICIES)
        else:
            for name in ("kv_budget_tokens", "kv_recent_tokens"):
                _need(getattr(self, name) is None, name, "None without kv_eviction", getattr(self, name))
            _need(self.kv_sink_tokens == 0, "kv_sink_tokens", "0 without kv_eviction", self.kv_sink_tokens)
            return
        bs = self.block_size
        self.kv_sink_tokens = check_int("kv_sink_tokens", self.kv_sink_tokens, 0)
        self.kv_recent_tokens = check_int("kv_recent_tokens", self.kv_recent_tokens, 1, optional=True,
                                          hint="None = one block")
        sinks = -(-self.kv_sink_tokens // bs)
        recent = 1 if self.kv_recent_tokens is None else -(-self.kv_recent_tokens // bs)
        least = (sinks + recent + 1) * bs
        self.kv_budget_tokens = check_int(
            "kv_budget_tokens", self.kv_budget_tokens, least,
            hint=f"whole blocks of {bs}: the {sinks} sink block(s), the {recent} recent block(s) and the block being "
                 f"written need at least {least}")
        _need(not self.enable_prefix_caching, "enable_prefix_caching",
              "False with kv_eviction (a block computed after an eviction attended to part of its prefix: its hash "
              "no longer names its KV)", self.enable_prefix_caching)
        _need(self.speculative_config is None, "speculative_config",
              "None with kv_eviction (drafts would be verified over evicted blocks)", self.speculative_config)
        _need(self.world_size == 1, "kv_eviction",
              f"None with tensor_parallel_size x pipeline_parallel_size = {self.world_size} > 1", self.kv_eviction)
        _need(self.kv_eviction != "h2o" or self.attention_backend in ("auto", "torch"), "attention_backend",
              "'auto' or 'torch' with kv_eviction='h2o' (only the torch path sums the attention each block gets)",
              self.attention_backend)

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    def _check_parallel(self) -> None:
        """Sizes, the backend, and the features a sharded engine does not have (refused, not ignored)."""
        self.tensor_parallel_size = check_int("tensor_parallel_size", self.tensor_parallel_size, 1)
        self.pipeline_parallel_size = check_int("pipeline_parallel_size", self.pipeline_parallel_size, 1)
        self.nnodes = check_int("nnodes", self.nnodes, 1)
        self.max_concurrent_batches = check_int(
            "max_concurrent_batches", self.max_concurrent_batches, 1, self.pipeline_parallel_size, optional=True,
            hint="None = pipeline_parallel_size; more than one step per stage cannot be in flight")
        _need(self.world_size % self.nnodes == 0, "nnodes",
              f"a divisor of tensor_parallel_size x pipeline_parallel_size = {self.world_size} (every node hosts as "
              f"many ranks)", self.nnodes)
        backend = self.distributed_executor_backend
        _need(backend in _EXECUTOR_BACKENDS and (backend is None or isinstance(backend, str)),
              "distributed_executor_backend", f"one of {list(_EXECUTOR_BACKENDS)}", backend)
        if self.world_size == 1:
            return
        _need(backend != "uni", "distributed_executor_backend",
              f"'mp' or None with tensor_parallel_size x pipeline_parallel_size = {self.world_size} > 1 ('uni' runs "
              f"one process)", backend)
        _need(not self.enable_lora, "enable_lora",
              f"False with tensor_parallel_size x pipeline_parallel_size = {self.world_size} > 1 (adapter slots are "
              f"not sharded yet)", self.enable_lora)
        _need(self.kv_cache_dtype == "auto", "kv_cache_dtype",
              f"'auto' with tensor_parallel_size x pipeline_parallel_size = {self.world_size} > 1 (fp8 scales are "
              f"per layer and KV head of the whole model, not sharded yet)", self.kv_cache_dtype)

    def _check_kv_scales(self) -> None:
        """The fp8 scale options: booleans, a path that exists, one source at a time, an fp8 cache for any."""
        _need(isinstance(self.calculate_kv_scales, bool), "calculate_kv_scales", "a bool", self.calculate_kv_scales)
        _need(isinstance(self.kv_scales_per_head, bool), "kv_scales_per_head", "a bool", self.kv_scales_per_head)
        path = self.kv_cache_scales
        _need(path is None or (isinstance(path, (str, os.PathLike)) and os.path.isfile(path)), "kv_cache_scales",
              "None or the path of an existing scales file (python -m engine_core.calibrate writes one)", path)
        _need(not (self.calculate_kv_scales and path is not None), "calculate_kv_scales",
              "False when kv_cache_scales is given (dynamic and calibrated scales are alternatives)",
              self.calculate_kv_scales)
        if self.kv_cache_dtype == "auto":
            for name in ("calculate_kv_scales", "kv_cache_scales", "kv_scales_per_head"):
                _need(getattr(self, name) in (False, None), name,
                      f"unset with kv_cache_dtype='auto' (scales only apply to an fp8 or int8 cache: kv_cache_dtype one of "
                      f"{KV_CACHE_DTYPES[1:]})", getattr(self, name))

    @classmethod
    def from_kwargs(cls, model: str, **kwargs: Any) -> "EngineConfig":
        """Build from `LLM(model, **kwargs)`; an unknown keyword is an error that lists the known ones."""
        known = {f.name for f in fields(cls)} - {"model"}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise ValueError(f"unknown engine argument(s) {unknown}; allowed: {sorted(known)}")
        return cls(model=model, **kwargs)

    @property
    def torch_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    def torch_dtype(self, checkpoint_dtype: torch.dtype | None = None) -> torch.dtype:
        """`auto`: float32 on CPU (exact comparisons with Hugging Face), the checkpoint's dtype on CUDA."""
        explicit = _DTYPES[self.dtype]
        if explicit is not None:
            return explicit
        if self.torch_device.type == "cpu":
            return torch.float32
        return checkpoint_dtype if checkpoint_dtype in (torch.float16, torch.bfloat16) else torch.bfloat16


@dataclass(frozen=True)
class ResolvedConfig:
    """Every "derive it" value of an EngineConfig, decided once when the engine is built: the
    scheduler, the model runner and the kernels read these, never the `auto`s again."""

    engine: EngineConfig  # the user's arguments, as given
    device: torch.device
    dtype: torch.dtype  # weights and activations
    kv_cache_dtype: torch.dtype  # KV storage: the model dtype, float8_e4m3fn, float8_e5m2 or int8
    max_model_len: int
    max_num_batched_tokens: int  # without chunked prefill, raised to max_model_len (any prompt must fit one step)

    @classmethod
    def resolve(cls, config: EngineConfig, max_position_embeddings: int,
                checkpoint_dtype: torch.dtype | None) -> "ResolvedConfig":
        """Against the checkpoint's context limit and stored dtype (models.config.ModelConfig has both).
        Raises ValueError naming the parameter when the machine or the checkpoint cannot honour it."""
        device = config.torch_device
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"device must be 'cpu' or 'auto' on a machine without CUDA, got {config.device!r}")
        if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
            raise ValueError(f"device must name one of the {torch.cuda.device_count()} CUDA device(s), "
                             f"got {config.device!r}")
        max_model_len = _resolve_max_model_len(config.max_model_len, max_position_embeddings)
        return cls._of(config, device, config.torch_dtype(checkpoint_dtype), max_model_len)

    @classmethod
    def model_free(cls, config: EngineConfig) -> "ResolvedConfig":
        """For a Scheduler with no model behind it (scheduler tests, lab experiments): fp32 on the CPU;
        config.max_model_len must be given."""
        _need(isinstance(config.max_model_len, int), "max_model_len", "an int when there is no model",
              config.max_model_len)
        return cls._of(config, torch.device("cpu"), torch.float32, config.max_model_len)

    @classmethod
    def _of(cls, config: EngineConfig, device: torch.device, dtype: torch.dtype,
            max_model_len: int) -> "ResolvedConfig":
        budget = config.max_num_batched_tokens
        return cls(engine=config, device=device, dtype=dtype,
                   kv_cache_dtype=kv_storage_dtype(config.kv_cache_dtype) or dtype,
                   max_model_len=max_model_len,
                   max_num_batched_tokens=budget if config.enable_chunked_prefill else max(budget, max_model_len))


def _resolve_max_model_len(requested: int | None, limit: int) -> int:
    if requested is None:
        return limit
    if requested > limit:
        raise ValueError(f"max_model_len must be <= the checkpoint's max_position_embeddings={limit}, "
                         f"got {requested}")
    return requested


@dataclass(frozen=True)
class KVCacheConfig:
    """The KV cache the model runner sized from its memory budget: blocks on the device and in the
    CPU swap pool (the scheduler's whole world), and the bytes one block takes."""

    num_gpu_blocks: int
    num_cpu_blocks: int
    block_bytes: int  # K and V of block_size tokens, every layer

    def __post_init__(self) -> None:
        _need(isinstance(self.num_gpu_blocks, int) and self.num_gpu_blocks >= 1, "num_gpu_blocks", "an int >= 1",
              self.num_gpu_blocks)
        _need(isinstance(self.num_cpu_blocks, int) and self.num_cpu_blocks >= 0, "num_cpu_blocks", "an int >= 0",
              self.num_cpu_blocks)
