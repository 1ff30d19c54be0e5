"""Every kind of bad input in docs/bad_inputs.md, each a case here with the same id: a ValueError
naming the parameter (or the file and the field), raised before any state changes. After each
case a shared engine (the one the bad request went to, for request-level cases) is empty, its
pool whole, and its next generate equals a fresh engine's; engine arguments and checkpoints fail
before an engine exists.
"""
from __future__ import annotations

import functools
import json
import math
import re
import shutil
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest
import torch
from engine_helpers import one_torch_thread, pool_is_whole
from safetensors.torch import load_file, save_file

from engine_core import LLM, LoRARequest, SamplingParams
from engine_core.lora.presets import adapter_path
from engine_core.presets import preset_path

pytestmark = pytest.mark.usefixtures(one_torch_thread.__name__)
ROOT = Path(__file__).resolve().parents[2]
GREEDY = dict(temperature=0.0, ignore_eos=True)
CHECK_PROMPTS = [[5, 6, 7], "hi", {"prompt_token_ids": [9, 9]}]


def _mutated_params() -> SamplingParams:
    sp = SamplingParams(max_tokens=4)
    sp.temperature = "hot"  # changed after construction: add_request checks again
    return sp


def _gen(prompts: Any, params: Any = None) -> Callable[[LLM], Any]:
    return lambda llm: llm.generate(prompts, params, use_tqdm=False)


def _add(prompt: Any = (5, 6), request_id: Any = "x", sampling_params: Any = None, **kw: Any) -> Callable[[LLM], Any]:
    def call(llm: LLM) -> Any:
        return llm.engine.add_request(request_id, list(prompt) if isinstance(prompt, tuple) else prompt,
                                      sampling_params, **kw)
    return call


def _sp(**kw: Any) -> Callable[[LLM], Any]:
    return lambda llm: SamplingParams(**kw)


def _duplicate(llm: LLM) -> None:
    llm.engine.add_request("dup", [5])
    try:
        llm.engine.add_request("dup", [6])
    finally:
        llm.engine.abort_request("dup")


