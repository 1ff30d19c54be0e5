"""Weight quantization (engine_core/models/quantization): the packing bit for bit, the int8 GEMM exactly,
each method against a float64 reference of its own dequantized tensors (tolerances derived below), the whole
engine against a model built from the dequantized weights, and the bad inputs.

Tolerances: u = 2^-24 is fp32's unit roundoff. A sum of K products in fp32, in any order, is within
gamma_K = K u / (1 - K u) ~ K u of the exact sum, relative to sum |x| |w| (Higham, Accuracy and Stability of
Numerical Algorithms, 3.1). Each fp32 multiply or add of the epilogue adds u relative to its result."""
from __future__ import annotations

import shutil

import pytest
import torch
import torch.nn.functional as F
from engine_helpers import one_torch_thread
from safetensors.torch import load_file, save_file
from torch import nn

from engine_core import LLM, SamplingParams
from engine_core.config import EngineConfig, QuantizationConfig
from engine_core.models import llama
from engine_core.models.quantization import scheme as weight_scheme
from engine_core.models.linear import Linear
from engine_core.models.quantization import Int8LinearMethod, LinearMethodBase, RTNLinearMethod
from engine_core.models.quantization.int8 import (int8_mm, int8_mm_float64, quantize_per_channel,
                                                  quantize_per_token)
from engine_core.models.quantization.rtn import (dequantize_groupwise, pack_along_k, quantize_groupwise,
                                                 unpack_along_k)
from engine_core.presets import preset_path

U = 2.0 ** -24  # fp32 unit roundoff
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


pytestmark = pytest.mark.usefixtures(one_torch_thread.__name__)


