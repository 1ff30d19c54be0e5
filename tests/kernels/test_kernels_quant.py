"""The weight-quantized GEMMs (W4A16 in GPTQ's layout, FP8 with vLLM's scale shapes): the Triton kernels and the
PyTorch reference (kernels/quant_reference.py) against a float64 oracle written from the contract, not from
the reference's code: the weight dequantized entry by entry through each column's group index (act-order's
g_idx as the checkpoint stores it, so the load-time permutation is checked too).

Cases are small (the interpreter is slow) but awkward: ragged M (1, 5, 19: inside one 16-row tile, and
across two), N not a multiple of the tile, group sizes 32 / 64 / 128, act-order, float zeros (GGUF Q4_1),
every fp8 scale shape, a bias, empty M.
"""
from __future__ import annotations

import pytest
import torch

import kernels
from kernels.quant_reference import act_order_permutation
from kernels.triton._gemm_tiles import gemm_tiles

N, FP8 = 40, torch.float8_e4m3fn
# fp32 accumulation in another order than the oracle: |err| <= ~K * u32 * sum|terms| (K <= 256 here, u32 = 6e-8);
# 1e-5 leaves a wide margin. fp16 inputs and int4 levels times fp16 scales are exact in fp32.
REL = 1e-5
# the interpreter computes bf16 wrongly (docs/architecture.md): bf16 only where the kernels are compiled
BF16_CASES = [(17, 128, 64, True, False, torch.bfloat16)] if torch.cuda.is_available() else []
UNIT = {torch.float32: 2.0**-24, torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}  # unit roundoff of the output


def _skip_without_fp8_tensor_cores(device: torch.device, backend: str) -> None:
    """The Triton fp8 GEMM is refused by design below sm_89 (T4, A100, A10G): skip there, saying why."""
    if backend == "triton" and device.type == "cuda":
        from kernels.triton.fp8_gemm import fp8_gemm_refusal
        if reason := fp8_gemm_refusal(torch.cuda.get_device_capability(device), torch.cuda.get_device_name(device)):
            pytest.skip(reason)


