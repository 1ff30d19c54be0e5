"""SmoothQuant in the engine: `quantization="int8", quantization_config={"smoothquant": FILE, "alpha": a}`.

The migration is exact in float64 (x / s @ (W * s).T == x @ W.T), the smoothed W8A8 layer equals its own float64
fake-quantized reference, it beats plain W8A8 on an input with an outlier channel, the calibration run records
every projection's input maxima under the names the loader asks for, and bad arguments are refused by name.
"""
from __future__ import annotations

import pytest
import torch

from engine_core import LLM
from engine_core.calibrate import calibrate
from engine_core.models.linear import Linear
from engine_core.models.quantization import Int8LinearMethod, SmoothQuantInt8LinearMethod
from engine_core.models.quantization.smoothquant import save_linear_amax, smoothquant_scales
from engine_core.request import SamplingParams

TINY = torch.finfo(torch.float32).tiny


def _outlier_case(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    calib, x = torch.randn(64, 128, generator=gen), torch.randn(32, 128, generator=gen)
    calib[:, 3] *= 100
    x[:, 3] *= 100
    return calib.abs().amax(dim=0), x, torch.randn(48, 128, generator=gen) * 0.05


def _fake_w8a8(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """float64: per-token x codes, per-channel W codes, the exact integer sum times both scales."""
    sw = w.double().abs().amax(dim=1).clamp(min=TINY) / 127
    sx = x.double().abs().amax(dim=1, keepdim=True).clamp(min=TINY) / 127
    qw, qx = torch.round(w.double() / sw[:, None]).clamp(-127, 127), torch.round(x.double() / sx).clamp(-127, 127)
    return qx @ qw.T * sx * sw


def test_smoothed_layer_matches_its_float64_reference_and_beats_plain_w8a8() -> None:
    amax, x, w = _outlier_case()
    s = smoothquant_scales(amax, w, 0.5)
    layer = Linear(torch.nn.Parameter(w.clone(), requires_grad=False), None, SmoothQuantInt8LinearMethod(amax, 0.5))
    plain = Linear(torch.nn.Parameter(w.clone(), requires_grad=False), None, Int8LinearMethod())
    y, y_plain = layer(x), plain(x)
    # fp32 x * (1 / s) differs from x / s by an ulp, which may move a code across a rounding boundary: a few
    # codes off by one, each worth sx * sw (~1e-3 here), so the tolerance is one such step, not fp32's 1e-6
    ref = _fake_w8a8((x * (1.0 / s)).double(), (w.float() * s).double())
    assert torch.allclose(y.double(), ref, rtol=1e-5, atol=2e-3), (y.double() - ref).abs().max()
    exact = x.double() @ w.double().T
    err, err_plain = [((t.double() - exact).norm() / exact.norm()).item() for t in (y, y_plain)]
    assert err < err_plain / 3, (err, err_plain)  # measured: 0.005 against 0.04


def test_migration_is_exact_in_float64() -> None:
    amax, x, w = _outlier_case(1)
    s = smoothquant_scales(amax, w, 0.5).double()
    assert torch.allclose((x.double() / s) @ (w.double() * s).T, x.double() @ w.double().T, rtol=1e-12, atol=1e-12)


def test_weight_bytes_count_the_smoothing_vector() -> None:
    amax, _, w = _outlier_case()
    layer = Linear(torch.nn.Parameter(w.clone(), requires_grad=False), None, SmoothQuantInt8LinearMethod(amax, 0.5))
    assert layer.weight_bytes() == 48 * 128 + 48 * 4 + 128 * 4


@pytest.fixture(scope="module")
def tiny_amax(tmp_path_factory) -> str:
    _, amax = calibrate("tiny-llama", [[3, 4, 5, 6, 7], [9, 8, 7]], max_tokens=2, device="cpu", swap_space=0)
    path = tmp_path_factory.mktemp("sq") / "linear_amax.json"
    save_linear_amax(path, amax, "tiny-llama")
    return str(path)


def test_calibration_names_every_projection_and_the_engine_serves_it(tiny_amax) -> None:
    import json

    amax = json.loads(open(tiny_amax).read())["linear_input_amax"]
    assert sorted(amax) == sorted(f"model.layers.{i}.{p}" for i in range(2) for p in
                                  ("self_attn.q_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.down_proj"))
    assert len(amax["model.layers.0.mlp.down_proj"]) == 128 and len(amax["model.layers.1.self_attn.q_proj"]) == 64
    llm = LLM("tiny-llama", device="cpu", num_gpu_blocks=64, swap_space=0, quantization="int8",
              quantization_config={"smoothquant": tiny_amax, "alpha": 0.5})
    methods = {type(m.quant_method) for m in llm.engine.runner.model.modules() if isinstance(m, Linear)}
    assert SmoothQuantInt8LinearMethod in methods
    out = llm.generate([[3, 4, 5, 6]], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4


@pytest.mark.parametrize("config, match", [
    ({"smoothquant": "/no/such/file.json"}, r"quantization_config\['smoothquant'\]"),
    ({"alpha": 0.5}, r"quantization_config\['alpha'\]"),
    ({"smoothquant": __file__, "alpha": 1.5}, r"quantization_config\['alpha'\]"),
    ({"smoothquant": __file__}, r"quantization_config\['smoothquant'\]"),  # a file, but not of maxima
])
def test_bad_smoothquant_arguments_are_refused_by_name(config, match) -> None:
    with pytest.raises(ValueError, match=match):
        LLM("tiny-llama", device="cpu", num_gpu_blocks=64, swap_space=0, quantization="int8", quantization_config=config)
