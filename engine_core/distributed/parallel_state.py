"""The process groups a worker of a parallel engine belongs to, and the collectives the model calls.

vLLM's `vllm/distributed/parallel_state.py`, passed explicitly instead of kept in module globals: a
worker builds one `ParallelContext` (its TP group and its PP group) and hands it to the model, which
calls `ctx.tp.all_reduce` / `ctx.tp.gather` / `ctx.pp.send` / `ctx.pp.recv`. Rank layout is vLLM's:
TP is innermost, so global rank = pp_rank * tp_size + tp_rank, and the TP group of a stage is tp_size
consecutive ranks. A leaf below the model: it imports only torch.

Every collective is counted (`CommStats`: calls, bytes this rank sent into it, seconds spent), which is
what `LLMEngine.stats()` reports as communication.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist


@dataclass
class CommStats:
    """What one rank spent in collectives so far."""

    num_all_reduces: int = 0
    num_gathers: int = 0
    num_sends: int = 0
    num_recvs: int = 0
    bytes: int = 0  # payload this rank put into collectives and sends
    seconds: float = 0.0  # wall time inside them (waiting for the slowest rank included)

    def as_dict(self) -> dict[str, float]:
        return dict(self.__dict__)


# LLMEngine.stats() of a parallel engine: these, summed over the ranks, prefixed "comm_"
COMM_STAT_DOCS = {
    "num_all_reduces": "all-reduce calls (TP: 2 per layer per step, plus the embedding's)",
    "num_gathers": "gathers of the LM head's logits on TP rank 0 (1 per step that samples)",
    "num_sends": "hidden states sent to the next pipeline stage",
    "num_recvs": "hidden states received from the previous pipeline stage",
    "bytes": "bytes the ranks put into collectives and sends",
    "seconds": "wall time the ranks spent in collectives, sends and receives (waits included)",
}


@dataclass
class GroupCoordinator:
    """One process group seen from one member: `rank_in_group` of `world_size`, the global `ranks`."""

    ranks: list[int]
    rank_in_group: int
    group: object | None = None  # a torch.distributed ProcessGroup; None for a group of one
    stats: CommStats = field(default_factory=CommStats)

    @property
    def world_size(self) -> int:
        return len(self.ranks)

    @property
    def is_first_rank(self) -> bool:
        return self.rank_in_group == 0

    @property
    def is_last_rank(self) -> bool:
        return self.rank_in_group == self.world_size - 1

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over the group, in place (identity for a group of one)."""
        if self.world_size == 1:
            return x
        t0 = time.perf_counter()
        dist.all_reduce(x, group=self.group)
        self._count("num_all_reduces", x, t0)
        return x

    def gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor | None:
        """The members' `x` concatenated along `dim` on the group's first rank; None on the others."""
        if self.world_size == 1:
            return x
        t0 = time.perf_counter()
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in self.ranks] if self.is_first_rank else None
        dist.gather(x, parts, dst=self.ranks[0], group=self.group)
        self._count("num_gathers", x, t0)
        return torch.cat(parts, dim=dim) if parts is not None else None

    def send_next(self, x: torch.Tensor) -> None:
        """To the next member (the next pipeline stage)."""
        t0 = time.perf_counter()
        dist.send(x.contiguous(), dst=self.ranks[self.rank_in_group + 1], group=self.group)
        self._count("num_sends", x, t0)

    def recv_prev(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """From the previous member; the receiver knows the shape (both derive it from the same message)."""
        t0 = time.perf_counter()
        x = torch.empty(shape, dtype=dtype, device=device)
        dist.recv(x, src=self.ranks[self.rank_in_group - 1], group=self.group)
        self.stats.num_recvs += 1
        self.stats.seconds += time.perf_counter() - t0
        return x

    def _count(self, name: str, x: torch.Tensor, t0: float) -> None:
        setattr(self.stats, name, getattr(self.stats, name) + 1)
        self.stats.bytes += x.numel() * x.element_size()
        self.stats.seconds += time.perf_counter() - t0


@dataclass
class ParallelContext:
    """A worker's place in the engine: its TP group (the ranks of its stage) and PP group (its
    counterparts of the other stages), and the decoder layers its stage holds."""

    tp: GroupCoordinator
    pp: GroupCoordinator
    start_layer: int
    end_layer: int

    @property
    def rank(self) -> int:
        return self.pp.rank_in_group * self.tp.world_size + self.tp.rank_in_group

    @property
    def world_size(self) -> int:
        return self.tp.world_size * self.pp.world_size

    @property
    def is_output_rank(self) -> bool:
        """The last stage's TP rank 0: it samples, and its ModelRunnerOutput is the step's."""
        return self.pp.is_last_rank and self.tp.is_first_rank

    def comm_stats(self) -> CommStats:
        total = CommStats()
        for s in (self.tp.stats, self.pp.stats):
            for k, v in s.__dict__.items():
                setattr(total, k, getattr(total, k) + v)
        return total


def output_rank(tp_size: int, pp_size: int) -> int:
    """The global rank of the last stage's TP rank 0."""
    return (pp_size - 1) * tp_size


# seam: lab 11 (grader/seams.py)
def get_pp_indices(num_layers: int, pp_rank: int, pp_size: int) -> tuple[int, int]:
    """[start, end) of the layers stage `pp_rank` holds: vLLM's rule. Each stage gets num_layers // pp_size;
    the remainder goes one each to the stages before the last, from the second-to-last backwards (the
    last stage also holds the final norm and the LM head)."""
    partitions = [num_layers // pp_size] * pp_size
    for i in range(2, num_layers % pp_size + 2):
        partitions[-i] += 1
    start = sum(partitions[:pp_rank])
    return start, start + partitions[pp_rank]


def init_groups(rank: int, tp_size: int, pp_size: int, num_layers: int) -> ParallelContext:
    """After `dist.init_process_group`: every rank creates every group, in the same order
    (torch.distributed requires it), and keeps its own two."""
    tp = pp = None
    for stage in range(pp_size):
        ranks = list(range(stage * tp_size, (stage + 1) * tp_size))
        group = dist.new_group(ranks) if tp_size > 1 else None
        if rank in ranks:
            tp = GroupCoordinator(ranks, ranks.index(rank), group)
    for tp_rank in range(tp_size):
        ranks = list(range(tp_rank, tp_size * pp_size, tp_size))
        group = dist.new_group(ranks) if pp_size > 1 else None
        if rank in ranks:
            pp = GroupCoordinator(ranks, ranks.index(rank), group)
    assert tp is not None and pp is not None
    return ParallelContext(tp, pp, *get_pp_indices(num_layers, pp.rank_in_group, pp_size))
