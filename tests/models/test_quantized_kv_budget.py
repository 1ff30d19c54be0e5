"""Weight bytes flow into the KV budget: under one `cpu_memory_bytes` limit a quantized model's smaller weights
leave more KV blocks, by exactly the bytes it saves over the bytes of a block (the CPU's version of what CUDA's
profiled peak does, engine_core/worker/model_runner.py), and `stats()` shows the weights and the blocks."""
from __future__ import annotations

import pytest
from engine_helpers import one_torch_thread
from safetensors.torch import load_file

from engine_core import LLM
from engine_core.config import EngineConfig
from engine_core.presets import preset_path

BLOCK = 16


pytestmark = pytest.mark.usefixtures(one_torch_thread.__name__)


def _expected_weight_bytes(scheme: str | None) -> int:
    """From the checkpoint's shapes: fp32 everywhere, or each projection at its scheme's bytes."""
    tensors = load_file(preset_path("tiny-llama") / "model.safetensors")
    proj = [t.shape for n, t in tensors.items() if n.endswith("_proj.weight")]
    other = sum(4 * t.numel() for n, t in tensors.items() if not n.endswith("_proj.weight"))
    per_scheme = {None: lambda o, i: 4 * o * i,
                  "int8": lambda o, i: o * i + 4 * o,  # int8 codes, an fp32 scale per row
                  "fp8": lambda o, i: o * i + 4 * o,  # fp8 codes, an fp32 scale per row (per-tensor expanded)
                  "rtn": lambda o, i: o * i // 2 + (i // 32) * o * (4 + 1)}  # nibbles, fp32 scale + uint8 zero a group
    return other + sum(per_scheme[scheme](o, i) for o, i in proj)


def test_quantized_weights_leave_more_kv_blocks_under_the_same_memory() -> None:
    hidden, intermediate, layers, kv_heads, head_dim = 64, 128, 2, 2, 16  # tiny-llama (engine_core/presets.py)
    tokens = 2048  # min(max_num_batched_tokens, max_model_len): the forward the activation peak is estimated for
    activations = tokens * (2 * hidden + 3 * intermediate) * 4  # residual + normed, gate, up, product; fp32
    block_bytes = 2 * layers * BLOCK * kv_heads * head_dim * 4  # K and V, every layer, fp32
    limit = activations + _expected_weight_bytes(None) + 10 * block_bytes + 123  # room for 10 blocks in fp32
    blocks = {}
    for scheme in (None, "int8", "fp8", "rtn"):
        options = {"group_size": 32} if scheme == "rtn" else None
        stats = LLM("tiny-llama", quantization=scheme, quantization_config=options, cpu_memory_bytes=limit,
                    block_size=BLOCK).engine.stats()
        weights = _expected_weight_bytes(scheme)
        assert stats["weight_bytes"] == weights, scheme
        assert stats["kv_block_bytes"] == block_bytes
        assert stats["num_gpu_blocks"] == (limit - weights - activations) // block_bytes, scheme
        blocks[scheme] = stats["num_gpu_blocks"]
    assert blocks[None] == 10
    for scheme in ("int8", "fp8", "rtn"):  # the saved bytes, in blocks
        saved = _expected_weight_bytes(None) - _expected_weight_bytes(scheme)
        assert blocks[scheme] - blocks[None] == (10 * block_bytes + 123 + saved) // block_bytes - 10 > 0, scheme


def test_a_limit_the_weights_fill_is_refused_naming_it() -> None:
    with pytest.raises(ValueError, match=r"no room for the KV cache: a budget of -?\d+ bytes .*cpu_memory_bytes"):
        LLM("tiny-llama", cpu_memory_bytes=2**20)


def test_cpu_memory_bytes_and_kv_cache_memory_bytes_are_alternatives() -> None:
    with pytest.raises(ValueError, match=r"cpu_memory_bytes must be None when kv_cache_memory_bytes is given"):
        EngineConfig(cpu_memory_bytes=2**30, kv_cache_memory_bytes=2**22)
    with pytest.raises(ValueError, match=r"cpu_memory_bytes must be"):
        EngineConfig(cpu_memory_bytes=0)
