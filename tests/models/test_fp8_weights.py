"""`quantization="fp8"` (engine_core/models/quantization/fp8.py): the weight and activation roundings within the
e4m3 bound, the fused per-tensor scales expanded per channel, the kernel against the fp32 reference path, the
layer against the unquantized fp32 product with a derived bound, the whole engine on the tiny presets against a
float64 fake-quantized model (kernels/fp8.py's KV-cache rounding, an independent implementation), bad input.

Bounds: e4m3 keeps 3 mantissa bits, so rounding a normal value to nearest moves it by at most 2^-4 of itself;
below the smallest normal (2^-6) the spacing is 2^-9, so at most 2^-10 absolutely. In units of the scale s:
|v - q(v) s| <= 2^-4 |v| + 2^-10 s, plus the fp32 division v / s (u = 2^-24 relative)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from engine_helpers import one_torch_thread
from safetensors.torch import load_file
from torch import nn

from engine_core import LLM, SamplingParams
from engine_core.config import EngineConfig, QuantizationConfig
from engine_core.models import llama
from engine_core.models.quantization import scheme
from engine_core.models.linear import Linear
from engine_core.models.quantization import Fp8LinearMethod, LinearMethodBase, UnquantizedLinearMethod, fp8
from engine_core.models.quantization.fp8 import (check_fp8_supported, fp8_mm, fp8_mm_reference,
                                                 quantize_activation_fp8, quantize_weight_fp8)
from engine_core.presets import preset_path
import kernels
from kernels.fp8 import quantize_fp8, scale_from_amax

U = 2.0 ** -24
REL, SUB = 2.0 ** -4, 2.0 ** -10  # e4m3's rounding: relative for normal values, absolute (x scale) below
STRATEGIES = [("tensor", "tensor"), ("channel", "token"), ("tensor", "token"), ("channel", "tensor")]


pytestmark = pytest.mark.usefixtures(one_torch_thread.__name__)


def _bound(v: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return REL * v.double().abs() + SUB * scale.double() + 2 * U * v.double().abs()


# ---- rounding ------------------------------------------------------------------------------------
@pytest.mark.parametrize("strategy", ["tensor", "channel"])
def test_weight_rounding_is_within_the_e4m3_bound(strategy: str) -> None:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(40, 96, generator=g) * torch.logspace(-3, 1, 40)[:, None]  # rows of very different ranges
    w[7] = 0.0  # an all-zero row: scale 1, zeros exact
    q, scale = quantize_weight_fp8(w, [40], strategy)
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (40,)
    deq = q.double() * scale.double()[:, None]
    assert bool(((w.double() - deq).abs() <= _bound(w, scale[:, None])).all())
    assert torch.equal(deq[7], torch.zeros(96, dtype=torch.float64))
    if strategy == "channel":  # each row's absmax maps onto 448
        nonzero = torch.arange(40) != 7
        assert bool((q.float().abs().amax(dim=1)[nonzero] == 448).all())
    else:
        assert int(scale.unique().numel()) == 1 and float(q.float().abs().max()) == 448


def test_fused_per_tensor_scales_expand_to_one_per_channel() -> None:
    """q|k|v with per-tensor scales: one scale per module (its amax / 448), repeated over its rows (vLLM's
    convert_to_channelwise), so a small k does not share q's large scale."""
    g = torch.Generator().manual_seed(1)
    widths = [32, 16, 16]
    w = torch.cat([torch.randn(32, 64, generator=g) * 4, torch.randn(16, 64, generator=g) * 1e-4,
                   torch.randn(16, 64, generator=g)])
    q, scale = quantize_weight_fp8(w, widths, "tensor")
    expect = torch.cat([torch.full((n,), float(part.abs().max()) / 448) for n, part in zip(widths, w.split(widths))])
    assert torch.allclose(scale, expect, rtol=2 * U, atol=0)
    deq = q.double() * scale.double()[:, None]
    assert bool(((w.double() - deq).abs() <= _bound(w, scale[:, None])).all())
    k_rows = slice(32, 48)

    def k_error(deq: torch.Tensor) -> float:  # k's largest error relative to its largest weight
        return float((deq[k_rows] - w[k_rows].double()).abs().max() / w[k_rows].abs().max())

    shared_q, shared = quantize_weight_fp8(w, [64], "tensor")  # one scale over the fused matrix: k in subnormals
    assert k_error(deq) <= REL and k_error(shared_q.double() * shared.double()[:, None]) > REL


