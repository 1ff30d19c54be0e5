"""The model runner's persistent block tables: rows written only where new block ids arrive."""
import pytest

from engine_core.core.scheduler_output import BlockTables, ScheduledChunk
from engine_core.request import Request, SamplingParams
from engine_core.worker.input_batch import InputBatch


def chunk(rid: str, ids: list[int], resumed: bool) -> ScheduledChunk:
    return ScheduledChunk(Request(rid, [1, 2, 3], SamplingParams()), 0, 1, ids, resumed)


def test_rows_grow_by_new_ids_and_restart_on_resume():
    batch, plain = InputBatch(max_num_reqs=2, max_blocks_per_req=4), BlockTables()
    steps = [chunk("a", [5, 6], True), chunk("b", [1], True), chunk("a", [], False), chunk("a", [7], False),
             chunk("b", [3, 0], True)]  # b swapped back in: a fresh table replaces the old one
    for c in steps:
        row = batch.add_chunk(c)
        want = plain.update(c)
        n = int(batch.num_blocks[row])
        assert batch.block_table[row, :n].tolist() == want
    rows = [batch.row_of["a"], batch.row_of["b"]]
    assert batch.block_tables(rows)[:, :2].tolist() == [[5, 6], [3, 0]] and batch.block_tables(rows).shape == (2, 3)


def test_removed_rows_are_reused_and_unknown_requests_must_resume():
    batch = InputBatch(max_num_reqs=1, max_blocks_per_req=4)
    batch.add_chunk(chunk("a", [1], True))
    with pytest.raises(RuntimeError, match="all 1 rows"):
        batch.add_chunk(chunk("b", [2], True))
    batch.remove("a")
    batch.remove("never-seen")  # ignored
    assert batch.add_chunk(chunk("b", [2], True)) == 0
    with pytest.raises(RuntimeError, match="no block table"):
        batch.add_chunk(chunk("c", [4], False))
    with pytest.raises(RuntimeError, match="no table yet"):
        BlockTables().update(chunk("c", [4], False))