# ---- packing -------------------------------------------------------------------------------------
@pytest.mark.parametrize("bits", [4, 8])
def test_pack_unpack_round_trip_is_bit_exact(bits: int) -> None:
    g = torch.Generator().manual_seed(bits)
    q = torch.randint(0, 2**bits, (48, 64), generator=g, dtype=torch.int32)
    q[0], q[1] = 2**bits - 1, 0  # every bit set (the int32 goes negative) and none
    packed = pack_along_k(q, bits)
    assert packed.dtype == torch.int32 and packed.shape == (64 * bits // 32, 48)
    assert torch.equal(unpack_along_k(packed, bits), q)


def test_packing_is_gptqs_layout() -> None:
    """8 nibbles of consecutive K per int32, value i at bits 4i: column n's first word, computed by hand."""
    q = torch.zeros(2, 16, dtype=torch.int32)
    q[0, :8] = torch.tensor([1, 2, 3, 4, 5, 6, 7, 15])
    q[1, 8:] = 9
    packed = pack_along_k(q, 4)
    word = sum(v << (4 * i) for i, v in enumerate([1, 2, 3, 4, 5, 6, 7, 15]))
    assert int(packed[0, 0]) == word - 2**32  # bit 31 set: negative as int32, the same bits
    assert int(packed[1, 0]) == 0 and int(packed[0, 1]) == 0
    assert int(packed[1, 1]) == sum(9 << (4 * i) for i in range(8)) - 2**32


@pytest.mark.parametrize("bits, group", [(4, 32), (4, 128), (8, 32)])
def test_groupwise_rounding_is_within_half_a_step(bits: int, group: int) -> None:
    w = torch.randn(40, 256, generator=torch.Generator().manual_seed(1))
    w[3, :group] = 0.0  # an all-zero group
    w[4, :group] = torch.rand(group) + 0.5  # an all-positive one: 0 must still be exact
    q, scales, zeros = quantize_groupwise(w, bits, group)
    assert int(q.min()) >= 0 and int(q.max()) <= 2**bits - 1
    deq = dequantize_groupwise(q, scales, zeros, group).double()
    step = scales.t().double().repeat_interleave(group, dim=1)
    # |w - (q - z) s| <= s / 2 for round-to-nearest; the fp32 quotient w / s adds <= u relative
    assert bool(((w.double() - deq).abs() <= step * (0.5 + 2**bits * U) + 1e-12).all())
    assert torch.equal(deq[3, :group], torch.zeros(group, dtype=torch.float64))
    assert float((deq[4, :group] - w[4, :group].double()).abs().max()) <= float(step[4, 0]) / 2 + 1e-7


# ---- int8 ----------------------------------------------------------------------------------------
def test_int8_rounding_is_symmetric_and_within_half_a_step() -> None:
    w = torch.randn(32, 100, generator=torch.Generator().manual_seed(2))
    w[5] = 0.0  # an all-zero row: scale tiny, q 0, exact
    for (q, scale), per_row in ((quantize_per_channel(w), lambda s: s[:, None]), (quantize_per_token(w), lambda s: s)):
        assert q.dtype == torch.int8 and int(q.min()) >= -127
        step = per_row(scale).double()
        assert bool(((w.double() - q.double() * step).abs() <= step * (0.5 + 128 * U)).all())
        assert bool((q.abs().amax(dim=1)[torch.arange(32) != 5] == 127).all())  # each row's absmax maps to 127
        assert bool((q[5] == 0).all())


@pytest.mark.parametrize("m, k, n", [(1, 576, 960), (7, 64, 24), (33, 128, 48)])
def test_int8_gemm_is_exact(m: int, k: int, n: int) -> None:
    g = torch.Generator().manual_seed(m)
    a = torch.randint(-127, 128, (m, k), generator=g, dtype=torch.int8)
    b = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
    a[0], b[0] = 127, 127  # the largest sum: k * 127^2
    exact = a.long() @ b.long().t()
    for product in (int8_mm(a, b.t()), int8_mm_float64(a, b.t())):
        assert product.dtype == torch.int32 and torch.equal(product.long(), exact)


def _linear(method: LinearMethodBase, n: int, k: int, seed: int, bias: bool = True) -> tuple[Linear, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) / k**0.5
    b = nn.Parameter(torch.randn(n, generator=g), requires_grad=False) if bias else None
    return Linear(nn.Parameter(w.clone(), requires_grad=False), b, method), w


def test_int8_linear_matches_its_dequantized_float64_reference() -> None:
    n, k = 96, 192
    layer, w = _linear(Int8LinearMethod(), n, k, 0)
    assert not hasattr(layer, "weight") and layer.weight_q.dtype == torch.int8
    x = torch.randn(9, k) * torch.linspace(0.1, 10, 9)[:, None]  # rows of very different ranges
    x[2, 5] = 40.0  # an outlier: its row's scale, not the others'
    res = torch.randn(9, n)
    qw, sw = quantize_per_channel(w)
    qx, sx = quantize_per_token(x)
    dot = qx.double() @ qw.double().t()
    ref = dot * sx.double() * sw.double() + layer.bias.double() + res.double()
    out = layer(x, res).double()
    # the int32 sum is exact; acc -> fp32, two multiplies, two adds: <= 5u relative to the terms' magnitudes
    tol = 5 * U * ((dot * sx.double() * sw.double()).abs() + layer.bias.double().abs() + res.double().abs())
    assert bool(((out - ref).abs() <= tol).all()), float(((out - ref).abs() / tol).max())
    # and it is the GEMM of the dequantized operands (x and w fake-quantized), in float64
    fake = F.linear(qx.double() * sx.double(), qw.double() * sw[:, None].double(), layer.bias.double())
    assert bool(((layer(x).double() - fake).abs() <= tol + k * U * fake.abs().max()).all())


# ---- RTN -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("bits, group, cpu_kernel", [(4, 32, True), (4, 128, True), (4, 32, False), (8, 64, False)])
def test_rtn_linear_matches_its_dequantized_float64_reference(bits: int, group: int, cpu_kernel: bool) -> None:
    """fp32: the reference path (dequantize, F.linear), whatever cpu_kernel says."""
    n, k = 80, 256
    layer, w = _linear(RTNLinearMethod(bits, group, cpu_kernel), n, k, bits + group)
    assert layer.weight_int4pack is None  # no kernel for fp32 activations (its fp32 path is scalar: rtn.py)
    q, scales, zeros = quantize_groupwise(w, bits, group)
    s = scales.t().double().repeat_interleave(group, dim=1)
    z = zeros.t().double().repeat_interleave(group, dim=1)
    w_deq = (q.double() - z) * s  # exact in float64
    x, res = torch.randn(5, k), torch.randn(5, n)
    ref = x.double() @ w_deq.t() + layer.bias.double() + res.double()
    out = layer(x, res).double()
    # (q - z) s rounded to fp32 (u relative), a K-term fp32 sum (gamma_K), the bias and residual adds (2u)
    mag = x.double().abs() @ w_deq.abs().t()
    tol = (k + 4) * U * mag + 2 * U * (ref.abs() + layer.bias.double().abs() + res.double().abs())
    assert bool(((out - ref).abs() <= tol).all()), float(((out - ref).abs() / tol).max())


@pytest.mark.parametrize("group", [32, 128])
def test_rtn_int4_cpu_kernel_matches_its_float64_reference_in_bf16(group: int) -> None:
    """bf16 activations take torch's int4 kernel. Its weight is (q - 8) * scale + zero with the layer's own
    bf16 scale and zero (exact in float64); it accumulates in fp32 (gamma_K of the magnitudes) and rounds
    the result to bf16 (u_bf16 = 2^-8 relative; measured: 0.0038 at most)."""
    n, k, u_bf16 = 96, 256, 2.0 ** -8
    g = torch.Generator().manual_seed(group)
    w = (torch.randn(n, k, generator=g) / k**0.5).bfloat16()
    layer = Linear(nn.Parameter(w.clone(), requires_grad=False), None, RTNLinearMethod(4, group))
    assert layer.weight_int4pack is not None and layer.qweight is None
    q, _, _ = quantize_groupwise(w, 4, group)
    sz = layer.scales_and_zeros.double()
    w_k = (q.double() - 8) * sz[..., 0].t().repeat_interleave(group, 1) + sz[..., 1].t().repeat_interleave(group, 1)
    x = torch.randn(6, k, generator=g).bfloat16()
    ref = x.double() @ w_k.t()
    out = layer(x)
    assert out.dtype == torch.bfloat16
    tol = u_bf16 * ref.abs() + (1 + u_bf16) * (k + 4) * U * (x.double().abs() @ w_k.abs().t())
    assert bool(((out.double() - ref).abs() <= tol).all()), float(((out.double() - ref).abs() / tol).max())
    # and its weight is the RTN weight: (q - z) s up to the bf16 rounding of scale and zero
    q2, scales, zeros = quantize_groupwise(w, 4, group)
    w_deq = dequantize_groupwise(q2, scales, zeros, group).double()
    step = scales.t().double().repeat_interleave(group, 1)
    assert bool(((w_k - w_deq).abs() <= u_bf16 * (15 * step + (8 - zeros.t().double().repeat_interleave(group, 1)).abs() * step)).all())


def test_rtn_kernel_is_skipped_where_torch_refuses_the_shape() -> None:
    """torch's CPU int4 packing wants N % 16 == 0: other widths take the reference path, still correct."""
    layer, w = _linear(RTNLinearMethod(4, 32), 24, 64, 3, bias=False)
    assert layer.weight_int4pack is None and layer.qweight.shape == (8, 24)
    x = torch.randn(3, 64)
    ref = x.double() @ RTNLinearMethod(4, 32).dequantized_weight(layer).double().t()
    assert torch.allclose(layer(x).double(), ref, rtol=0, atol=64 * U * float(x.abs().sum(1).max()))
    assert layer(torch.zeros(0, 64)).shape == (0, 24)


def test_weight_bytes_per_scheme() -> None:
    n, k = 64, 128
    dense, _ = _linear(None, n, k, 0)
    int8, _ = _linear(Int8LinearMethod(), n, k, 0)
    int4 = Linear(nn.Parameter(torch.randn(n, k).bfloat16(), requires_grad=False), None, RTNLinearMethod(4, 32))
    ref4, _ = _linear(RTNLinearMethod(4, 32), n, k, 0)
    assert dense.weight_bytes() == 4 * n * k
    assert int8.weight_bytes() == n * k + 4 * n  # int8 weights, an fp32 scale per row
    assert int4.weight_bytes() == n * k // 2 + (k // 32) * n * 2 * 2  # nibbles, bf16 (scale, zero) per group
    assert ref4.weight_bytes() == n * k // 2 + (k // 32) * n * (4 + 1)  # qweight, fp32 scales, uint8 zeros


# ---- the whole engine ----------------------------------------------------------------------------
PROMPTS = [[1, 5, 9, 44, 7], [1, 300, 2, 17, 17, 17, 80, 3, 90], [1, 64]]
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def _tokens(model: str, **kwargs) -> list[list[int]]:
    llm = LLM(model, kv_cache_memory_bytes=2**22, **kwargs)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


def _dequantized_checkpoint(tmp_path, bits: int, group: int) -> str:
    """tiny-llama with every projection weight replaced by its RTN-dequantized values (float64, then fp32:
    (q - z) s is exact in fp32 too, one rounding of a product of a small int and an fp32 scale)."""
    folder = tmp_path / "dequantized"
    shutil.copytree(preset_path("tiny-llama"), folder)
    tensors = load_file(folder / "model.safetensors")
    for name, t in tensors.items():
        if name.endswith(tuple(f"{p}.weight" for p in PROJECTIONS)):
            q, scales, zeros = quantize_groupwise(t.float(), bits, group)
            tensors[name] = dequantize_groupwise(q, scales, zeros, group).to(t.dtype).contiguous()
    save_file(tensors, folder / "model.safetensors")
    return str(folder)


@pytest.mark.parametrize("bits, group", [(4, 32), (8, 64)])
def test_engine_with_rtn_matches_the_dequantized_model(tmp_path, bits: int, group: int) -> None:
    """Greedy tokens token for token: quantizing per fused q|k|v / gate|up row is quantizing each module's
    rows, so the dequantized checkpoint (module by module) is the same model (fp32: the reference path;
    the two differ by fp32 rounding only)."""
    quantized = _tokens("tiny-llama", quantization="rtn", quantization_config={"bits": bits, "group_size": group})
    assert quantized == _tokens(_dequantized_checkpoint(tmp_path, bits, group))
    if bits == 4:  # the scheme really ran: 4 bits changes this tiny model's output
        assert quantized != _tokens("tiny-llama")


def test_lora_deltas_apply_after_the_quantized_gemm(tmp_path) -> None:
    """Unmerged LoRA over a quantized base: the same tokens as the same adapter over the dequantized model,
    and not the base's (the adapter ran)."""
    from engine_core import LoRARequest
    from engine_core.lora.presets import adapter_path

    lora = LoRARequest("r16-all", 1, str(adapter_path("tiny-llama", "r16-all")))

    def tokens(model: str, **kwargs) -> list[list[int]]:
        llm = LLM(model, kv_cache_memory_bytes=2**22, enable_lora=True, max_lora_rank=16, **kwargs)
        outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False, lora_request=[lora] * len(PROMPTS))
        return [o.outputs[0].token_ids for o in outs]

    quantized = tokens("tiny-llama", quantization="rtn", quantization_config={"bits": 4, "group_size": 32})
    assert quantized == tokens(_dequantized_checkpoint(tmp_path, 4, 32))
    assert quantized != _tokens("tiny-llama", quantization="rtn", quantization_config={"bits": 4, "group_size": 32})