def _pack(q: torch.Tensor) -> torch.Tensor:
    """q `[N, K]` (values 0..15) -> GPTQ's int32 `[K / 8, N]`, word by word (value j at bits 4j)."""
    n, k = q.shape
    words = torch.zeros(k // 8, n, dtype=torch.int64)
    for j in range(8):
        words |= q.t()[j::8].long() << (4 * j)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def _assert_close(got: torch.Tensor, expected: torch.Tensor, bound: torch.Tensor, what: str, seed: int) -> None:
    assert got.shape == expected.shape, f"{what}: shape {tuple(got.shape)} != {tuple(expected.shape)}"
    err = (got.cpu().double() - expected).abs()
    bad = ~(err <= bound + 1e-12)  # NaN fails too
    if bad.any():
        i = tuple(bad.nonzero()[0].tolist())
        raise AssertionError(f"{what}: at {i} got {got[i].item():.7g}, expected {expected[i].item():.7g} "
                             f"(|err| {err[i].item():.3g} > bound {bound[i].item():.3g}); {int(bad.sum())} entries off; "
                             f"seed {seed}")


def _w4_case(gen: torch.Generator, m: int, k: int, group: int, act_order: bool, float_zeros: bool):
    """(x float64 [M, K], stored (qweight, scales, zeros, perm), the checkpoint's weight float64 [N, K])."""
    g = k // group
    q = torch.randint(0, 16, (N, k), generator=gen, dtype=torch.int32)
    scales = (torch.rand(g, N, generator=gen) * 0.02 + 0.001).half()  # fp16 as checkpoints store them
    zeros = (torch.randn(g, N, generator=gen) * 0.05).half() if float_zeros else \
        torch.randint(0, 16, (g, N), generator=gen, dtype=torch.int32).to(torch.uint8)
    g_idx = torch.arange(k) // group
    if act_order:
        g_idx = g_idx[torch.randperm(k, generator=gen)]
    w = torch.empty(N, k, dtype=torch.float64)
    for col in range(k):  # the contract, column by column through its group
        s, z = scales[g_idx[col]].double(), zeros[g_idx[col]].double()
        w[:, col] = q[:, col].double() * s + z if float_zeros else (q[:, col].double() - z) * s
    perm = act_order_permutation(g_idx, group) if act_order else None
    stored = q if perm is None else q[:, perm]
    x = torch.randn(m, k, generator=gen, dtype=torch.float64)
    return x, (_pack(stored), scales, zeros, perm), w


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("m, k, group, act_order, float_zeros, dtype", [
    (1, 128, 32, False, False, torch.float16), (5, 128, 64, True, False, torch.float16),
    (2, 256, 32, True, False, torch.float16),
    (19, 256, 128, False, False, torch.float32), (19, 128, 32, True, False, torch.float32),
    (3, 64, 32, False, True, torch.float16)] + BF16_CASES, ids=str)
def test_w4a16_matches_the_oracle(seed: int, device: torch.device, backend: str, m: int, k: int, group: int,
                                  act_order: bool, float_zeros: bool, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(seed)
    x64, (qweight, scales, zeros, perm), w = _w4_case(gen, m, k, group, act_order, float_zeros)
    x = x64.to(dtype)
    expected = x.double() @ w.t()
    # on a GPU the fp16 tile of the dequantized weight is rounded once more before the tensor cores
    rel = REL + (UNIT[dtype] if device.type == "cuda" and dtype != torch.float32 else 0.0)
    bound = rel * (x.double().abs() @ w.abs().t()) + UNIT[dtype] * expected.abs()
    args = [t.to(device) for t in (x, qweight, scales, zeros)]
    got = kernels.w4a16_gemm(*args, group, None if perm is None else perm.to(device), backend=backend)
    assert got.dtype == dtype
    _assert_close(got, expected, bound, f"w4a16 {backend} M={m} K={k} group={group} act_order={act_order}", seed)


def test_act_order_permutation_makes_groups_contiguous() -> None:
    g_idx = torch.tensor([1, 0, 1, 0, 2, 2])
    perm = act_order_permutation(g_idx, 2)
    assert perm.tolist() == [1, 3, 0, 2, 4, 5] and g_idx[perm].tolist() == [0, 0, 1, 1, 2, 2]
    assert act_order_permutation(torch.tensor([0, 0, 0, 1]), 2) is None  # unequal groups: no contiguous layout


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("m, per_token, per_channel, bias, out_dtype", [
    (1, False, False, False, torch.float32), (5, True, True, True, torch.float16),
    (19, True, False, False, torch.float32), (19, False, True, True, torch.float32)], ids=str)
def test_fp8_gemm_matches_the_oracle(seed: int, device: torch.device, backend: str, m: int, per_token: bool,
                                     per_channel: bool, bias: bool, out_dtype: torch.dtype) -> None:
    _skip_without_fp8_tensor_cores(device, backend)
    gen = torch.Generator().manual_seed(seed)
    k = 150  # not a multiple of the 32-wide K tile; 5 tiles: split in two where M <= 16 (_gemm_tiles.py)
    a = (torch.randn(m, k, generator=gen) * 4).to(FP8)
    w = (torch.randn(N, k, generator=gen) * 4).to(FP8)
    a_scale = torch.rand(m if per_token else 1, 1, generator=gen) + 0.5
    w_scale = torch.rand(N if per_channel else 1, 1, generator=gen) + 0.5
    a_scale = a_scale if per_token else a_scale.reshape(1)
    w_scale = w_scale.reshape(-1) if per_channel and m == 5 else w_scale if per_channel else w_scale.reshape(1)  # [N] too
    b = torch.randn(N, generator=gen).to(out_dtype) if bias else None
    s = a_scale.double().reshape(-1, 1) * w_scale.double().reshape(1, -1)
    terms = a.double() @ w.double().t()
    expected = terms * s + (0 if b is None else b.double())
    bound = REL * (a.double().abs() @ w.double().abs().t()) * s + UNIT[out_dtype] * expected.abs()
    got = kernels.fp8_gemm(a.to(device), a_scale.to(device), w.to(device), w_scale.to(device), out_dtype,
                           None if b is None else b.to(device), backend=backend)
    assert got.dtype == out_dtype
    _assert_close(got, expected, bound, f"fp8 {backend} M={m} per_token={per_token} per_channel={per_channel}", seed)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_empty_batches(device: torch.device, backend: str) -> None:
    x = torch.empty(0, 64, dtype=torch.float16, device=device)
    q, s, z = (torch.zeros(8, N, dtype=torch.int32), torch.ones(2, N, dtype=torch.float16),
               torch.zeros(2, N, dtype=torch.uint8))
    assert kernels.w4a16_gemm(x, q.to(device), s.to(device), z.to(device), 32, backend=backend).shape == (0, N)
    _skip_without_fp8_tensor_cores(device, backend)
    a, w = torch.empty(0, 64, dtype=FP8, device=device), torch.zeros(N, 64, dtype=FP8, device=device)
    one = torch.ones(1, device=device)
    assert kernels.fp8_gemm(a, one, w, one, torch.float16, backend=backend).shape == (0, N)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_bad_arguments_are_refused_naming_them(device: torch.device, backend: str) -> None:
    x = torch.zeros(2, 64, dtype=torch.float16, device=device)
    q, s, z = (torch.zeros(8, N, dtype=torch.int32, device=device), torch.ones(2, N, dtype=torch.float16, device=device),
               torch.zeros(2, N, dtype=torch.uint8, device=device))
    with pytest.raises(ValueError, match=r"group_size must be a positive divisor of K = 64, got 48"):
        kernels.w4a16_gemm(x, q, s, z, 48, backend=backend)
    with pytest.raises(ValueError, match=r"scales must be \[K / group_size, N\] = \[4, 40\]"):
        kernels.w4a16_gemm(x, q, s, z, 16, backend=backend)
    with pytest.raises(ValueError, match=r"qweight must be int32 \[K / 8, N\]"):
        kernels.w4a16_gemm(x, q[:4], s, z, 32, backend=backend)
    a, w = torch.zeros(3, 64, dtype=FP8, device=device), torch.zeros(N, 64, dtype=FP8, device=device)
    one = torch.ones(1, device=device)
    with pytest.raises(ValueError, match=r"a_scale must be \[1\] \(per tensor\) or \[M, 1\] = \[3, 1\]"):
        kernels.fp8_gemm(a, torch.ones(1, 3, device=device), w, one, torch.float16, backend=backend)
    with pytest.raises(ValueError, match=r"w_scale must be \[1\] \(per tensor\) or \[N, 1\] = \[40, 1\]"):
        kernels.fp8_gemm(a, one, w, torch.ones(2, 1, device=device), torch.float16, backend=backend)
    with pytest.raises(ValueError, match=r"w_fp8 must be 2-D float8_e4m3fn"):
        kernels.fp8_gemm(a, one, w.half(), one, torch.float16, backend=backend)


def test_fp8_gemm_refuses_a_gpu_without_fp8_tensor_cores(monkeypatch: pytest.MonkeyPatch) -> None:
    """An A100 (sm_80) has no fp8 MMA: a clear error before any launch (the device query is faked)."""
    from kernels.triton import fp8_gemm as module
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    with pytest.raises(RuntimeError, match=r"compute capability >= 8.9 .* NVIDIA A100-SXM4-80GB is 8.0"):
        module.check_fp8_support(torch.device("cuda", 0))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    module.check_fp8_support(torch.device("cuda", 0))  # an H100 / H200 passes


def test_split_k_where_decode_leaves_the_gpu_idle() -> None:
    """M = 1 on 132 SMs: 128 output tiles of 64 columns, split 5 ways over K (>= 4 programs per SM); M = 256
    already has the work and does not split; the interpreter's small cases above run both paths."""
    cfg, split, per_split = gemm_tiles(1, 8192, 8192, 128, 132, interpret=False)
    assert (cfg["BLOCK_N"], split, per_split) == (64, 5, 13)
    assert gemm_tiles(256, 8192, 8192, 128, 132, interpret=False)[1] == 1
    assert gemm_tiles(1, N, 128, 32, 1, interpret=True)[1] == 2 and gemm_tiles(19, N, 128, 32, 1, interpret=True)[1] == 1
    assert gemm_tiles(5, N, 150, 32, 1, interpret=True)[1] == 2  # the fp8 cases' K: the last split is short