@pytest.mark.parametrize("strategy", ["tensor", "token"])
def test_activation_rounding_is_within_the_e4m3_bound(strategy: str) -> None:
    x = torch.randn(9, 64, generator=torch.Generator().manual_seed(2)) * torch.linspace(0.01, 20, 9)[:, None]
    q, scale = quantize_activation_fp8(x, strategy)
    assert scale.shape == ((9, 1) if strategy == "token" else (1, 1))
    assert bool(((x.double() - q.double() * scale.double()).abs() <= _bound(x, scale)).all())
    assert quantize_activation_fp8(torch.zeros(0, 64), strategy)[0].shape == (0, 64)


# ---- the GEMM ------------------------------------------------------------------------------------
@pytest.mark.parametrize("m, k, n", [(1, 576, 960), (7, 64, 24), (33, 100, 48)])
def test_kernel_and_reference_path_equal_the_exact_fp8_product(m: int, k: int, n: int) -> None:
    """Products of two e4m3 values are exact in fp32; the sums differ from the float64 one by order only:
    <= gamma_K ~ K u relative to sum |qx| |qw|."""
    g = torch.Generator().manual_seed(m)
    qx = (torch.randn(m, k, generator=g) * 50).clamp(-448, 448).to(torch.float8_e4m3fn)
    qw = (torch.randn(n, k, generator=g) * 50).clamp(-448, 448).to(torch.float8_e4m3fn)
    exact = qx.double() @ qw.double().t()
    tol = k * U * (qx.double().abs() @ qw.double().abs().t())
    for product in (fp8_mm(qx, qw), fp8_mm_reference(qx, qw)):
        assert product.dtype == torch.float32 and bool(((product.double() - exact).abs() <= tol).all())


def _layer(method: LinearMethodBase, n: int, k: int, seed: int) -> tuple[Linear, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    w, b = torch.randn(n, k, generator=g) / k**0.5, torch.randn(n, generator=g)
    return Linear(nn.Parameter(w.clone(), requires_grad=False), nn.Parameter(b, requires_grad=False), method), w, b


@pytest.mark.parametrize("weight_strategy, activation_strategy", STRATEGIES)
def test_fp8_linear_is_within_its_bound_of_the_fp32_product(weight_strategy: str, activation_strategy: str) -> None:
    """|x^ w^ - x w| <= |x^ - x| |w^| + |x| |w^ - w| per product, each difference within the e4m3 bound; the fp32
    sum and epilogue add (K + 4) u of sum |x^| |w^| (and u of the bias and residual)."""
    n, k = 48, 128
    layer, w, b = _layer(Fp8LinearMethod([16, 32], weight_strategy, activation_strategy), n, k, 3)
    reference, _, _ = _layer(Fp8LinearMethod([16, 32], weight_strategy, activation_strategy, use_kernel=False), n, k, 3)
    assert not hasattr(layer, "weight") and layer.weight_fp8.dtype == torch.float8_e4m3fn
    x = torch.randn(9, k, generator=torch.Generator().manual_seed(4)) * torch.linspace(0.1, 10, 9)[:, None]
    res = torch.randn(9, n)
    exact = x.double() @ w.double().t() + b.double() + res.double()
    qx, sx = quantize_activation_fp8(x, activation_strategy)
    wq = layer.quant_method.dequantized_weight(layer).double()
    xq = qx.double() * sx.double()
    ex, ew = _bound(x, sx), _bound(w, layer.weight_scale[:, None])
    tol = ex @ wq.abs().t() + x.double().abs() @ ew.t() + (k + 4) * U * (xq.abs() @ wq.abs().t()) + \
        2 * U * (b.double().abs() + res.double().abs())
    for out in (layer(x, res).double(), reference(x, res).double()):
        err = (out - exact).abs()
        assert bool((err <= tol).all()), float((err / tol).max())
        assert float(err.max()) > 0  # fp8 really ran: the product is not fp32's
    # the bound says something: within a few percent of the terms' magnitudes
    assert float((tol / (x.double().abs() @ w.double().abs().t())).max()) < 0.2


def test_where_the_backend_is_triton_the_layer_runs_the_triton_fp8_gemm(monkeypatch) -> None:
    """KERNELS_BACKEND=triton on CPU (the interpreter; on CUDA the default): `kernels.fp8_gemm` computes the
    sum and both scales. Its fp32 accumulation differs from the reference's only in order, so the two agree to
    (K + 4) u of sum |x^| |w^| (the bound above's rounding term); a kernel that dropped a scale would be off by
    the output's size."""
    monkeypatch.setenv("KERNELS_BACKEND", "triton")
    calls, triton_gemm = [], kernels.fp8_gemm
    monkeypatch.setattr(kernels, "fp8_gemm", lambda *a, **k: calls.append(a) or triton_gemm(*a, **k))
    n, k = 32, 64
    for strategies in STRATEGIES:
        layer, _, _ = _layer(Fp8LinearMethod([16, 16], *strategies), n, k, 7)
        reference, _, _ = _layer(Fp8LinearMethod([16, 16], *strategies, use_kernel=False), n, k, 7)
        x = torch.randn(5, k, generator=torch.Generator().manual_seed(8))
        got, want = layer(x).double(), reference(x).double()
        qx, sx = quantize_activation_fp8(x, strategies[1])
        xq = qx.double() * sx.double()
        tol = (k + 4) * U * (xq.abs() @ reference.quant_method.dequantized_weight(reference).double().abs().t())
        assert bool(((got - want).abs() <= tol + 2 * U * want.abs()).all()), strategies
    assert len(calls) == len(STRATEGIES)


def test_fp8_linear_takes_any_row_count_and_3d_rows() -> None:
    layer, _, _ = _layer(Fp8LinearMethod(None, "channel", "token"), 32, 64, 5)
    assert layer(torch.zeros(0, 64)).shape == (0, 32)
    x = torch.randn(2, 3, 64)
    assert torch.allclose(layer(x), layer(x.reshape(6, 64)).reshape(2, 3, 32))


def test_weight_bytes() -> None:
    layer, _, _ = _layer(Fp8LinearMethod([16, 16], "tensor", "tensor"), 32, 64, 6)
    assert layer.weight_bytes() == 32 * 64 + 4 * 32  # one byte a weight, an fp32 scale per row (expanded)


# ---- the whole engine ----------------------------------------------------------------------------
PROMPTS = [[1, 5, 9, 44, 7], [1, 300, 2, 17, 17, 17, 80, 3, 90], [1, 64], [1, 200, 201, 202, 7, 7]]
GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)


