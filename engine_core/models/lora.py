"""The model's side of multi-LoRA: slot weights per fused projection, the step's row -> slot
mapping, and the delta every projection adds (`add_lora`, called by `models.linear.Linear`).

Unmerged and batched (Punica / S-LoRA): the base GEMM runs once for the whole batch, then each
row adds its own adapter's low-rank delta, `scaling[slot] * (x @ A[slot].T) @ B[slot].T`,
computed as a shrink (x @ A.T: `[tokens, rank]`, in fp32) and an expand (@ B.T, scaled, added
in place). Decode rows (one per sequence, the batch's first rows) go through the batched gather
ops (BGMV), prefill chunks through the segmented ones (SGMV): a chunk's rows share one adapter.
A projection that fuses several HF modules (q|k|v, gate|up) stacks their A on the rank axis,
so one shrink serves them all, and keeps one B per slice, each expanding into its columns.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

import kernels
from engine_core.models.config import LlamaArgs

# The model's fused projections and the HF modules (an adapter's targets) each one holds, in order.
FUSED_MODULES: dict[str, tuple[str, ...]] = {"qkv": ("q_proj", "k_proj", "v_proj"), "o": ("o_proj",),
                                            "gate_up": ("gate_proj", "up_proj"), "down": ("down_proj",)}


def module_shapes(args: LlamaArgs) -> dict[str, tuple[int, int]]:
    """(in_features, out_features) of each HF module an adapter may target."""
    h, q, kv = args.hidden_size, args.num_heads * args.head_dim, args.num_kv_heads * args.head_dim
    i = args.intermediate_size
    return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
            "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}


@dataclass
class LoRAStack:
    """`num_slots` adapters' weights for one fused projection of one layer, padded to `max_rank`
    with zeros (a module an adapter does not target stays zero: its delta is 0)."""

    a: torch.Tensor  # [num_slots, num_slices * max_rank, in_features]
    b: list[torch.Tensor]  # one per slice: [num_slots, out_features of the slice, max_rank]
    scaling: torch.Tensor  # [num_slots] float32: alpha / r of the adapter in each slot (shared by every stack)

    @classmethod
    def empty(cls, num_slots: int, max_rank: int, in_features: int, slice_outs: list[int], scaling: torch.Tensor,
              dtype: torch.dtype, device: torch.device) -> "LoRAStack":
        a = torch.zeros(num_slots, len(slice_outs) * max_rank, in_features, dtype=dtype, device=device)
        b = [torch.zeros(num_slots, n, max_rank, dtype=dtype, device=device) for n in slice_outs]
        return cls(a, b, scaling)

    @property
    def max_rank(self) -> int:
        return self.b[0].shape[2]

    def write(self, slot: int, pairs: list[tuple[torch.Tensor, torch.Tensor] | None]) -> None:
        """Load one adapter into `slot`: `pairs[i]` is slice i's (A [r, in], B [out, r]), None if not targeted."""
        r_max = self.max_rank
        self.a[slot].zero_()
        for i, (pair, b) in enumerate(zip(pairs, self.b)):
            b[slot].zero_()
            if pair is not None:
                lora_a, lora_b = pair
                r = lora_a.shape[0]
                self.a[slot, i * r_max:i * r_max + r].copy_(lora_a, non_blocking=True)
                b[slot, :, :r].copy_(lora_b, non_blocking=True)


def attach_lora_stacks(model: nn.Module, args: LlamaArgs, num_slots: int, max_rank: int,
                       scaling: torch.Tensor) -> list[dict[str, LoRAStack]]:
    """Allocate zeroed slot weights for every fused projection and hang them on the layers
    (`attn.qkv_proj.lora`, `attn.o_proj.lora`, `mlp.gate_up_proj.lora`, `mlp.down_proj.lora`); returns them
    per layer."""
    shapes = module_shapes(args)
    weight = model.embed
    stacks = []
    for layer in model.layers:
        per_layer = {name: LoRAStack.empty(num_slots, max_rank, shapes[mods[0]][0], [shapes[m][1] for m in mods],
                                           scaling, weight.dtype, weight.device)
                     for name, mods in FUSED_MODULES.items()}
        layer.attn.qkv_proj.lora, layer.attn.o_proj.lora = per_layer["qkv"], per_layer["o"]
        layer.mlp.gate_up_proj.lora, layer.mlp.down_proj.lora = per_layer["gate_up"], per_layer["down"]
        stacks.append(per_layer)
    return stacks


