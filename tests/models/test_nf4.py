"""QLoRA's NF4 (engine_core/models/quantization/nf4.py): the levels against the paper's construction, the
quantizer against a float64 nearest-level search, the byte layout, the QLoRA forward against float64, the
whole engine with `quantization="nf4"` against a checkpoint of the dequantized weights, and bad input.

bitsandbytes (the reference implementation) is not installed: its CPU support is partial and it is not a
dependency of the kit, so the references here are the paper's table and its construction from normal quantiles."""
from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine_core import LLM, SamplingParams
from engine_core.models.quantization.nf4 import NF4_LEVELS, nf4_dequantize, nf4_quantize, qlora_linear
from engine_core.presets import preset_path

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _levels_from_quantiles() -> torch.Tensor:
    """bitsandbytes' `create_normal_map(offset=0.9677083, use_extra_value=True)`: 8 positive quantiles of N(0, 1)
    between p = 0.9677083 and 0.5, 7 negative ones, an exact 0, divided by the largest."""
    offset = 0.9677083
    pos = torch.special.ndtri(torch.linspace(offset, 0.5, 9, dtype=torch.float64)[:-1])
    neg = -torch.special.ndtri(torch.linspace(offset, 0.5, 8, dtype=torch.float64)[:-1])
    v = torch.cat([pos, torch.zeros(1, dtype=torch.float64), neg]).sort().values
    return v / v.abs().max()


def test_levels_are_the_normal_quantiles():
    levels = torch.tensor(NF4_LEVELS, dtype=torch.float64)
    assert torch.allclose(levels, _levels_from_quantiles(), rtol=0, atol=2e-7)  # the table holds fp32 values
    assert levels[7] == 0 and levels[0] == -1 and levels[15] == 1


def _nearest64(w: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    blocks = w.double().reshape(-1, block)
    absmax = blocks.abs().amax(1)
    scaled = blocks / torch.where(absmax > 0, absmax, 1.0)[:, None]
    idx = (scaled[..., None] - torch.tensor(NF4_LEVELS, dtype=torch.float64)).abs().argmin(-1)
    return idx.reshape(-1), absmax


@pytest.mark.parametrize("block", [64, 32])
def test_quantize_picks_the_nearest_level_per_block(block):
    w = torch.randn(48, 128, generator=torch.Generator().manual_seed(0)) * 0.02
    w[3, :block] = 0  # an all-zero block: index 7, scale 0
    packed, absmax = nf4_quantize(w, block)
    idx, absmax64 = _nearest64(w, block)
    assert packed.dtype == torch.uint8 and packed.shape == (w.numel() // 2,)
    assert torch.equal(packed, ((idx[0::2] << 4) | idx[1::2]).to(torch.uint8))  # first weight: high nibble
    assert torch.equal(absmax.double(), absmax64) and absmax.dtype == torch.float32
    deq = nf4_dequantize(packed, absmax, w.shape, block)
    expected = torch.tensor(NF4_LEVELS, dtype=torch.float64)[idx].reshape(-1, block) * absmax64[:, None]
    torch.testing.assert_close(deq.double(), expected.reshape(w.shape), rtol=2 ** -23, atol=0)
    assert torch.all(deq[3, :block] == 0)
    # the largest gap between levels is 0.3038 (0.7230 .. 1.0): no weight moves by more than half of it
    assert ((deq - w).abs().reshape(-1, block) <= 0.152 * absmax[:, None] + 1e-12).all()


def test_qlora_linear_matches_float64():
    gen = torch.Generator().manual_seed(1)
    w, x = torch.randn(24, 128, generator=gen), torch.randn(5, 128, generator=gen)
    a, b = torch.randn(8, 128, generator=gen) * 0.1, torch.randn(24, 8, generator=gen) * 0.1
    packed, absmax = nf4_quantize(w)
    deq = nf4_dequantize(packed, absmax, w.shape).double()
    expected = x.double() @ deq.T + 2.0 * (x.double() @ a.double().T) @ b.double().T
    torch.testing.assert_close(qlora_linear(x, packed, absmax, (24, 128), a, b, 2.0).double(), expected,
                               rtol=1e-5, atol=1e-4)


PROMPTS = [[1, 5, 9, 44, 7], [1, 300, 2, 17, 17, 17, 80, 3, 90]]
GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


def _tokens(model: str, **kwargs) -> list[list[int]]:
    llm = LLM(model, kv_cache_memory_bytes=2**22, **kwargs)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


def test_engine_with_nf4_matches_the_dequantized_model(tmp_path):
    """tiny-llama served with NF4 weights = tiny-llama whose projections hold their NF4-dequantized values
    (level x absmax is one fp32 rounding on both paths), and its weights take 4.5 bits each."""
    folder = tmp_path / "dequantized"
    shutil.copytree(preset_path("tiny-llama"), folder)
    tensors = load_file(folder / "model.safetensors")
    proj = 0
    for name, t in tensors.items():
        if name.endswith(tuple(f"{p}.weight" for p in PROJECTIONS)):
            tensors[name] = nf4_dequantize(*nf4_quantize(t), t.shape, dtype=t.dtype).contiguous()
            proj += t.numel()
    save_file(tensors, folder / "model.safetensors")
    llm = LLM("tiny-llama", quantization="nf4", kv_cache_memory_bytes=2**22)
    quantized = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    assert quantized == _tokens(str(folder))
    assert quantized != _tokens("tiny-llama")  # 4 bits changes this tiny random model's output
    dense = sum(4 * t.numel() for n, t in tensors.items() if not n.endswith(tuple(f"{p}.weight" for p in PROJECTIONS)))
    assert llm.engine.stats()["weight_bytes"] == dense + proj // 2 + proj // 64 * 4


@pytest.mark.parametrize("call, match", [
    (lambda: nf4_quantize(torch.zeros(100)), r"weight must hold a whole number of blocks of block_size=64"),
    (lambda: nf4_quantize(torch.zeros(64), 0), r"block_size=0"),
    (lambda: nf4_dequantize(torch.zeros(32, dtype=torch.uint8), torch.zeros(2), (64,)), r"absmax must hold one"),
    (lambda: LLM("tiny-llama", quantization="nf4", quantization_config={"bits": 4}), r"unknown key\(s\) \['bits'\]"),
])
def test_bad_input_names_the_parameter(call, match):
    with pytest.raises(ValueError, match=match):
        call()
