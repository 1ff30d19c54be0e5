"""Per-request state the model runner keeps between steps: each running request's block table.

A row of one `[max_num_reqs, max_blocks_per_req]` int32 array per request, written only where
the scheduler hands over new block ids (vLLM v1's `InputBatch` idea): a decode step, which
adds a block once every `block_size` tokens, copies nothing, and the step's block tables are
one gather of rows instead of a tensor rebuilt from Python lists.
"""
from __future__ import annotations

import numpy as np
import torch

from engine_core.core.scheduler_output import ScheduledChunk


class InputBatch:
    def __init__(self, max_num_reqs: int, max_blocks_per_req: int) -> None:
        self.block_table = np.zeros((max_num_reqs, max_blocks_per_req), dtype=np.int32)
        self.num_blocks = np.zeros(max_num_reqs, dtype=np.int64)
        self.row_of: dict[str, int] = {}
        self.free_rows = list(range(max_num_reqs - 1, -1, -1))  # pop() hands out row 0 first

    def add_chunk(self, chunk: ScheduledChunk) -> int:
        """Apply the chunk's new block ids to its request's row; returns the row."""
        rid = chunk.request.request_id
        row = self.row_of.get(rid)
        if row is None:
            if not chunk.resumed:
                raise RuntimeError(f"request {rid!r}: the runner has no block table for it, yet the scheduler sent "
                                   f"only new block ids {chunk.new_block_ids}")
            if not self.free_rows:
                raise RuntimeError(f"request {rid!r}: all {len(self.num_blocks)} rows hold running requests")
            row = self.free_rows.pop()
            self.row_of[rid] = row
        start = 0 if chunk.resumed else int(self.num_blocks[row])
        ids = chunk.new_block_ids
        if ids:
            self.block_table[row, start:start + len(ids)] = ids
        self.num_blocks[row] = start + len(ids)
        return row

    def remove(self, request_id: str) -> None:
        """Forget a finished, aborted or preempted request (unknown ids are ignored)."""
        row = self.row_of.pop(request_id, None)
        if row is not None:
            self.num_blocks[row] = 0
            self.free_rows.append(row)

    # seam: lab 14 (grader/seams.py)
    def block_tables(self, rows: list[int]) -> torch.Tensor:
        """`[len(rows), widest table]` int32; entries past a row's table are stale and never read."""
        width = int(self.num_blocks[rows].max()) if rows else 0
        return torch.from_numpy(self.block_table[rows, :width])
