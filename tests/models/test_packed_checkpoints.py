"""GPTQ and AWQ checkpoints (engine_core/models/quantization/packed.py): checkpoints written here by packers
that follow AutoGPTQ's and AutoAWQ's own packing loops (numpy, word by word: independent of the loader's
vectorised unpackers), from a weight quantized group-wise by `quantize_groupwise`. The loader must give back
that group-wise weight exactly, and an engine on the checkpoint the same greedy tokens as on the dense
fake-quantized weights.

The scales are stored in fp16, as both tools store them; the expected weight uses the same fp16 scales, so
(q - z) * s is one fp32 rounding of the same product on both sides: equality is exact, not a tolerance."""
from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from engine_helpers import one_torch_thread
from safetensors.torch import load_file, save_file

from engine_core import LLM, SamplingParams
from engine_core.config import EngineConfig, QuantizationConfig
from engine_core.models.linear import Linear
from engine_core.models.quantization import PackedLinearMethod, fused_tensors
from engine_core.models.quantization.awq import AWQ_ORDER, unpack_awq
from engine_core.models.quantization.rtn import dequantize_groupwise, quantize_groupwise
from engine_core.presets import preset_path

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


pytestmark = pytest.mark.usefixtures(one_torch_thread.__name__)


# ---- reference packers (AutoGPTQ's QuantLinear.pack, AutoAWQ's WQLinear_GEMM.from_linear) -------------------
def gptq_pack(q: torch.Tensor, zeros: torch.Tensor, bits: int, minus_one: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """q `[N, K]`, zeros `[G, N]` -> (qweight `[K * bits / 32, N]`, qzeros `[G, N * bits / 32]`): AutoGPTQ's loops,
    `qweight[row] |= intweight[j] << (bits * (j - i))` over K, the zeros (minus one) the same way over N."""
    per = 32 // bits
    intweight = q.t().numpy().astype(np.uint32)  # [K, N]
    qweight = np.zeros((intweight.shape[0] // per, intweight.shape[1]), dtype=np.uint32)
    for row in range(qweight.shape[0]):
        for j in range(per):
            qweight[row] |= intweight[row * per + j] << np.uint32(bits * j)
    z = zeros.numpy().astype(np.int64) - (1 if minus_one else 0)
    z = (z & (2**bits - 1)).astype(np.uint32)  # AutoGPTQ's uint32 cast: a zero of 0 wraps (its known quirk)
    qzeros = np.zeros((z.shape[0], z.shape[1] // per), dtype=np.uint32)
    for col in range(qzeros.shape[1]):
        for j in range(per):
            qzeros[:, col] |= z[:, col * per + j] << np.uint32(bits * j)
    return torch.from_numpy(qweight.view(np.int32)), torch.from_numpy(qzeros.view(np.int32))


def awq_pack(values: np.ndarray) -> torch.Tensor:
    """int `[R, N]` -> int32 `[R, N / 8]`: AutoAWQ's `qweight[:, col] |= intweight[:, col * 8 + order_map[i]] << i * 4`."""
    order_map = [0, 2, 4, 6, 1, 3, 5, 7]
    values = values.astype(np.uint32)
    packed = np.zeros((values.shape[0], values.shape[1] // 8), dtype=np.uint32)
    for col in range(packed.shape[1]):
        for i in range(8):
            packed[:, col] |= values[:, col * 8 + order_map[i]] << np.uint32(i * 4)
    return torch.from_numpy(packed.view(np.int32))


def quantized(w: torch.Tensor, bits: int, group: int, perm: torch.Tensor | None = None):
    """(q `[N, K]`, fp16 scales `[G, N]`, zeros `[G, N]`, g_idx `[K]`, the expected weight (q - z) * s `[N, K]`):
    group-wise over the columns in `perm`'s order (GPTQ's act-order), contiguous without it."""
    k = w.shape[1]
    perm = torch.arange(k) if perm is None else perm
    q_p, scales, zeros = quantize_groupwise(w[:, perm], bits, group)
    scales16 = scales.half()
    expected, q = torch.empty_like(w), torch.empty_like(q_p)
    expected[:, perm] = dequantize_groupwise(q_p, scales16.float(), zeros, group)
    q[:, perm] = q_p
    g_idx = torch.empty(k, dtype=torch.int32)
    g_idx[perm] = torch.arange(k, dtype=torch.int32) // group
    return q, scales16, zeros, g_idx, expected


def gptq_tensors(prefix: str, w: torch.Tensor, bits: int, group: int, act_order: bool, minus_one: bool,
                 seed: int = 0) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    perm = torch.randperm(w.shape[1], generator=torch.Generator().manual_seed(seed)) if act_order else None
    q, scales, zeros, g_idx, expected = quantized(w, bits, group, perm)
    assert int(zeros.min()) >= 1  # every group has a negative weight: z = 0, which the old format cannot store, absent
    qweight, qzeros = gptq_pack(q, zeros, bits, minus_one)
    return {f"{prefix}.qweight": qweight, f"{prefix}.qzeros": qzeros, f"{prefix}.scales": scales,
            f"{prefix}.g_idx": g_idx}, expected


def awq_tensors(prefix: str, w: torch.Tensor, group: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    q, scales, zeros, _, expected = quantized(w, 4, group)
    return {f"{prefix}.qweight": awq_pack(q.t().numpy()), f"{prefix}.qzeros": awq_pack(zeros.numpy()),
            f"{prefix}.scales": scales}, expected


def _layer(tensors: dict[str, torch.Tensor], prefixes: list[str], quant: QuantizationConfig,
           dtype: torch.dtype = torch.float32, cpu_kernel: bool = True) -> Linear:
    loaded = fused_tensors(tensors.__getitem__, tensors.__contains__, prefixes, quant)
    return Linear(None, None, PackedLinearMethod(quant, loaded, dtype, cpu_kernel))


def _weight(layer: Linear) -> torch.Tensor:
    return layer.quant_method.dequantized_weight(layer)


GPTQ = QuantizationConfig("gptq", 4, 16, desc_act=False, zeros_minus_one=True)


# ---- the layouts ---------------------------------------------------------------------------------------------
def test_awq_order_by_hand() -> None:
    """Columns 0..7 holding the values 0..7: nibble i holds column AWQ_ORDER[i], so the word's nibbles read
    0, 2, 4, 6, 1, 3, 5, 7 from the low end."""
    word = sum(c << (4 * i) for i, c in enumerate(AWQ_ORDER))
    assert int(awq_pack(np.arange(8)[None])[0, 0]) == word
    assert unpack_awq(torch.tensor([[word]], dtype=torch.int32)).tolist() == [list(range(8))]


@pytest.mark.parametrize("bits, act_order, minus_one", [(4, False, True), (4, True, True), (8, True, True),
                                                        (4, False, False)])
def test_gptq_loads_the_group_wise_weight_exactly(bits: int, act_order: bool, minus_one: bool) -> None:
    w = torch.randn(48, 64, generator=torch.Generator().manual_seed(bits))
    tensors, expected = gptq_tensors("p", w, bits, 16, act_order, minus_one)
    quant = QuantizationConfig("gptq", bits, 16, desc_act=act_order, zeros_minus_one=minus_one)
    layer = _layer(tensors, ["p"], quant)
    assert torch.equal(_weight(layer), expected)
    assert (layer.perm is not None) == act_order and layer.g_idx is None  # act-order: K permuted, groups contiguous
    if minus_one:  # the quirk matters: read as the v2 format, every weight shifts by one step
        shifted = _layer(tensors, ["p"], QuantizationConfig("gptq", bits, 16, desc_act=act_order))
        assert not torch.equal(_weight(shifted), expected)


def test_awq_loads_the_group_wise_weight_exactly() -> None:
    w = torch.randn(48, 64, generator=torch.Generator().manual_seed(3))
    tensors, expected = awq_tensors("p", w, 32)
    assert torch.equal(_weight(_layer(tensors, ["p"], QuantizationConfig("awq", 4, 32))), expected)


def test_fused_projections_stack_along_n() -> None:
    g = torch.Generator().manual_seed(5)
    tensors, expected = {}, []
    for name, rows in (("q", 32), ("k", 16), ("v", 16)):
        t, e = gptq_tensors(name, torch.randn(rows, 64, generator=g), 4, 16, True, True, seed=1)
        tensors.update(t)
        expected.append(e)
    assert torch.equal(_weight(_layer(tensors, ["q", "k", "v"], GPTQ)), torch.cat(expected))


def test_cpu_int4_kernel_on_a_gptq_layer_matches_its_reference_in_bf16() -> None:
    """The contiguous-group layer takes torch's int4 kernel in bf16; against the reference path (the same
    dequantized weight, bf16 F.linear) the two differ by bf16 rounding of K = 64 products: relative 2^-8 each,
    a tolerance of 4 ulps of the output scale covers the accumulated difference."""
    w = torch.randn(48, 64, generator=torch.Generator().manual_seed(7))
    tensors, _ = gptq_tensors("p", w, 4, 32, False, True)
    quant = QuantizationConfig("gptq", 4, 32, zeros_minus_one=True)
    kernel, reference = _layer(tensors, ["p"], quant, torch.bfloat16), _layer(tensors, ["p"], quant, torch.bfloat16, False)
    assert kernel.weight_int4pack is not None and reference.weight_int4pack is None
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(8)).bfloat16()
    y, y_ref = kernel(x).float(), reference(x).float()
    assert torch.allclose(y, y_ref, atol=4 * 2**-8 * float(y_ref.abs().max()), rtol=0)


# ---- the whole engine ----------------------------------------------------------------------------------------
PROMPTS = [[1, 5, 9, 44, 7], [1, 300, 2, 17, 17, 17, 80, 3, 90], [1, 64]]
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def _tokens(model: str, **kwargs) -> list[list[int]]:
    llm = LLM(model, kv_cache_memory_bytes=2**22, **kwargs)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


def _checkpoints(tmp_path, method: str, group: int, options: dict) -> tuple[str, str]:
    """tiny-llama as a packed checkpoint (config.json with its quantization_config) and as the same weights
    dequantized, dense (the fake-quantized fp32 model)."""
    packed, dense = tmp_path / method, tmp_path / f"{method}-dense"
    for folder in (packed, dense):
        shutil.copytree(preset_path("tiny-llama"), folder)
    tensors = load_file(packed / "model.safetensors")
    packed_tensors, dense_tensors = {}, {}
    inputs = {"q_proj": 0, "k_proj": 0, "v_proj": 0, "o_proj": 1, "gate_proj": 2, "up_proj": 2, "down_proj": 3}
    for name, t in sorted(tensors.items()):
        if name.endswith(tuple(f"{p}.weight" for p in PROJECTIONS)):
            prefix = name.removesuffix(".weight")
            # act-order's column order follows the input's Hessian: one order per input (q, k, v share theirs)
            seed = 4 * int(name.split(".")[2]) + inputs[prefix.split(".")[-1]]
            made, expected = gptq_tensors(prefix, t.float(), 4, group, True, True, seed) if method == "gptq" \
                else awq_tensors(prefix, t.float(), group)
            packed_tensors.update(made)
            dense_tensors[name] = expected.contiguous()
        else:
            packed_tensors[name] = dense_tensors[name] = t
    save_file(packed_tensors, packed / "model.safetensors")
    save_file(dense_tensors, dense / "model.safetensors")
    config = json.loads((packed / "config.json").read_text())
    config["quantization_config"] = {"quant_method": method, "bits": 4, "group_size": group, **options}
    (packed / "config.json").write_text(json.dumps(config))
    return str(packed), str(dense)


@pytest.mark.parametrize("method, options", [("gptq", {"desc_act": True, "sym": False}),
                                             ("awq", {"zero_point": True, "version": "gemm"})])
def test_engine_on_a_packed_checkpoint_matches_the_fake_quantized_model(tmp_path, method: str, options: dict) -> None:
    packed, dense = _checkpoints(tmp_path, method, 32, options)
    tokens = _tokens(packed, quantization=method)
    assert tokens == _tokens(dense)
    assert tokens != _tokens("tiny-llama")  # 4 bits changes this tiny model's output: the checkpoint's weights ran


def test_weight_bytes_of_a_packed_checkpoint(tmp_path) -> None:
    """qweight 4 bits a weight, zeros one byte and scales 4 bytes per group and column, g_idx 4 bytes per input."""
    packed, dense = _checkpoints(tmp_path, "gptq", 32, {"desc_act": True})
    tensors = load_file(f"{dense}/model.safetensors")
    proj = [t.shape for n, t in tensors.items() if n.endswith(tuple(f"{p}.weight" for p in PROJECTIONS))]
    other = sum(4 * t.numel() for n, t in tensors.items() if not n.endswith(tuple(f"{p}.weight" for p in PROJECTIONS)))
    layers = len(proj) // len(PROJECTIONS)
    g_idx = layers * 4 * (64 + 64 + 64 + 128)  # one per fused layer: q|k|v, o, gate|up (hidden 64), down (128)
    expect = other + sum(o * i // 2 + 5 * o * (i // 32) for o, i in proj) + g_idx
    assert LLM(packed, quantization="gptq", kv_cache_memory_bytes=2**22).engine.stats()["weight_bytes"] == expect


# ---- bad input -----------------------------------------------------------------------------------------------
def _edit(tmp_path, method: str = "gptq", options: dict | None = None, drop: str | None = None) -> str:
    packed, _ = _checkpoints(tmp_path, method, 32, {"desc_act": True} if method == "gptq" else {})
    if options is not None:
        config = json.loads(open(f"{packed}/config.json").read())
        config["quantization_config"].update(options)
        open(f"{packed}/config.json", "w").write(json.dumps(config))
    if drop is not None:
        tensors = load_file(f"{packed}/model.safetensors")
        del tensors[drop]
        save_file(tensors, f"{packed}/model.safetensors")
    return packed


@pytest.mark.parametrize("edit, match", [
    (dict(options={"group_size": 48}), r"tensor 'model\.layers\.0\.self_attn\.q_proj\.qweight': quantization_config's "
                                       r"group_size 48 must divide the input size K = 64"),
    (dict(method="awq", options={"group_size": 48}), r"tensor 'model\.layers\.0\.self_attn\.q_proj\.qweight': "
                                                     r"quantization_config's group_size 48 must divide"),
    (dict(drop="model.layers.1.mlp.down_proj.qzeros"), r"tensor 'model\.layers\.1\.mlp\.down_proj\.qzeros': missing"),
    (dict(method="awq", drop="model.layers.0.mlp.up_proj.qzeros"), r"tensor 'model\.layers\.0\.mlp\.up_proj\.qzeros'"),
    (dict(options={"bits": 3}), r"bits must be one of \(4, 8\) for gptq, got 3"),
    (dict(method="awq", options={"bits": 8}), r"bits must be one of \(4,\) for awq, got 8"),
    (dict(options={"quant_method": "awq"}), r"quant_method 'awq', but quantization='gptq'"),
])
def test_bad_checkpoints_are_refused_naming_the_tensor(tmp_path, edit: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        LLM(_edit(tmp_path, **edit), quantization=edit.get("method", "gptq"), kv_cache_memory_bytes=2**22)


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(ValueError, match=r"quantization_config must be None with quantization='gptq'"):
        EngineConfig(quantization="gptq", quantization_config={"bits": 4})
    with pytest.raises(ValueError, match=r"config\.json's quantization_config in .* is missing"):
        LLM("tiny-llama", quantization="awq", kv_cache_memory_bytes=2**22)


def test_fused_projections_with_different_act_orders_are_refused() -> None:
    g = torch.Generator().manual_seed(9)
    tensors = {**gptq_tensors("q", torch.randn(16, 64, generator=g), 4, 16, True, True, seed=1)[0],
               **gptq_tensors("k", torch.randn(16, 64, generator=g), 4, 16, True, True, seed=2)[0]}
    with pytest.raises(ValueError, match=r"tensor 'k\.g_idx': must equal q\.g_idx"):
        _layer(tensors, ["q", "k"], GPTQ)


def test_a_packed_checkpoint_without_its_quantization_is_refused(tmp_path) -> None:
    packed, _ = _checkpoints(tmp_path, "awq", 32, {})
    with pytest.raises(ValueError, match=r"is awq-quantized .* load it with quantization='awq', got None"):
        LLM(packed, kv_cache_memory_bytes=2**22)