class FakeQuantW8A8(LinearMethodBase):
    """W8A8 simulated in float64: x and w rounded exactly as the scheme rounds them, the product of the
    dequantized values. An independent path (no int8 GEMM, no epilogue) through the same seam."""

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        qw, sw = quantize_per_channel(layer.weight.detach())
        layer.w_deq = qw.double() * sw[:, None].double()

    def apply(self, layer: nn.Module, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        qx, sx = quantize_per_token(x)
        y = F.linear(qx.double() * sx.double(), layer.w_deq, None if layer.bias is None else layer.bias.double())
        return (y if residual is None else y + residual.double()).to(x.dtype)

    def weight_bytes(self, layer: nn.Module) -> int:
        return layer.w_deq.nbytes


def test_engine_with_int8_matches_the_fake_quantized_model(monkeypatch) -> None:
    quantized = _tokens("tiny-llama", quantization="int8")
    monkeypatch.setattr(weight_scheme, "get_linear_method", lambda quant, *where: FakeQuantW8A8() if quant else None)
    assert quantized == _tokens("tiny-llama", quantization="int8")


def test_stats_count_the_quantized_weight_bytes() -> None:
    tensors = load_file(preset_path("tiny-llama") / "model.safetensors")
    shapes = {n: t.shape for n, t in tensors.items()}
    proj = [s for n, s in shapes.items() if n.endswith(tuple(f"{p}.weight" for p in PROJECTIONS))]
    other = sum(4 * t.numel() for n, t in tensors.items() if not n.endswith(tuple(f"{p}.weight" for p in PROJECTIONS)))
    expect = {None: other + sum(4 * o * i for o, i in proj),
              "int8": other + sum(o * i + 4 * o for o, i in proj)}
    for scheme, total in expect.items():
        llm = LLM("tiny-llama", quantization=scheme, kv_cache_memory_bytes=2**22)
        assert llm.engine.stats()["weight_bytes"] == total, scheme


# ---- bad input -----------------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs, match", [
    (dict(quantization="fp4"), r"quantization must be one of \('int8', 'rtn', 'gptq', 'awq', 'gguf', 'fp8', 'nf4'\)"),
    (dict(quantization=8), r"quantization must be one of"),
    (dict(quantization="rtn", quantization_config={"bits": 3}), r"quantization_config\['bits'\] must be one of \(4, 8\)"),
    (dict(quantization="rtn", quantization_config={"bits": True}), r"quantization_config\['bits'\]"),
    (dict(quantization="rtn", quantization_config={"group_size": 48}), r"quantization_config\['group_size'\] must be one of"),
    (dict(quantization="rtn", quantization_config={"group": 32}), r"unknown key\(s\) \['group'\]"),
    (dict(quantization="int8", quantization_config={"bits": 8}), r"unknown key\(s\) \['bits'\]"),
    (dict(quantization="rtn", quantization_config=[4, 32]), r"quantization_config must be None or a dict"),
    (dict(quantization_config={"bits": 4}), r"quantization_config must be None when quantization is None"),
    (dict(quantization="int8", tensor_parallel_size=2), r"quantization must be None with tensor_parallel_size"),
])
def test_bad_quantization_arguments_are_refused_by_name(kwargs, match) -> None:
    with pytest.raises(ValueError, match=match):
        EngineConfig(**kwargs)


def test_group_size_not_dividing_an_input_is_refused_before_any_weight_loads(monkeypatch) -> None:
    def no_reading(*args, **kwargs):
        raise AssertionError("a checkpoint was opened before the group size was checked")

    monkeypatch.setattr(llama, "CheckpointReader", no_reading)
    with pytest.raises(ValueError, match=r"quantization_config\['group_size'\] must divide every projection's input "
                                         r"size \(hidden_size=64, .*got 128, which does not divide hidden_size"):
        LLM("tiny-llama", quantization="rtn", quantization_config={"group_size": 128})


def test_defaults() -> None:
    assert EngineConfig().quant_config is None
    assert EngineConfig(quantization="rtn").quant_config == QuantizationConfig("rtn", 4, 128)
    assert EngineConfig(quantization="int8").quant_config == QuantizationConfig("int8", 8, None)
