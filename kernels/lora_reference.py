"""The semantics of the multi-LoRA ops (Punica's SGMV / BGMV), in plain PyTorch: the CPU path,
and what `kernels/triton/lora.py` is tested against.

Slot weights of one projection: A `[num_slots, R, K]`, B `[num_slots, N, R]`, scaling `[num_slots]`.
A row uses slot s >= 0, or -1 for "no adapter" (shrink gives 0, expand leaves y alone).
* shrink: t[i] = x[i] @ A[s].T, returned in float32 `[T, R]`;
* expand: y[i] += scaling[s] * t[i] @ B[s].T, in place (y may be a column slice of a wider output).
BGMV maps rows one by one (`row_slots [T]`: decode rows, any order); SGMV maps segments of
consecutive rows (`seg_starts [S+1]`, `seg_slots [S]`: prefill chunks). Both compute in fp32,
one matmul per distinct adapter (BGMV) or per segment (SGMV).
"""
from __future__ import annotations

import torch


def _rows_by_slot(row_slots: torch.Tensor) -> list[tuple[int, torch.Tensor]]:
    return [(s, (row_slots == s).nonzero().flatten()) for s in row_slots.unique().tolist() if s >= 0]


def _segments(seg_starts: torch.Tensor, seg_slots: torch.Tensor) -> list[tuple[int, int, int]]:
    starts = seg_starts.tolist()
    return [(s, starts[j], starts[j + 1]) for j, s in enumerate(seg_slots.tolist())
            if s >= 0 and starts[j + 1] > starts[j]]


def bgmv_shrink(x: torch.Tensor, lora_a: torch.Tensor, row_slots: torch.Tensor) -> torch.Tensor:
    out = torch.zeros(x.shape[0], lora_a.shape[1], dtype=torch.float32, device=x.device)
    for s, rows in _rows_by_slot(row_slots):
        out[rows] = x[rows].float() @ lora_a[s].float().T
    return out


def bgmv_expand(y: torch.Tensor, t: torch.Tensor, lora_b: torch.Tensor, row_slots: torch.Tensor,
                scaling: torch.Tensor) -> None:
    for s, rows in _rows_by_slot(row_slots):
        y[rows] += (t[rows] @ lora_b[s].float().T * scaling[s]).to(y.dtype)


def sgmv_shrink(x: torch.Tensor, lora_a: torch.Tensor, seg_starts: torch.Tensor, seg_slots: torch.Tensor,
                max_seg_len: int) -> torch.Tensor:
    """`max_seg_len` (the longest segment) only sizes a kernel's grid; unused here."""
    out = torch.zeros(x.shape[0], lora_a.shape[1], dtype=torch.float32, device=x.device)
    for s, a, b in _segments(seg_starts, seg_slots):
        out[a:b] = x[a:b].float() @ lora_a[s].float().T
    return out


def sgmv_expand(y: torch.Tensor, t: torch.Tensor, lora_b: torch.Tensor, seg_starts: torch.Tensor,
                seg_slots: torch.Tensor, max_seg_len: int, scaling: torch.Tensor) -> None:
    for s, a, b in _segments(seg_starts, seg_slots):
        y[a:b] += (t[a:b] @ lora_b[s].float().T * scaling[s]).to(y.dtype)