REQUEST_CASES: list[tuple[str, Callable[[LLM], Any], str]] = [
    ("prompts-none", _gen(None), r"prompts must be one prompt .*got None \(NoneType\)"),
    ("prompts-int", _gen(5), r"prompts must be one prompt .*got 5 \(int\)"),
    ("prompts-bytes", _gen(b"abc"), r"prompts must be .*decode bytes to a str first"),
    ("prompts-numpy-array", _gen(np.array([5, 6])), r"prompts must be .*pass \.tolist\(\)"),
    ("prompts-tensor", _gen(torch.tensor([5, 6])), r"prompts must be .*pass \.tolist\(\)"),
    ("prompts-generator", _gen(p for p in [[5]]), r"prompts must be .*an iterable of prompts: pass a list"),
    ("prompt-bools", _gen([[True, False]]), r"prompt 0: prompt\[0\] must be an int, got True \(bool\)"),
    ("prompt-float-id", _add([5.0]), r"prompt\[0\] must be an int, got 5.0 \(float\)"),
    ("prompt-none-in-list", _gen([[5], None]), r"prompt 1: prompt must be a str, a list of int token ids"),
    ("prompt-id-out-of-vocab", _add([5, 512]), r"prompt token ids must be in \[0, vocab_size=512\), got 512"),
    ("prompt-id-negative", _add([-1]), r"prompt token ids must be in \[0, vocab_size=512\), got -1"),
    ("prompt-empty-ids", _add([]), "prompt must have at least 1 token"),
    ("prompt-empty-text", _add(""), "prompt must have at least 1 token"),
    ("prompt-lone-surrogate", _add("a\ud800b"), "prompt text cannot be tokenized: TypeError"),
    ("prompt-dict-unknown-key", _add({"text": "hi"}), r"prompt as a dict must have exactly one key.*\['text'\]"),
    ("prompt-dict-both-keys", _add({"prompt": "hi", "prompt_token_ids": [5]}), "exactly one key"),
    ("prompt-dict-text-not-str", _add({"prompt": 5}), r"prompt\['prompt'\] must be a str, got 5 \(int\)"),
    ("prompt-dict-ids-str", _add({"prompt_token_ids": "abc"}),
     r"prompt\['prompt_token_ids'\] must be a list of ints, got 'abc' \(str\)"),
    ("prompt-too-long", _add([5] * 2048), "at most 2047 prompt tokens"),
    ("prompt-never-fits", _add([5] * 1000, sampling_params=SamplingParams(max_tokens=100)), "can never fit"),
    ("temperature-str", _sp(temperature="0.5"), r"temperature must be a finite number >= 0 .*got '0.5' \(str\)"),
    ("temperature-nan", _sp(temperature=math.nan), r"temperature must be a finite number >= 0 .*got nan"),
    ("temperature-inf", _sp(temperature=math.inf), r"temperature must be a finite number >= 0 .*got inf"),
    ("temperature-negative", _sp(temperature=-0.1), r"temperature must be a finite number >= 0"),
    ("temperature-bool", _sp(temperature=True), r"temperature must be .*got True \(bool\)"),
    ("max-tokens-zero", _sp(max_tokens=0), r"max_tokens must be an int >= 1, got 0"),
    ("max-tokens-float", _sp(max_tokens=2.0), r"max_tokens must be an int >= 1, got 2.0 \(float\)"),
    ("max-tokens-bool", _sp(max_tokens=True), r"max_tokens must be an int >= 1, got True \(bool\)"),
    ("top-p-zero", _sp(top_p=0.0), r"top_p must be a finite number in \(0, 1\]"),
    ("top-p-nan", _sp(top_p=math.nan), r"top_p must be a finite number in \(0, 1\], got nan"),
    ("top-k-float", _sp(top_k=1.5), r"top_k must be an int >= -1 \(0 or -1 = off\), got 1.5"),
    ("top-k-below-minus-one", _sp(top_k=-2), r"top_k must be an int >= -1"),
    ("seed-str", _sp(seed="7"), r"seed must be None or an int .*got '7' \(str\)"),
    ("seed-too-large", _sp(seed=2**64), r"seed must be None or an int in \[-9223372036854775808, 18446744073709551615\]"),
    ("stop-token-ids-str", _sp(stop_token_ids="abc"), r"stop_token_ids must be a list of ints >= 0, got 'abc'"),
    ("stop-token-ids-int", _sp(stop_token_ids=5), r"stop_token_ids must be a list of ints >= 0, got 5 \(int\)"),
    ("stop-token-ids-negative", _sp(stop_token_ids=[3, -1]), r"stop_token_ids\[1\] must be an int >= 0, got -1"),
    ("ignore-eos-str", _sp(ignore_eos="no"), r"ignore_eos must be True or False, got 'no' \(str\)"),
    ("sampling-params-mutated", _gen([[5]], _mutated_params()), r"prompt 0: temperature must be .*got 'hot'"),
    ("sampling-params-dict", _gen([[5]], {"temperature": 0}), r"sampling_params must be a SamplingParams, a list"),
    ("sampling-params-count", _gen([[5], [6]], [SamplingParams()]), "a list of 2 \\(one per prompt\\), got 1"),
    ("sampling-params-element", _gen([[5], [6]], [SamplingParams(), "greedy"]),
     r"prompt 1: sampling_params must be a SamplingParams or None, got 'greedy'"),
    ("request-id-empty", _add(request_id=""), r"request_id must be a non-empty str, got ''"),
    ("request-id-int", _add(request_id=7), r"request_id must be a non-empty str, got 7 \(int\)"),
    ("request-id-duplicate", _duplicate, "request_id 'dup' is already in use"),
    ("priority-str", _add(priority="high"), r"priority must be an int \(lower = served first\), got 'high'"),
    ("priority-float", _add(priority=1.5), r"priority must be an int .*got 1.5"),
    ("priority-under-fcfs", _add(priority=-2),
     r"priority must be 0 when priority scheduling is not enabled \(scheduling_policy='fcfs'\), got -2; build the "
     r"engine with scheduling_policy='priority'"),
    ("arrival-time-nan", _add(arrival_time=math.nan), r"arrival_time must be None or a finite number, got nan"),
    ("abort-id-not-str", lambda llm: llm.engine.abort_request(7), r"request_id must be a str or a list of str, got 7 \(int\)"),
    ("lora-without-enable-lora", _add(lora_request=LoRARequest("a", 1, "/x")),
     r"lora_request 'a' given, but the engine was built with enable_lora=False; pass enable_lora=True"),
]

