"""Multi-LoRA ops (SGMV / BGMV shrink and expand): the Triton kernels and the PyTorch reference
against a float64 oracle written row by row from the contract (kernels/lora_reference.py).

Cases are small (the interpreter is slow) but awkward: feature sizes that are not multiples of
the kernels' tiles, a rank below the 16-wide tile, rows without an adapter (slot -1) between
rows with one, an empty segment, a segment longer than one row tile, slots in any order, and the
expand writing into a column slice of a wider output (how fused q|k|v is served).
"""
from __future__ import annotations

import pytest
import torch

import kernels

K, N, RANK, NUM_SLOTS = 70, 45, 12, 3
# The kernels and the reference accumulate in fp32 in another order than the oracle: |err| <= ~K * u * sum|terms|.
# 1e-5 relative to the sum of |terms| leaves a wide margin over fp32's ~6e-8 * K; fp16 inputs are exact in fp32.
REL = 1e-5


def _weights(gen: torch.Generator, dtype: torch.dtype, device: torch.device):
    a = torch.randn(NUM_SLOTS, RANK, K, generator=gen, dtype=torch.float64)
    b = torch.randn(NUM_SLOTS, N, RANK, generator=gen, dtype=torch.float64)
    scaling = torch.tensor([0.5, 2.0, 1.25], dtype=torch.float32)
    return a.to(device, dtype), b.to(device, dtype), scaling.to(device)


def _oracle(x, a, b, scaling, y0, slots: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(t, y, bound): float64 shrink and expand row by row, and the |err| each y entry may have."""
    x64, a64, b64 = x.cpu().double(), a.cpu().double(), b.cpu().double()
    t = torch.zeros(len(slots), RANK, dtype=torch.float64)
    y = y0.cpu().double().clone()
    bound = torch.zeros_like(y)
    for i, s in enumerate(slots):
        if s < 0:
            continue
        t[i] = a64[s] @ x64[i]
        y[i] += float(scaling[s]) * (b64[s] @ t[i])
        bound[i] = REL * float(scaling[s]) * (b64[s].abs() @ (a64[s].abs() @ x64[i].abs())) + REL * y0[i].cpu().double().abs()
    return t, y, bound


def _assert_close(got: torch.Tensor, expected: torch.Tensor, bound: torch.Tensor, what: str, seed: int) -> None:
    err = (got.cpu().double() - expected).abs()
    bad = err > bound + 1e-12
    if bad.any():
        i = tuple(bad.nonzero()[0].tolist())
        raise AssertionError(f"{what}: at {i} got {got[i].item():.7g}, expected {expected[i].item():.7g} "
                             f"(|err| {err[i].item():.3g} > bound {bound[i].item():.3g}); {int(bad.sum())} entries off; "
                             f"seed {seed}")


SEGMENTS = [(0, 5), (2, 0), (-1, 3), (1, 20), (0, 1), (2, 4)]  # (slot, rows): 20 > one 16-row tile; 0: empty


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("kind", ["sgmv", "bgmv"])
def test_shrink_expand_match_the_oracle(seed: int, device: torch.device, kind: str, dtype: torch.dtype,
                                        backend: str) -> None:
    gen = torch.Generator().manual_seed(seed)
    a, b, scaling = _weights(gen, dtype, device)
    slots = [s for s, n in SEGMENTS for _ in range(n)]
    if kind == "bgmv":
        slots = [slots[i] for i in torch.randperm(len(slots), generator=gen).tolist()]  # decode rows: any order
    x = torch.randn(len(slots), K, generator=gen).to(device, dtype)
    wide = torch.randn(len(slots), N + 10, generator=gen).to(device, dtype)  # the expand writes columns 4 .. 4+N
    y0 = wide.clone()
    y = wide[:, 4:4 + N]
    if kind == "sgmv":
        starts = torch.tensor([0] + torch.tensor([n for _, n in SEGMENTS]).cumsum(0).tolist(), dtype=torch.int32)
        seg = (starts.to(device), torch.tensor([s for s, _ in SEGMENTS], dtype=torch.int32, device=device),
               max(n for _, n in SEGMENTS))
        t = kernels.sgmv_shrink(x, a, *seg, backend=backend)
        kernels.sgmv_expand(y, t, b, *seg, scaling, backend=backend)
    else:
        row_slots = torch.tensor(slots, dtype=torch.int32, device=device)
        t = kernels.bgmv_shrink(x, a, row_slots, backend=backend)
        kernels.bgmv_expand(y, t, b, row_slots, scaling, backend=backend)
    t64, y64, bound = _oracle(x, a, b, scaling, y0[:, 4:4 + N], slots)
    assert t.dtype == torch.float32 and t.shape == (len(slots), RANK)
    t_bound = REL * (a.cpu().double().abs()[[max(s, 0) for s in slots]] @ x.cpu().double().abs()[:, :, None])[..., 0]
    _assert_close(t, t64, t_bound, f"{kind}_shrink {backend} {dtype}", seed)
    bound += torch.finfo(dtype).eps * y64.abs()  # y is stored in `dtype`: one rounding of the sum
    _assert_close(y, y64, bound, f"{kind}_expand {backend} {dtype} slots={slots}", seed)
    untouched = torch.cat([wide[:, :4], wide[:, 4 + N:]], 1), torch.cat([y0[:, :4], y0[:, 4 + N:]], 1)
    assert torch.equal(*untouched), "the expand wrote outside its column slice"
    assert torch.equal(wide[torch.tensor(slots) < 0], y0[torch.tensor(slots) < 0]), "rows without an adapter changed"


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_empty_batches_are_fine(device: torch.device, backend: str) -> None:
    a = torch.zeros(2, 8, 16, device=device)
    x = torch.zeros(0, 16, device=device)
    none = torch.zeros(0, dtype=torch.int32, device=device)
    assert kernels.bgmv_shrink(x, a, none, backend=backend).shape == (0, 8)
    assert kernels.sgmv_shrink(x, a, torch.zeros(1, dtype=torch.int32, device=device), none, 0,
                               backend=backend).shape == (0, 8)
