"""What one scheduler step hands the model runner: a flat list of chunks plus KV copies."""
from __future__ import annotations

from dataclasses import dataclass, field

from engine_core.request import Request


@dataclass
class ScheduledChunk:
    """`num_tokens` tokens of one request, from position `start`, computed this step."""

    request: Request
    start: int  # the request's num_computed_tokens when scheduled
    num_tokens: int
    block_ids: list[int]  # the request's whole block table after allocation

    @property
    def token_ids(self) -> list[int]:
        return self.request.all_token_ids[self.start:self.start + self.num_tokens]

    @property
    def emits(self) -> bool:
        """True when this chunk reaches the request's last token, so its logits give a new token."""
        return self.start + self.num_tokens == self.request.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledChunk] = field(default_factory=list)
    # KV block copies the runner performs before the forward pass, swap_out first:
    swap_out: list[tuple[int, int]] = field(default_factory=list)  # (gpu_block_id, cpu_block_id)
    swap_in: list[tuple[int, int]] = field(default_factory=list)  # (cpu_block_id, gpu_block_id)
    preempted_request_ids: list[str] = field(default_factory=list)

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(c.num_tokens for c in self.scheduled)

    @property
    def num_scheduled_tokens(self) -> dict[str, int]:
        return {c.request.request_id: c.num_tokens for c in self.scheduled}

    @property
    def is_empty(self) -> bool:
        return not self.scheduled and not self.swap_out and not self.swap_in