ENGINE_CASES: list[tuple[str, dict[str, Any], str]] = [
    ("enable-prefix-caching-str", dict(enable_prefix_caching="no"), r"enable_prefix_caching must be True or False, got 'no'"),
    ("enable-chunked-prefill-int", dict(enable_chunked_prefill=1), r"enable_chunked_prefill must be True or False, got 1"),
    ("block-size-bool", dict(block_size=True), r"block_size must be an int in \[1, 256\], got True \(bool\)"),
    ("block-size-zero", dict(block_size=0), r"block_size must be an int in \[1, 256\], got 0"),
    ("block-size-float", dict(block_size=16.0), r"block_size must be an int in \[1, 256\], got 16.0"),
    ("swap-space-str", dict(swap_space="4"), r"swap_space must be a finite number >= 0 \(GiB\), got '4' \(str\)"),
    ("swap-space-inf", dict(swap_space=math.inf), r"swap_space must be a finite number >= 0 \(GiB\), got inf"),
    ("swap-space-negative", dict(swap_space=-1), r"swap_space must be a finite number >= 0 \(GiB\), got -1"),
    ("kv-offload-bytes-above-host-memory", dict(kv_offload_bytes=1 << 60),
     r"kv_offload_bytes must be an int in \[0, \d+\] \(the CPU offload tier, at most the host's memory; 0 = off\)"),
    ("kv-offload-without-prefix-caching", dict(kv_offload_bytes=1 << 20),
     r"kv_offload_bytes > 0 needs enable_prefix_caching=True"),
    ("gpu-memory-utilization-nan", dict(gpu_memory_utilization=math.nan), r"gpu_memory_utilization must be a finite number in \(0, 1\]"),
    ("gpu-memory-utilization-above-one", dict(gpu_memory_utilization=1.5), r"gpu_memory_utilization .*got 1.5"),
    ("device-none", dict(device=None), r"device must be 'auto', 'cpu', 'cuda' or 'cuda:N', got None"),
    ("device-unknown", dict(device="tpu"), r"device must be 'auto', 'cpu', 'cuda' or 'cuda:N', got 'tpu'"),
    ("device-missing-cuda", dict(device="cuda:99"), r"device must be .*got 'cuda:99'"),
    ("seed-engine-str", dict(seed="0"), r"seed must be an int in .*got '0' \(str\)"),
    ("seed-engine-float", dict(seed=1.5), r"seed must be an int in .*got 1.5 \(float\)"),
    ("tensor-parallel-size-zero", dict(tensor_parallel_size=0), r"tensor_parallel_size must be an int >= 1, got 0"),
    ("tensor-parallel-size-not-dividing-heads", dict(tensor_parallel_size=3),
     r"tensor_parallel_size=3 must divide the model's num_attention_heads=4"),
    ("pipeline-parallel-size-beyond-layers", dict(pipeline_parallel_size=3),
     r"pipeline_parallel_size=3 must be <= the model's num_hidden_layers=2"),
    ("parallel-bfloat16-on-cpu", dict(tensor_parallel_size=2, device="cpu", dtype="bfloat16"),
     r"dtype must be 'float32' \(or 'auto'\) for a parallel engine on CPU, got torch.bfloat16: gloo has no bfloat16"),
    ("parallel-with-lora", dict(tensor_parallel_size=2, enable_lora=True),
     r"enable_lora must be False with tensor_parallel_size x pipeline_parallel_size = 2 > 1"),
    ("parallel-with-speculation", dict(tensor_parallel_size=2, speculative_config={
        "method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3}),
     r"speculative_config must be None with tensor_parallel_size x pipeline_parallel_size = 2 > 1"),
    ("draft-model-other-vocabulary", dict(speculative_config={
        "method": "draft_model", "num_speculative_tokens": 2, "model": "small-llama"}),
     r"speculative_config\['model'\]='small-llama' has vocab_size 8192; a draft model needs the target's vocabulary"),
    ("draft-model-unknown", dict(speculative_config={
        "method": "draft_model", "num_speculative_tokens": 2, "model": "no-such-draft"}),
     r"speculative_config\['model'\]: model must be an existing checkpoint folder or one of the presets"),
    ("parallel-with-fp8-kv-cache", dict(pipeline_parallel_size=2, kv_cache_dtype="fp8"),
     r"kv_cache_dtype must be 'auto' with tensor_parallel_size x pipeline_parallel_size = 2 > 1"),
    ("nnodes-not-dividing-ranks", dict(tensor_parallel_size=2, pipeline_parallel_size=1, nnodes=3),
     r"nnodes must be a divisor of tensor_parallel_size x pipeline_parallel_size = 2 \(every node hosts as many"),
    ("max-concurrent-batches-beyond-stages", dict(pipeline_parallel_size=2, max_concurrent_batches=3),
     r"max_concurrent_batches must be None or an int in \[1, 2\] \(None = pipeline_parallel_size; more than one "
     r"step per stage cannot be in flight\), got 3"),
    ("executor-backend-unknown", dict(distributed_executor_backend="ray"),
     r"distributed_executor_backend must be one of \[None, 'uni', 'mp'\], got 'ray'"),
    ("executor-backend-uni-with-tp", dict(tensor_parallel_size=2, distributed_executor_backend="uni"),
     r"distributed_executor_backend must be 'mp' or None with tensor_parallel_size x pipeline_parallel_size = 2"),
    ("max-num-seqs-zero", dict(max_num_seqs=0), r"max_num_seqs must be an int >= 1, got 0"),
    ("scheduling-policy-unknown", dict(scheduling_policy="lifo"),
     r"scheduling_policy must be one of \('fcfs', 'priority'\), got 'lifo'"),
    ("max-num-seqs-str", dict(max_num_seqs="8"), r"max_num_seqs must be an int >= 1, got '8' \(str\)"),
    ("max-num-batched-tokens-bool", dict(max_num_batched_tokens=True), r"max_num_batched_tokens must be an int >= 1, got True"),
    ("long-prefill-threshold-negative", dict(long_prefill_token_threshold=-1), r"long_prefill_token_threshold must be an int >= 0 \(0 = off\)"),
    ("preemption-mode-unknown", dict(preemption_mode="fast"), r"preemption_mode must be one of \('auto', 'recompute', 'swap'\)"),
    ("kv-cache-dtype-unknown", dict(kv_cache_dtype="int4"), r"kv_cache_dtype must be one of \('auto', 'fp8', 'fp8_e4m3', 'fp8_e5m2', 'int8'\), got 'int4'"),
    ("dtype-unknown", dict(dtype="float64"), r"dtype must be one of \('auto', 'float32', 'float16', 'bfloat16'\)"),
    ("kv-cache-memory-bytes-float", dict(kv_cache_memory_bytes=1.5e9), r"kv_cache_memory_bytes must be None or an int >= 1, got 1500000000.0"),
    ("num-gpu-blocks-zero", dict(num_gpu_blocks=0), r"num_gpu_blocks must be None or an int >= 1, got 0"),
    ("kv-cache-beyond-memory", dict(device="cpu", kv_cache_memory_bytes=2**50),
     r"cannot allocate the KV cache: 137438953472 blocks of 8192 bytes on cpu .*lower num_gpu_blocks, kv_cache_memory_bytes"),
    ("prefill-flops-nan", dict(prefill_flops_per_s=math.nan), r"prefill_flops_per_s must be None or a finite number > 0, got nan"),
    ("max-model-len-beyond-checkpoint", dict(max_model_len=4096), "max_model_len must be <= the checkpoint's max_position_embeddings=2048"),
    ("unknown-engine-argument", dict(max_seqs=4), r"unknown engine argument\(s\) \['max_seqs'\]"),
    ("model-none", dict(model=None), r"model must be a preset name or a model folder, got None"),
    ("model-unknown", dict(model="no-such-model"), "model must be an existing checkpoint folder or one of the presets"),
    ("enable-lora-str", dict(enable_lora="yes"), r"enable_lora must be True or False, got 'yes' \(str\)"),
    ("max-loras-zero", dict(enable_lora=True, max_loras=0), r"max_loras must be an int >= 1 \(GPU slots: .*\), got 0"),
    ("max-loras-bool", dict(enable_lora=True, max_loras=True), r"max_loras must be an int >= 1 .*got True \(bool\)"),
    ("max-lora-rank-str", dict(enable_lora=True, max_lora_rank="16"), r"max_lora_rank must be an int >= 1, got '16' \(str\)"),
    ("max-cpu-loras-below-max-loras", dict(enable_lora=True, max_loras=4, max_cpu_loras=2),
     r"max_cpu_loras must be None or an int >= 4 \(max_loras=4: the host cache holds every slot's adapter; .*got 2"),
]


def _copy(tmp_path: Path) -> Path:
    folder = tmp_path / "ckpt"
    shutil.copytree(preset_path("tiny-llama"), folder)
    return folder


def _config(**changes: Any) -> Callable[[Path], None]:
    def edit(folder: Path) -> None:
        cfg = json.loads((folder / "config.json").read_text())
        for k, v in changes.items():
            if v is None:
                cfg.pop(k)
            else:
                cfg[k] = v
        (folder / "config.json").write_text(json.dumps(cfg))
    return edit


def _write(name: str, text: str) -> Callable[[Path], None]:
    return lambda folder: (folder / name).write_text(text)


def _tensors(edit: Callable[[dict[str, torch.Tensor]], None]) -> Callable[[Path], None]:
    def apply(folder: Path) -> None:
        tensors = load_file(folder / "model.safetensors")
        edit(tensors)
        save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    return apply


def _set(name: str, value: float) -> Callable[[dict[str, torch.Tensor]], None]:
    def edit(t: dict[str, torch.Tensor]) -> None:
        t[name].view(-1)[0] = value
    return edit


def _truncate(folder: Path) -> None:
    data = (folder / "model.safetensors").read_bytes()
    (folder / "model.safetensors").write_bytes(data[:100])


def _shard(index: str) -> Callable[[Path], None]:
    def apply(folder: Path) -> None:
        (folder / "model.safetensors").rename(folder / "model-00001-of-00001.safetensors")
        (folder / "model.safetensors.index.json").write_text(index)
    return apply


def _no_tokenizer(folder: Path) -> None:
    for f in folder.glob("tokenizer*"):
        f.unlink()


LAYER0 = "model.layers.0"
CHECKPOINT_CASES: list[tuple[str, Callable[[Path], None], str]] = [
    ("config-malformed-json", _write("config.json", '{"vocab_size": 512,'), r"config\.json' is not valid JSON: .* at line 1"),
    ("config-not-object", _write("config.json", "[1, 2]"), r"config\.json' must hold a JSON object, got list"),
    ("config-missing-field", _config(num_attention_heads=None), r"config\.json: missing field 'num_attention_heads'"),
    ("config-field-str", _config(vocab_size="512"), r"config\.json: vocab_size must be an int >= 1, got '512' \(str\)"),
    ("config-field-bool", _config(tie_word_embeddings="false"), r"config\.json: tie_word_embeddings must be True or False"),
    ("config-rms-norm-eps-negative", _config(rms_norm_eps=-1e-6), r"config\.json: rms_norm_eps must be a finite number > 0"),
    ("config-kv-heads-not-dividing", _config(num_key_value_heads=3), r"num_attention_heads=4 must be a multiple of num_key_value_heads=3"),
    ("config-rope-llama3-missing-factor", _config(rope_parameters=dict(rope_type="llama3", rope_theta=5e5,
                                                                          low_freq_factor=1.0, high_freq_factor=4.0)),
     r"config\.json: rope_parameters: missing field 'factor'"),
    ("config-unknown-architecture", _config(architectures=["GPT2LMHeadModel"]), r"config\.json: architectures \['GPT2LMHeadModel'\] not supported"),
    ("config-fewer-layers-than-weights", _config(num_hidden_layers=1), r"has weights for layer 1, but config\.json num_hidden_layers=1"),
    ("config-more-layers-than-weights", _config(num_hidden_layers=3), r"\(model\.safetensors\) is missing tensor 'model\.layers\.2\.input_layernorm\.weight'"),
    ("config-vocab-exceeds-embedding", _config(vocab_size=600),
     r"tensor 'model\.embed_tokens\.weight' in .*model\.safetensors' has shape \[512, 64\], but config\.json \(vocab_size, hidden_size\) implies \[600, 64\]"),
    ("config-heads-mismatch", _config(num_attention_heads=8, num_key_value_heads=4),
     r"tensor 'model\.layers\.0\.self_attn\.q_proj\.weight' .* has shape \[64, 64\], but config\.json \(num_attention_heads, head_dim, hidden_size\) implies \[128, 64\]"),
    ("config-bias-off-but-stored", _tensors(lambda t: t.update({f"{LAYER0}.self_attn.o_proj.bias": torch.zeros(64)})),
     r"tensors the model would ignore: \['model\.layers\.0\.self_attn\.o_proj\.bias'\] \(check config\.json's attention_bias"),
    ("weight-shape-transposed", _tensors(lambda t: t.update({f"{LAYER0}.mlp.down_proj.weight": t[f"{LAYER0}.mlp.down_proj.weight"].T.contiguous()})),
     r"tensor 'model\.layers\.0\.mlp\.down_proj\.weight' .* has shape \[128, 64\], but config\.json \(intermediate_size, hidden_size\) implies \[64, 128\]"),
    ("weight-missing", _tensors(lambda t: t.pop(f"{LAYER0}.mlp.up_proj.weight")), r"missing tensor 'model\.layers\.0\.mlp\.up_proj\.weight'"),
    ("weight-nan", _tensors(_set(f"{LAYER0}.mlp.gate_proj.weight", math.nan)),
     r"tensor 'model\.layers\.0\.mlp\.gate_proj\.weight' in .*model\.safetensors' has 1 NaN or infinite value"),
    ("weight-inf", _tensors(_set("lm_head.weight", math.inf)), r"tensor 'lm_head\.weight' in .* has 1 NaN or infinite value"),
    ("weight-int-dtype", _tensors(lambda t: t.update({"model.norm.weight": t["model.norm.weight"].long()})),
     r"tensor 'model\.norm\.weight' in .* is stored as I64; weights must be floating point"),
    ("safetensors-truncated", _truncate, r"model\.safetensors' is not a readable safetensors file"),
    ("index-malformed", _shard('{"weight_map": '), r"model\.safetensors\.index\.json' is not valid JSON"),
    ("index-missing-shard", _shard('{"weight_map": {"lm_head.weight": "model-00009.safetensors"}}'),
     r"safetensors file .*model-00009\.safetensors' does not exist"),
    ("eos-token-id-str", _write("generation_config.json", '{"eos_token_id": "2"}'),
     r"generation_config\.json': eos_token_id must be an int >= 0 or a list of them, got '2' \(str\)"),
    ("eos-token-id-out-of-vocab", _write("generation_config.json", '{"eos_token_id": [2, 900]}'),
     r"generation_config\.json': eos_token_id 900 is outside the vocabulary \(vocab_size=512"),
    ("generation-config-malformed", _write("generation_config.json", "{eos"), r"generation_config\.json' is not valid JSON"),
    ("tokenizer-json-malformed", _write("tokenizer.json", "{not json"), r"its tokenizer files .* cannot be loaded"),
]


# LoRA: requests to an engine with enable_lora=True, max_loras=2, max_lora_rank=8, and adapter
# folders broken in a copy of the r8-attn preset. A rejected adapter joins neither the host cache
# nor the known ids (`LoRAManager.check` reads, `remember` keeps only with a queued request).
def _lora(name: str = "r8-attn") -> str:
    return str(adapter_path("tiny-llama", name))


def _add_with(lora: Callable[[], Any]) -> Callable[[LLM], Any]:
    """add_request with the lora_request `lora()` gives: made when the case runs, not at collection
    (an adapter preset is built on first use)."""
    return lambda llm: llm.engine.add_request("x", [5, 6], lora_request=lora())


def _generate_with(prompts: list[list[int]], lora: Callable[[], Any]) -> Callable[[LLM], Any]:
    return lambda llm: llm.generate(prompts, SamplingParams(max_tokens=2), use_tqdm=False, lora_request=lora())


def _lora_request(**kw: Any) -> Callable[[LLM], Any]:
    return lambda llm: LoRARequest(**{"lora_name": "a", "lora_int_id": 1, "lora_path": _lora(), **kw})


def _id_reused(llm: LLM) -> None:
    llm.engine.add_lora(LoRARequest("a", 1, _lora()))  # known already after the first check: fine again
    llm.engine.add_request("x", [5], lora_request=LoRARequest("b", 1, _lora("r4-mlp")))


LORA_CASES: list[tuple[str, Callable[[LLM], Any], str]] = [
    ("lora-request-str", _add_with(_lora), r"lora_request must be a LoRARequest or None, got '/.*' \(str\)"),
    ("lora-request-int-in-list", _generate_with([[5], [6]], lambda: [LoRARequest("a", 1, _lora()), 7]),
     r"prompt 1: lora_request must be a LoRARequest or None, got 7 \(int\)"),
    ("lora-request-count", _generate_with([[5], [6]], lambda: [None]),
     r"lora_request must be one LoRARequest, None, or a list of 2 \(one per prompt\), got 1"),
    ("lora-request-dict", _generate_with([[5]], lambda: {"lora_path": _lora()}),
     r"lora_request must be a LoRARequest, a list of them .* or None, got \{'lora_path'"),
    ("lora-name-empty", _lora_request(lora_name=""), r"lora_name must be a non-empty str, got '' \(str\)"),
    ("lora-int-id-zero", _lora_request(lora_int_id=0), r"lora_int_id must be an int >= 1, got 0 \(int\)"),
    ("lora-int-id-bool", _lora_request(lora_int_id=True), r"lora_int_id must be an int >= 1, got True \(bool\)"),
    ("lora-path-none", _lora_request(lora_path=None), r"lora_path must be a non-empty str \(a PEFT adapter folder\), got None"),
    ("lora-id-reused", _id_reused, r"lora_int_id 1 already names adapter 'a' at .*; got 'b' at .* \(one id, one adapter\)"),
    ("lora-prompt-never-fits", lambda llm: llm.engine.add_request(
        "x", [5] * 1000, SamplingParams(max_tokens=100), lora_request=LoRARequest("new", 7, _lora("r4-mlp"))),
     "request 'x' can never fit"),  # the adapter was good: checked, then not kept
    ("lora-rank-above-max", _add_with(lambda: LoRARequest("big", 3, _lora("r16-all"))),
     r"LoRA adapter 'big' \(lora_path .*\): rank r=16 exceeds max_lora_rank=8; raise max_lora_rank to at least 16"),
]


def _adapter_config(**changes: Any) -> Callable[[Path], None]:
    def edit(folder: Path) -> None:
        cfg = json.loads((folder / "adapter_config.json").read_text())
        cfg.update(changes)
        (folder / "adapter_config.json").write_text(json.dumps(cfg))
    return edit


def _adapter_tensors(edit: Callable[[dict[str, torch.Tensor]], None]) -> Callable[[Path], None]:
    def apply(folder: Path) -> None:
        tensors = load_file(folder / "adapter_model.safetensors")
        edit(tensors)
        save_file(tensors, folder / "adapter_model.safetensors")
    return apply


Q_A = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
LORA_FOLDER_CASES: list[tuple[str, Callable[[Path], None], str]] = [
    ("lora-path-missing", shutil.rmtree, r"LoRA adapter 'bad' \(lora_path .*\): lora_path is not a folder; a PEFT "
                                         r"adapter folder holds adapter_config\.json and adapter_model\.safetensors"),
    ("lora-config-malformed", lambda f: (f / "adapter_config.json").write_text("{"),
     r"LoRA adapter 'bad' .*adapter_config\.json' is not valid JSON: .* at line 1"),
    ("lora-config-not-object", lambda f: (f / "adapter_config.json").write_text("[]"),
     r"adapter_config\.json must hold a JSON object, got list"),
    ("lora-rank-bool", _adapter_config(r=True), r"adapter_config\.json 'r' must be an int >= 1, got True \(bool\)"),
    ("lora-alpha-nan", _adapter_config(lora_alpha=math.nan), r"adapter_config\.json 'lora_alpha' must be a finite number, got nan"),
    ("lora-target-modules-not-str", _adapter_config(target_modules=[["q_proj"]]),
     r"target_modules must hold module names \(str\), got \[\['q_proj'\]\]"),
    ("lora-weights-truncated", lambda f: (f / "adapter_model.safetensors").write_bytes(b"\x08" + bytes(50)),
     r"adapter_model\.safetensors' is not a readable safetensors file"),
    ("lora-weight-nan", _adapter_tensors(_set(Q_A, math.nan)),
     r"tensor 'base_model\.model\.model\.layers\.0\.self_attn\.q_proj\.lora_A\.weight' in .*adapter_model\.safetensors' "
     r"has 1 NaN or infinite value"),
    ("lora-weight-int-dtype", _adapter_tensors(lambda t: t.update({Q_A: t[Q_A].long()})),
     r"tensor '.*q_proj\.lora_A\.weight' is stored as torch\.int64; LoRA weights must be floating point"),
]

FLOAT16_OVERFLOW = ("weight-overflows-dtype", _tensors(_set("model.norm.weight", 1e6)),
                    r"tensor 'model\.norm\.weight' .* has 1 NaN or infinite value\(s\) after conversion to torch\.float16")


@functools.cache
def _shared_llm() -> LLM:
    return LLM("tiny-llama", device="cpu", num_gpu_blocks=64)


@functools.cache
def _fresh_output() -> list[list[int]]:
    outs = LLM("tiny-llama", device="cpu", num_gpu_blocks=64).generate(
        CHECK_PROMPTS, SamplingParams(max_tokens=5, **GREEDY), use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


LORA_ENGINE = dict(device="cpu", num_gpu_blocks=64, enable_lora=True, max_loras=2, max_lora_rank=8)


@functools.cache
def _shared_lora_llm() -> LLM:
    return LLM("tiny-llama", **LORA_ENGINE)


def _lora_check_batch() -> tuple[list[list[int]], SamplingParams, list[LoRARequest | None]]:
    """Base and adapter requests side by side (adapter 1: r8-attn, adapter 2: r4-mlp)."""
    return ([[5, 6, 7], [5, 6, 7], [9, 9]], SamplingParams(max_tokens=5, **GREEDY),
            [None, LoRARequest("a", 1, _lora()), LoRARequest("c", 2, _lora("r4-mlp"))])


@functools.cache
def _fresh_lora_output() -> list[list[int]]:
    outs = LLM("tiny-llama", **LORA_ENGINE).generate(*_lora_check_batch()[:2], use_tqdm=False,
                                                     lora_request=_lora_check_batch()[2])
    return [o.outputs[0].token_ids for o in outs]


def _lora_state(llm: LLM) -> tuple[dict[int, LoRARequest], list[int]]:
    """The known ids and the host cache's adapters (a valid add on the way may reorder its LRU)."""
    lora = llm.engine.runner.lora
    return dict(lora.known), sorted(lora.cache.adapters)


def _still_serves_like_a_fresh_engine() -> None:
    llm = _shared_llm()
    assert not llm.engine.has_unfinished_requests() and pool_is_whole(llm.engine)
    outs = llm.generate(CHECK_PROMPTS, SamplingParams(max_tokens=5, **GREEDY), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == _fresh_output()


@pytest.mark.parametrize("call,match", [c[1:] for c in REQUEST_CASES], ids=[c[0] for c in REQUEST_CASES])
def test_bad_request_input(call, match):
    with pytest.raises(ValueError, match=match):
        call(_shared_llm())
    _still_serves_like_a_fresh_engine()


def _bad_lora_input(call: Callable[[LLM], Any], match: str) -> None:
    llm = _shared_lora_llm()
    prompts, params, loras = _lora_check_batch()
    llm.generate(prompts, params, use_tqdm=False, lora_request=loras)  # adapters 1 and 2 known, cached
    before = _lora_state(llm)
    with pytest.raises(ValueError, match=match):
        call(llm)
    assert _lora_state(llm) == before, "a rejected adapter must change no LoRA state"
    assert not llm.engine.has_unfinished_requests() and pool_is_whole(llm.engine)
    outs = llm.generate(prompts, params, use_tqdm=False, lora_request=loras)
    assert [o.outputs[0].token_ids for o in outs] == _fresh_lora_output()


@pytest.mark.parametrize("call,match", [c[1:] for c in LORA_CASES], ids=[c[0] for c in LORA_CASES])
def test_bad_lora_input(call, match):
    _bad_lora_input(call, match)


@pytest.mark.parametrize("edit,match", [c[1:] for c in LORA_FOLDER_CASES], ids=[c[0] for c in LORA_FOLDER_CASES])
def test_bad_lora_folder(tmp_path, edit, match):
    folder = tmp_path / "adapter"
    shutil.copytree(_lora(), folder)
    edit(folder)
    _bad_lora_input(_add_with(lambda: LoRARequest("bad", 5, str(folder))), match)


@pytest.mark.parametrize("kwargs,match", [c[1:] for c in ENGINE_CASES], ids=[c[0] for c in ENGINE_CASES])
def test_bad_engine_argument(kwargs, match):
    kwargs = {"model": "tiny-llama", **kwargs}
    with pytest.raises(ValueError, match=match):
        LLM(kwargs.pop("model"), **kwargs)
    _still_serves_like_a_fresh_engine()  # a failed construction leaves no trace in another engine


@pytest.mark.parametrize("edit,match", [c[1:] for c in CHECKPOINT_CASES], ids=[c[0] for c in CHECKPOINT_CASES])
def test_bad_checkpoint(tmp_path, edit, match):
    folder = _copy(tmp_path)
    edit(folder)
    with pytest.raises(ValueError, match=match):
        LLM(str(folder), device="cpu", num_gpu_blocks=8)
    _still_serves_like_a_fresh_engine()


def test_weights_that_overflow_the_chosen_dtype(tmp_path):
    folder = _copy(tmp_path)
    FLOAT16_OVERFLOW[1](folder)
    LLM(str(folder), device="cpu", num_gpu_blocks=8)  # float32: fine
    with pytest.raises(ValueError, match=FLOAT16_OVERFLOW[2]):
        LLM(str(folder), device="cpu", num_gpu_blocks=8, dtype="float16")


def test_text_prompt_without_a_tokenizer(tmp_path):
    folder = _copy(tmp_path)
    _no_tokenizer(folder)
    llm = LLM(str(folder), device="cpu", num_gpu_blocks=16)
    with pytest.raises(ValueError, match="prompt 0: prompt is text but model folder .* has no tokenizer"):
        llm.generate("hello", use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    assert len(llm.generate([5, 6], SamplingParams(max_tokens=3), use_tqdm=False)[0].outputs[0].token_ids) == 3


def test_the_docs_table_lists_exactly_these_cases():
    """docs/bad_inputs.md's first column is the case ids of this file and tests/engine/test_step_faults.py."""
    doc = (ROOT / "docs" / "bad_inputs.md").read_text()
    documented = re.findall(r"^\| `([a-z0-9-]+)` \|", doc, flags=re.M)
    faults = re.findall(r'^CASE_IDS = \[(.*?)\]', (ROOT / "tests" / "engine" / "test_step_faults.py").read_text(), re.M | re.S)
    cases = [c[0] for c in REQUEST_CASES + ENGINE_CASES + CHECKPOINT_CASES + LORA_CASES + LORA_FOLDER_CASES]
    cases += [FLOAT16_OVERFLOW[0], "text-without-tokenizer"]
    cases += re.findall(r'"([a-z0-9-]+)"', faults[0]) if faults else []
    assert len(documented) == len(set(documented)), "a case is listed twice"
    assert sorted(documented) == sorted(cases)
    assert len(cases) >= 40
