"""What one scheduler step hands the model runner: everything the runner applies this step.

The one message of the step (vLLM v1's `SchedulerOutput`): the chunks to compute, the KV block
copies, and the requests the runner must forget (preempted this step; finished or aborted since the
last step). The runner learns about requests from it alone, so the same object can go to every
worker of a parallel engine. The runner keeps each running request's block table between steps (as
vLLM v1's input batch does), so a chunk carries only the block ids appended since the runner last
saw the request; `resumed` says they are the whole table instead (a new, recomputed or swapped-in
request).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from engine_core.request import Request


@dataclass
class ScheduledChunk:
    """`num_tokens` tokens of one request, from position `start`, computed this step."""

    request: Request
    start: int  # the request's num_computed_tokens when scheduled
    num_tokens: int
    new_block_ids: list[int]  # blocks appended to the request's table since the runner last saw it
    resumed: bool = False  # True: new_block_ids is the whole table (the runner starts the request afresh)
    # tokens of the request's context whose blocks were evicted (kv_eviction): the runner's row holds the kept
    # blocks only, so a token's cache position is its position less this; its RoPE position stays its position
    num_evicted_tokens: int = 0

    @property
    def token_ids(self) -> list[int]:
        """request.all_token_ids[start:start+num_tokens], without concatenating prompt and output."""
        prompt, output = self.request.prompt_token_ids, self.request.output_token_ids
        p, start, end = len(prompt), self.start, self.start + self.num_tokens
        if start >= p:
            return output[start - p:end - p]
        if end <= p:
            return prompt[start:end]
        return prompt[start:] + output[:end - p]

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
    preempted_request_ids: list[str] = field(default_factory=list)  # the runner forgets their tables
    # finished or aborted since the previous step's SchedulerOutput: the runner forgets their tables
    # and adapter pins (`Scheduler.schedule` fills it)
    finished_req_ids: set[str] = field(default_factory=set)
    # speculative decoding: request id -> the draft tokens that follow its chunk (a one-token decode). The
    # runner computes 1 + len(drafts) rows for it, their KV in the lookahead slots its table already covers
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)

    @property
    def total_num_scheduled_tokens(self) -> int:
        """Query rows of the step: chunk tokens and draft tokens."""
        return sum(c.num_tokens for c in self.scheduled) + sum(map(len, self.scheduled_spec_decode_tokens.values()))


class BlockTables:
    """The runner's side of the block-id handover as plain lists: request id -> its whole table.
    (The model runner keeps the same state as array rows, `worker.input_batch.InputBatch`; fake
    runners in tests and labs use this.)"""

    def __init__(self) -> None:
        self.tables: dict[str, list[int]] = {}

    def apply(self, out: SchedulerOutput) -> None:
        """Forget the requests the step names (finished, aborted, preempted) before its chunks run."""
        for rid in [*out.finished_req_ids, *out.preempted_request_ids]:
            self.tables.pop(rid, None)

    def update(self, chunk: ScheduledChunk) -> list[int]:
        """Apply the chunk's new block ids; returns its request's whole table."""
        rid = chunk.request.request_id
        if chunk.resumed:
            self.tables[rid] = list(chunk.new_block_ids)
        elif rid in self.tables:
            self.tables[rid].extend(chunk.new_block_ids)
        else:
            raise RuntimeError(f"request {rid!r}: no table yet, but the chunk carries only new block ids")
        return self.tables[rid]