class FakeFp8(LinearMethodBase):
    """fp8 simulated in float64 with the KV cache's fp8 rounding (kernels/fp8.py, lab 08's code): w and x rounded
    as the scheme's strategies say (activation_strategy None: x not rounded, the CPU's weight-only W8A16), the
    product of the dequantized values."""

    def __init__(self, widths: list[int], weight_strategy: str, activation_strategy: str | None) -> None:
        self.widths, self.weight_strategy, self.activation_strategy = widths, weight_strategy, activation_strategy

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        w = layer.weight.detach().float()
        if self.weight_strategy == "channel":
            scale = scale_from_amax(w.abs().amax(dim=1), torch.float8_e4m3fn)
        else:
            scale = torch.cat([scale_from_amax(p.abs().amax(), torch.float8_e4m3fn).expand(p.shape[0])
                               for p in w.split(self.widths)])
        layer.w_deq = quantize_fp8(w, scale).double() * scale.double()[:, None]

    def apply(self, layer: nn.Module, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        if self.activation_strategy is None:
            x_deq = x.double()
        else:
            amax = x.abs().amax(dim=1) if self.activation_strategy == "token" else x.abs().amax()
            sx = scale_from_amax(amax, torch.float8_e4m3fn)
            x_deq = quantize_fp8(x, sx).double() * (sx.double()[:, None] if sx.dim() else sx.double())
        y = F.linear(x_deq, layer.w_deq, None if layer.bias is None else layer.bias.double())
        return (y if residual is None else y + residual.double()).to(x.dtype)

    def weight_bytes(self, layer: nn.Module) -> int:
        return layer.w_deq.nbytes


def _tokens(model: str, **kwargs) -> list[list[int]]:
    llm = LLM(model, kv_cache_memory_bytes=2**22, **kwargs)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


@pytest.mark.parametrize("model, weight_strategy, activation_strategy", [
    ("tiny-llama", "tensor", "tensor"), ("tiny-llama", "channel", "token"), ("tiny-qwen2", "tensor", "token"),
    ("tiny-qwen3", "channel", "tensor")])
def test_engine_with_fp8_matches_the_fake_quantized_model(monkeypatch, model: str, weight_strategy: str,
                                                          activation_strategy: str) -> None:
    """Greedy tokens, token for token, on presets with GQA (tiny-llama), q|k|v biases (tiny-qwen2), tied embeddings
    and q/k norms (tiny-qwen3); fp32 kernels vs float64 emulation differ by fp32 rounding only. On CPU the scheme
    is weight-only (no fp8 arithmetic): the activation strategy is accepted and x stays fp32."""
    options = {"weight_strategy": weight_strategy, "activation_strategy": activation_strategy}
    quantized = _tokens(model, quantization="fp8", quantization_config=options)

    def fake(quant, prefix=None, in_features=None, widths=None):
        return FakeFp8(widths, weight_strategy, None) if quant else UnquantizedLinearMethod()

    assert quantized != _tokens(model)  # the scheme really ran: fp8 changes these tiny models' greedy tokens
    monkeypatch.setattr(scheme, "get_linear_method", fake)
    assert quantized == _tokens(model, quantization="fp8", quantization_config=options)


def test_every_projection_is_fp8_and_the_lm_head_is_not() -> None:
    model = LLM("tiny-qwen2", quantization="fp8", kv_cache_memory_bytes=2**22).engine.runner.model
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    assert isinstance(model.lm_head_proj.quant_method, UnquantizedLinearMethod)
    assert model.lm_head_proj.weight.dtype == torch.float32
    projections = [m for m in linears if m is not model.lm_head_proj]
    assert len(projections) == 4 * model.args.num_layers  # q|k|v, o, gate|up, down
    assert all(isinstance(m.quant_method, Fp8LinearMethod) for m in projections)
    qkv = model.layers[0].attn.qkv_proj
    widths = [model.args.num_heads * model.args.head_dim] + [model.args.num_kv_heads * model.args.head_dim] * 2
    assert qkv.quant_method.logical_widths == widths
    assert int(qkv.weight_scale.unique_consecutive().numel()) == 3  # q's, k's and v's per-tensor scale


def test_stats_split_the_weight_bytes_by_scheme() -> None:
    tensors = load_file(preset_path("tiny-llama") / "model.safetensors")
    proj = [t.shape for n, t in tensors.items() if n.endswith("_proj.weight")]
    other = sum(4 * t.numel() for n, t in tensors.items() if not n.endswith("_proj.weight"))
    layers = len(proj) // 7
    scales = 4 * sum(o for o, _ in proj)  # an fp32 scale per output row (per-tensor ones expanded)
    stats = LLM("tiny-llama", quantization="fp8", kv_cache_memory_bytes=2**22).engine.stats()
    assert stats["weight_bytes_by_scheme"] == {"fp8": sum(o * i for o, i in proj) + scales, "float32": other}
    assert stats["weight_bytes"] == sum(stats["weight_bytes_by_scheme"].values()) and layers == 2


# ---- bad input -----------------------------------------------------------------------------------
@pytest.mark.parametrize("config, match", [
    ({"weight_strategy": "group"}, r"quantization_config\['weight_strategy'\] must be one of \('tensor', 'channel'\)"),
    ({"activation_strategy": "channel"}, r"quantization_config\['activation_strategy'\] must be one of "
                                         r"\('tensor', 'token'\)"),
    ({"activation_scheme": "static"}, r"quantization_config\['activation_scheme'\] must be one of \('dynamic',\)"),
    ({"bits": 8}, r"unknown key\(s\) \['bits'\] for quantization='fp8'"),
    ("tensor", r"quantization_config must be None or a dict"),
])
def test_bad_fp8_options_are_refused_by_name(config, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        EngineConfig(quantization="fp8", quantization_config=config)


def test_defaults_are_vllms_online_fp8() -> None:
    assert EngineConfig(quantization="fp8").quant_config == QuantizationConfig(
        "fp8", 8, None, weight_strategy="tensor", activation_strategy="tensor")


def test_a_device_without_fp8_gemms_is_refused(monkeypatch) -> None:
    monkeypatch.setattr(fp8, "_cuda_capability", lambda device: (8, 0))  # an A100
    with pytest.raises(ValueError, match=r"quantization='fp8' needs fp8 tensor cores \(CUDA compute capability >= "
                                         r"8\.9.*got cuda:0 with capability 8\.0"):
        check_fp8_supported(torch.device("cuda:0"))
    monkeypatch.setattr(fp8, "_cuda_capability", lambda device: (9, 0))  # an H100
    check_fp8_supported(torch.device("cuda:0"))
    with pytest.raises(ValueError, match=r"quantization='fp8' runs on cpu or cuda .* got device meta"):
        check_fp8_supported(torch.device("meta"))


def test_an_unsupported_device_is_refused_before_any_weight_loads(monkeypatch) -> None:
    def refuse(device):
        raise ValueError(f"no fp8 on {device}")

    def no_reading(*args, **kwargs):
        raise AssertionError("a checkpoint was opened before the device was checked")

    monkeypatch.setattr(scheme, "check_fp8_supported", refuse)
    monkeypatch.setattr(llama, "CheckpointReader", no_reading)
    with pytest.raises(ValueError, match=r"no fp8 on cpu"):
        LLM("tiny-llama", quantization="fp8", kv_cache_memory_bytes=2**22)
