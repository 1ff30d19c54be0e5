"""LLMEngine: requests in, one scheduler step + one forward per `step()`, RequestOutputs out.

Built from an EngineConfig in this order: resolve the model folder, read config.json, fix
max_model_len (the checkpoint's max_position_embeddings unless set; larger is an error), load
the weights, size the KV cache (explicit num_gpu_blocks; on CUDA, free memory after a warm-up
forward times gpu_memory_utilization; on CPU, kv_cache_memory_bytes, default 1 GiB), then build
the KV tensors, the model runner and the Scheduler. Every add_request check runs before any
state changes, so a bad request is rejected without disturbing the others.
"""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

import kernels
from engine_core import memory
from engine_core.config import EngineConfig
from engine_core.cuda_graphs import DecodeGraphs
from engine_core.kv_cache import KVCache
from engine_core.kv_cache_manager import cdiv
from engine_core.model_runner import ModelRunner
from engine_core.models.attention import AttentionMetadata
from engine_core.models.llama import LlamaArgs, LlamaForCausalLM, load_model
from engine_core.models.loader import read_config, read_eos_token_ids
from engine_core.presets import resolve_model
from engine_core.request import CompletionOutput, Request, RequestOutput, RequestStatus, SamplingParams
from engine_core.sampler import Sampler
from engine_core.scheduler import Scheduler

DEFAULT_CPU_KV_BYTES = 2**30


