"""kernels/fp8.py: the fp8 KV formats' scale, quantize (saturating, round to nearest even) and
dequantize, against torch's own float8 casts, which round correctly on CPU; and the reference
cache write that uses them."""
from __future__ import annotations

import pytest
import torch

from kernels import reference
from kernels.fp8 import dequantize_fp8, fp8_dtype, fp8_max, kv_storage_dtype, quantize_fp8, scale_from_amax

FORMATS = [torch.float8_e4m3fn, torch.float8_e5m2]


def test_vllm_names_map_to_formats():
    assert fp8_dtype("fp8") == fp8_dtype("fp8_e4m3") == torch.float8_e4m3fn
    assert fp8_dtype("fp8_e5m2") == torch.float8_e5m2 and fp8_dtype("auto") is None
    assert (fp8_max(torch.float8_e4m3fn), fp8_max(torch.float8_e5m2)) == (448.0, 57344.0)
    assert fp8_dtype("int8") is None and kv_storage_dtype("int8") == torch.int8  # int8: not an fp8 format
    assert kv_storage_dtype("fp8") == torch.float8_e4m3fn and kv_storage_dtype("auto") is None
    with pytest.raises(ValueError, match=r"kv_cache_dtype must be one of \('auto', 'fp8', 'fp8_e4m3', 'fp8_e5m2', "
                                         r"'int8'\)"):
        fp8_dtype("int4")


@pytest.mark.parametrize("fmt", FORMATS, ids=str)
def test_quantize_is_torchs_cast_of_x_over_scale(fmt):
    x = torch.randn(64, 3, 16, generator=torch.Generator().manual_seed(0)) * 5
    got = quantize_fp8(x, 0.02, fmt)
    assert got.dtype == fmt
    assert torch.equal(got.view(torch.uint8), (x / 0.02).clamp(-fp8_max(fmt), fp8_max(fmt)).to(fmt).view(torch.uint8))


@pytest.mark.parametrize("fmt", FORMATS, ids=str)
def test_per_head_scales_divide_each_head_by_its_own(fmt):
    x = torch.randn(10, 3, 8, generator=torch.Generator().manual_seed(1))
    scale = torch.tensor([0.01, 1.0, 50.0])
    got = quantize_fp8(x, scale, fmt)
    for h in range(3):
        assert torch.equal(got[:, h].view(torch.uint8), quantize_fp8(x[:, h], float(scale[h]), fmt).view(torch.uint8))
    back = dequantize_fp8(got, scale, torch.float32)
    for h in range(3):
        assert torch.equal(back[:, h], got[:, h].float() * scale[h])


@pytest.mark.parametrize("fmt", FORMATS, ids=str)
def test_saturates_at_the_format_max_never_nan_or_inf(fmt):
    big = fp8_max(fmt)
    x = torch.tensor([1e30, -1e30, float("inf"), float("-inf"), 3 * big, big, 0.0, -0.0])
    got = quantize_fp8(x, 1.0, fmt).float()
    assert got.tolist() == [big, -big, big, -big, big, big, 0.0, 0.0]
    if fmt == torch.float8_e5m2:  # why the clamp: a plain cast overflows to inf (an inf K makes NaN logits)
        assert torch.tensor([1e6]).to(fmt).float().isinf().all()


def test_torchs_own_e4m3_cast_saturates_as_lab_08_says():
    """Lab 08 section 1 states what the pinned torch's plain cast does past 448 (older torch gave NaN
    above 464): if a torch upgrade changes it, this fails and the text must change with it."""
    assert torch.__version__.startswith("2.13")
    x = torch.tensor([448.0, 464.0, 470.0, 480.0, 1e6, float("inf"), float("-inf"), float("nan")])
    got = x.to(torch.float8_e4m3fn)
    assert got.float()[:7].tolist() == [448.0] * 6 + [-448.0] and got.float()[7].isnan()
    assert got.view(torch.uint8).tolist() == [0x7E] * 6 + [0xFE, 0x7F]  # 0x7F, the NaN code, only for NaN


@pytest.mark.parametrize("fmt", FORMATS, ids=str)
def test_scale_from_amax_uses_the_whole_range(fmt):
    amax = torch.tensor([896.0, 0.0, 3.5])
    scale = scale_from_amax(amax, fmt)
    assert scale.dtype == torch.float32
    assert scale.tolist() == pytest.approx([896.0 / fp8_max(fmt), 1.0, 3.5 / fp8_max(fmt)])
    x = torch.tensor([[896.0, 0.0, -3.5]])[..., None]  # [1 token, 3 heads, 1 dim]: each head's amax maps to max
    assert quantize_fp8(x, scale, fmt).float().flatten().tolist() == [fp8_max(fmt), 0.0, -fp8_max(fmt)]


@pytest.mark.parametrize("kv_cache_dtype, fmt", [("fp8", torch.float8_e4m3fn), ("fp8_e4m3", torch.float8_e4m3fn),
                                                 ("fp8_e5m2", torch.float8_e5m2), ("auto", torch.float8_e5m2)])
def test_reference_cache_write_stores_the_quantized_rows(kv_cache_dtype, fmt):
    gen = torch.Generator().manual_seed(2)
    key, value = torch.randn(5, 2, 8, generator=gen) * 30, torch.randn(5, 2, 8, generator=gen)
    k_scale, v_scale = torch.tensor([0.05, 0.2]), torch.tensor(0.01)
    kc = torch.zeros(2, 4, 2, 8, dtype=fmt)
    vc = torch.zeros_like(kc)
    slots = torch.tensor([6, -1, 0, 3, 7])
    reference.reshape_and_cache(key, value, kc, vc, slots, kv_cache_dtype, k_scale, v_scale)
    flat_k, flat_v = kc.view(-1, 2, 8), vc.view(-1, 2, 8)
    for row, slot in enumerate(slots.tolist()):
        if slot < 0:
            continue
        want_k = torch.stack([(key[row, h] / k_scale[h]).clamp(-fp8_max(fmt), fp8_max(fmt)).to(fmt) for h in range(2)])
        assert torch.equal(flat_k[slot].view(torch.uint8), want_k.view(torch.uint8))
        assert torch.equal(flat_v[slot].view(torch.uint8), (value[row] / 0.01).clamp(-fp8_max(fmt), fp8_max(fmt))
                           .to(fmt).view(torch.uint8))
    assert not flat_k.float().isnan().any()


def test_a_kv_cache_dtype_that_disagrees_with_the_cache_is_an_error():
    kc = torch.zeros(1, 4, 1, 8, dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="kv_cache_dtype='fp8_e5m2' needs a torch.float8_e5m2 cache"):
        reference.reshape_and_cache(torch.zeros(1, 1, 8), torch.zeros(1, 1, 8), kc, kc.clone(), torch.tensor([0]),
                                    "fp8_e5m2")