@dataclass
class LoRAMapping:
    """Which slot each row of a flat batch uses (-1: the base model alone). The first
    `len(row_slots)` rows are mapped row by row (BGMV); the rest in segments of consecutive rows
    that share a slot (SGMV), segment j = rows num_row_mapped + seg_starts[j] .. + seg_starts[j+1]."""

    row_slots: torch.Tensor  # [num_row_mapped] int32
    seg_starts: torch.Tensor  # [num_segments + 1] int32, 0 first
    seg_slots: torch.Tensor  # [num_segments] int32
    max_seg_len: int
    backend: str = "auto"


@dataclass
class LoRABatch:
    """One step's mappings: every row (layers before the last, and the last layer's q|k|v), and
    the emitting rows only (the last layer's o, gate|up and down when it computes only those)."""

    all_rows: LoRAMapping
    output_rows: LoRAMapping | None  # None when every row emits

    def rows(self, only_output_rows: bool) -> LoRAMapping:
        return self.output_rows if only_output_rows and self.output_rows is not None else self.all_rows

    @classmethod
    def build(cls, slots: list[int], num_tokens: list[int], emits: list[bool], num_decode: int,
              every_row_emits: bool, device: torch.device, backend: str) -> "LoRABatch":
        """From each sequence's slot (-1: none) and row count, in batch order (the `num_decode`
        one-row sequences first). Consecutive sequences with one slot share a segment."""
        def ints(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int32).to(device)

        starts, seg_slots = [0], []
        for s, n in zip(slots[num_decode:], num_tokens[num_decode:]):
            if seg_slots and seg_slots[-1] == s:
                starts[-1] += n
            else:
                seg_slots.append(s)
                starts.append(starts[-1] + n)
        longest = max((b - a for a, b in zip(starts, starts[1:])), default=0)
        all_rows = LoRAMapping(ints(slots[:num_decode]), ints(starts), ints(seg_slots), longest, backend)
        output_rows = None if every_row_emits else LoRAMapping(
            ints([s for s, e in zip(slots, emits) if e]), ints([0]), ints([]), 0, backend)
        return cls(all_rows, output_rows)


# seam: lab 09 (grader/seams.py)
def add_lora(y: torch.Tensor, x: torch.Tensor, stack: LoRAStack, m: LoRAMapping) -> None:
    """y[i] += scaling[s] * x[i] @ A_s.T @ B_s.T for every row i whose slot s >= 0, in place; slice j
    of a fused output uses A's rank rows j*max_rank.. and B[j]. Rows mapped one by one go through
    the BGMV ops, segments through the SGMV ops."""
    n = len(m.row_slots)
    if n:
        t = kernels.bgmv_shrink(x[:n], stack.a, m.row_slots, backend=m.backend)
        for cols, t_j, b in _slices(stack, t):
            kernels.bgmv_expand(y[:n, cols], t_j, b, m.row_slots, stack.scaling, backend=m.backend)
    if len(m.seg_slots):
        t = kernels.sgmv_shrink(x[n:], stack.a, m.seg_starts, m.seg_slots, m.max_seg_len, backend=m.backend)
        for cols, t_j, b in _slices(stack, t):
            kernels.sgmv_expand(y[n:, cols], t_j, b, m.seg_starts, m.seg_slots, m.max_seg_len, stack.scaling,
                                backend=m.backend)


def _slices(stack: LoRAStack, t: torch.Tensor) -> list[tuple[slice, torch.Tensor, torch.Tensor]]:
    """(output columns, shrink columns, B) of each slice of a fused projection."""
    r, col, out = stack.max_rank, 0, []
    for j, b in enumerate(stack.b):
        out.append((slice(col, col + b.shape[1]), t[:, j * r:(j + 1) * r], b))
        col += b.shape[1]
    return out