@dataclass
class StepInfo:
    """What the last step did: the demo plots these over time."""

    num_prefill_tokens: int = 0  # prompt (or recomputed) tokens computed this step
    num_decode_tokens: int = 0  # one-token steps of requests that already had output
    num_seqs: int = 0
    kv_cache_usage: float = 0.0
    duration_s: float = 0.0


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        path = resolve_model(config.model)
        hf_config = read_config(path)
        args = LlamaArgs.from_config(hf_config, source=str(path / "config.json"))
        device = config.torch_device
        kernels.resolve_backend(config.attention_backend, device)  # fail now, not at the first step
        ckpt_dtype = getattr(torch, str(hf_config.get("dtype") or hf_config.get("torch_dtype") or "float32"), None)
        dtype = config.torch_dtype(ckpt_dtype if isinstance(ckpt_dtype, torch.dtype) else None)
        max_model_len = _resolve_max_model_len(config.max_model_len, args)
        args.check_max_model_len(max_model_len)
        self.model_path = path
        self.args = args
        self.device = device
        self.dtype = dtype
        self.model: LlamaForCausalLM = load_model(path, hf_config, dtype, device, max_positions=max_model_len)
        self.model_spec = memory.ModelSpec.of(hf_config)
        self.kv_dtype = torch.float8_e4m3fn if config.kv_cache_dtype == "fp8_e4m3" else dtype
        block_bytes = memory.kv_cache_bytes_per_token(self.model_spec, self.kv_dtype) * config.block_size
        config = dataclasses.replace(config, max_model_len=max_model_len)
        num_gpu_blocks = config.num_gpu_blocks or self._profile_num_gpu_blocks(config, block_bytes)
        # A swap pool larger than the device cache could never fill: cap it there.
        num_cpu_blocks = min(int(config.swap_space * 2**30) // block_bytes, num_gpu_blocks)
        self.config = config
        self.kv_cache = KVCache(args.num_layers, num_gpu_blocks, config.block_size, args.num_kv_heads, args.head_dim,
                                dtype, device, config.kv_cache_dtype, num_cpu_blocks, config.calculate_kv_scales)
        graphs = None
        if device.type == "cuda" and not config.enforce_eager:
            graphs = DecodeGraphs(self.model, self.kv_cache, config.max_num_seqs,
                                  cdiv(max_model_len, config.block_size), device, config.attention_backend)
        self.runner = ModelRunner(self.model, self.kv_cache, Sampler(config.seed), device,
                                  config.attention_backend, graphs)
        self.scheduler = Scheduler(config, num_gpu_blocks, num_cpu_blocks, self.model_spec, self.kv_dtype)
        self.tokenizer = _load_tokenizer(path)
        self.eos_token_ids = read_eos_token_ids(path, hf_config)
        self.requests: dict[str, tuple[Request, str | None]] = {}  # unfinished: request, prompt text
        self.last_step = StepInfo()
        self._counters = {"num_steps": 0, "num_generated_tokens": 0, "step_time_s": 0.0}

    @classmethod
    def from_kwargs(cls, model: str, **kwargs: Any) -> "LLMEngine":
        return cls(EngineConfig.from_kwargs(model, **kwargs))

    @property
    def vocab_size(self) -> int:
        return self.args.vocab_size

    # ---- requests ------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: str | list[int], sampling_params: SamplingParams | None = None,
                    priority: int = 0, arrival_time: float | None = None) -> Request:
        """Validate, then queue. Raises ValueError naming the parameter; nothing changes on error."""
        if not isinstance(request_id, str) or not request_id:
            raise ValueError(f"request_id must be a non-empty str, got {request_id!r}")
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use by an unfinished request")
        params = SamplingParams() if sampling_params is None else sampling_params
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params must be a SamplingParams or None, got {type(params).__name__}")
        token_ids = self._tokenize(prompt)
        limit = self.config.max_model_len
        if len(token_ids) + 1 > limit:
            raise ValueError(f"prompt has {len(token_ids)} tokens; with the first generated token it must fit "
                             f"max_model_len={limit}, so at most {limit - 1} prompt tokens are allowed")
        if not params.ignore_eos and len(self.eos_token_ids) > 1:  # extra EOS ids stop like stop tokens
            params = dataclasses.replace(params, stop_token_ids=params.stop_token_ids + self.eos_token_ids[1:])
        request = Request(request_id, token_ids, params, eos_token_id=self.eos_token_ids[0] if self.eos_token_ids
                          else None, arrival_time=arrival_time, priority=priority)
        self.scheduler.add_request(request)  # may reject (never fits the KV cache) before queuing
        self.requests[request_id] = (request, prompt if isinstance(prompt, str) else None)
        return request

    def _tokenize(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(f"prompt is text but model folder {str(self.model_path)!r} has no tokenizer; "
                                 f"pass a list of token ids")
            token_ids = self.tokenizer.encode(prompt)
        elif isinstance(prompt, (list, tuple)) and all(isinstance(t, int) for t in prompt):
            token_ids = list(prompt)
        else:
            raise ValueError(f"prompt must be a str or a list of int token ids, got {type(prompt).__name__}")
        if not token_ids:
            raise ValueError("prompt must have at least 1 token, got an empty prompt")
        bad = next((t for t in token_ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise ValueError(f"prompt token ids must be in [0, vocab_size={self.vocab_size}), got {bad}")
        return token_ids

    def abort_request(self, request_id: str) -> None:
        """Finish the request as aborted and free its blocks; unknown or finished ids are ignored."""
        if self.requests.pop(request_id, None) is not None:
            self.scheduler.finish_requests([request_id], RequestStatus.FINISHED_ABORTED)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    # ---- one step ------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedule, run the forward, sample, update. Returns an output for every request that got
        a token this step (finished ones have `.finished` and, with a tokenizer, `.outputs[0].text`)."""
        t0 = time.perf_counter()
        scheduled = self.scheduler.schedule()
        sampled = self.runner.execute(scheduled)
        got = self.scheduler.update_from_output(scheduled, sampled)
        outputs = [self._output(r) for r in got]
        for r in got:
            if r.is_finished:
                self.requests.pop(r.request_id, None)
        dt = time.perf_counter() - t0
        decode = sum(1 for c in scheduled.scheduled if c.num_tokens == 1 and c.request.num_output_tokens > 1)
        self.last_step = StepInfo(scheduled.total_num_scheduled_tokens - decode, decode, len(scheduled.scheduled),
                                  self.scheduler.kv_cache_manager.usage, dt)
        self._counters["num_steps"] += 1
        self._counters["num_generated_tokens"] += len(got)
        self._counters["step_time_s"] += dt
        return outputs

    def _output(self, request: Request) -> RequestOutput:
        prompt = self.requests[request.request_id][1] if request.request_id in self.requests else None
        text = None
        if request.is_finished and self.tokenizer is not None:  # decode once, at the end
            text = self.tokenizer.decode(request.output_token_ids, skip_special_tokens=True)
        completion = CompletionOutput(0, list(request.output_token_ids), text, request.status.finish_reason)
        return RequestOutput(request.request_id, prompt, request.prompt_token_ids, [completion], request.is_finished,
                             request.metrics, request.num_cached_tokens)

    def stats(self) -> dict[str, float]:
        """Scheduler gauges/counters (engine_core.metrics.STAT_DOCS) plus engine throughput counters."""
        c = self._counters
        return {**self.scheduler.stats(), **c,
                "generation_tokens_per_s": c["num_generated_tokens"] / c["step_time_s"] if c["step_time_s"] else 0.0}

    # ---- KV cache sizing -----------------------------------------------------------------
    def _profile_num_gpu_blocks(self, config: EngineConfig, block_bytes: int) -> int:
        """CPU: the kv_cache_memory_bytes budget. CUDA: gpu_memory_utilization of the device minus
        the peak memory of a warm-up forward of max_num_batched_tokens tokens."""
        if self.device.type != "cuda":
            budget = config.kv_cache_memory_bytes or DEFAULT_CPU_KV_BYTES
        else:
            budget = int(torch.cuda.get_device_properties(self.device).total_memory
                         * config.gpu_memory_utilization) - self._peak_forward_bytes(config)
        blocks = budget // block_bytes
        if blocks < 1:
            raise ValueError(f"no room for the KV cache: a budget of {budget} bytes holds {blocks} blocks of "
                             f"{block_bytes} bytes; raise gpu_memory_utilization / kv_cache_memory_bytes or set "
                             f"num_gpu_blocks")
        return int(blocks)

    @torch.inference_mode()
    def _peak_forward_bytes(self, config: EngineConfig) -> int:
        n = min(config.max_num_batched_tokens, config.max_model_len)
        a = self.args
        scratch = KVCache(a.num_layers, cdiv(n, config.block_size), config.block_size, a.num_kv_heads, a.head_dim,
                          self.dtype, self.device, config.kv_cache_dtype)
        meta = AttentionMetadata(
            slot_mapping=torch.arange(n, device=self.device),
            block_tables=torch.arange(cdiv(n, config.block_size), dtype=torch.int32, device=self.device)[None],
            seq_lens=torch.tensor([n], dtype=torch.int32, device=self.device),
            query_start_loc=torch.tensor([0, n], dtype=torch.int32, device=self.device),
            num_decode_seqs=int(n == 1), kv_cache_dtype=config.kv_cache_dtype, backend=config.attention_backend)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        hidden = self.model(torch.zeros(n, dtype=torch.int64, device=self.device),
                            torch.arange(n, device=self.device), scratch, meta)
        self.model.compute_logits(hidden[-config.max_num_seqs:])
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device)
        del scratch, hidden
        torch.cuda.empty_cache()
        return peak


def _resolve_max_model_len(requested: int | None, args: LlamaArgs) -> int:
    limit = args.max_position_embeddings
    if requested is None:
        return limit
    if requested > limit:
        raise ValueError(f"max_model_len must be <= the checkpoint's max_position_embeddings={limit}, "
                         f"got {requested}")
    return requested


def _load_tokenizer(path: Path) -> Any:
    """The folder's tokenizer, or None when it has none (token-id prompts only)."""
    if not ((path / "tokenizer.json").is_file() or (path / "tokenizer_config.json").is_file()):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)
