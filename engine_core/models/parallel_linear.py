"""Megatron tensor parallelism for the decoder: which slice of each checkpoint matrix a TP rank holds,
and the layers that communicate (nano-vllm's `layers/linear.py` and `embed_head.py`, vLLM's names).

- Column-parallel (q/k/v, gate/up): a rank holds a block of output rows; no communication. q is split
  by heads; k/v by KV heads, and when tp > num_kv_heads each KV head is replicated on tp / num_kv_heads
  ranks (vLLM's rule), so every rank's query heads find their KV head locally.
- Row-parallel (o_proj, down_proj): a rank holds the matching block of input columns and produces a
  partial sum of the whole output; one all-reduce adds them. Bias and the residual ride on rank 0's
  partial (added once, before the sum).
- Vocab-parallel embedding: a rank holds ceil(vocab / tp) rows (zero-padded); a token outside its
  range looks up zeros, and the all-reduce leaves every token its one row (exact: x + 0 = x).
- Parallel LM head: each rank's logits over its vocab rows, gathered on TP rank 0 (the one that samples).

Two all-reduces per layer (after attention, after the MLP) plus one for the embedding: the
`2 * num_layers + 1` of lab 01's all-reduce model.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from engine_core.distributed.parallel_state import GroupCoordinator
from engine_core.models.linear import Linear
from engine_core.models.lora import LoRAMapping


@dataclass(frozen=True)
class TPShard:
    """The slices of the checkpoint one TP rank loads."""

    group: GroupCoordinator

    @property
    def rank(self) -> int:
        return self.group.rank_in_group

    @property
    def size(self) -> int:
        return self.group.world_size

    def even(self, n: int) -> slice:
        """This rank's block of `n` rows (n divisible by the TP size: checked before any process starts)."""
        per = n // self.size
        return slice(self.rank * per, (self.rank + 1) * per)

    def heads(self, num_heads: int, num_kv_heads: int) -> tuple[slice, slice]:
        """This rank's query heads and KV heads (by head index). With tp > num_kv_heads a rank holds one
        KV head, the one its query heads belong to (replicated on tp / num_kv_heads ranks)."""
        q = self.even(num_heads)
        if self.size <= num_kv_heads:
            return q, self.even(num_kv_heads)
        kv = self.rank // (self.size // num_kv_heads)
        return q, slice(kv, kv + 1)


def head_rows(heads: slice, head_dim: int) -> slice:
    """The weight rows of a range of heads."""
    return slice(heads.start * head_dim, heads.stop * head_dim)


class RowParallelLinear(Linear):
    """y = all_reduce(x_local @ W[:, cols].T) + bias + residual: rank 0 adds the bias and the residual to
    its partial sum (one fused GEMM call), the all-reduce adds the other ranks' partials."""

    def __init__(self, weight: nn.Parameter, bias: nn.Parameter | None, tp: GroupCoordinator) -> None:
        super().__init__(weight, bias if tp.is_first_rank else None)
        self.tp = tp

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None,
                lora: LoRAMapping | None = None) -> torch.Tensor:
        partial = super().forward(x, residual if self.tp.is_first_rank else None, lora)
        return self.tp.all_reduce(partial)


class VocabParallelEmbedding(nn.Module):
    """The embedding rows [start, start + len(weight)) of a vocab split into equal, zero-padded shards."""

    def __init__(self, weight: nn.Parameter, vocab_size: int, tp: GroupCoordinator) -> None:
        super().__init__()
        self.weight, self.tp, self.vocab_size = weight, tp, vocab_size
        self.start = tp.rank_in_group * weight.shape[0]
        self.end = min(self.start + weight.shape[0], vocab_size)

    @staticmethod
    def shard(full: torch.Tensor, tp: GroupCoordinator) -> torch.Tensor:
        """This rank's ceil(vocab / tp) rows of `full` `[vocab, hidden]`, zero rows past the vocabulary."""
        per = -(-full.shape[0] // tp.world_size)
        start = tp.rank_in_group * per
        rows = full[start:start + per]
        return torch.cat([rows, rows.new_zeros(per - rows.shape[0], full.shape[1])]) if rows.shape[0] < per else rows

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        mine = (input_ids >= self.start) & (input_ids < self.end)
        x = F.embedding(torch.where(mine, input_ids - self.start, 0), self.weight)
        return self.tp.all_reduce(x.masked_fill_(~mine[:, None], 0.0))


class ParallelLMHead(nn.Module):
    """Logits over the whole vocabulary on TP rank 0 (None on the others): each rank's shard of the
    LM head, gathered along the vocabulary, the zero-padded rows cut off."""

    def __init__(self, weight: nn.Parameter, vocab_size: int, tp: GroupCoordinator) -> None:
        super().__init__()
        self.proj, self.tp, self.vocab_size = Linear(weight), tp, vocab_size

    def forward(self, hidden: torch.Tensor) -> torch.Tensor | None:
        logits = self.tp.gather(self.proj(hidden), dim=-1)
        return None if logits is None else logits[:, :self.vocab_size]
