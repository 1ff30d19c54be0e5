"""Official tests of lab 00_warmup: `num_blocks_needed`, ceil division of tokens into KV blocks.

The learner's function is the engine's `cdiv` seam (grader/seams.py): the scheduler sizes every
block table with it. Called from the notebook's test cells through
`grader.check("00_warmup", globals(), tests=[...])`. Every check is an `expect_*` observation
with its expected value written in the call (the pattern of docs/authoring_labs.md).
"""
import pytest

from grader.harness import FakeRunner, make_request, make_scheduler, reference_output, run_to_completion, step
from grader.observe import expect_equal
from grader.plug import plug

LAB = "00_warmup"
pytestmark = pytest.mark.task("num_blocks_needed")


def expected_blocks(num_tokens: int, block_size: int) -> int:
    """The specification, written independently of the solution: blocks = ceil(tokens / size)."""
    blocks = 0
    while blocks * block_size < num_tokens:
        blocks += 1
    return blocks


@pytest.mark.points(1)
def test_whole_blocks(student):
    """Tokens that fill their blocks exactly need no extra block."""
    with plug(student, LAB):
        for num_tokens, block_size in [(16, 16), (32, 16), (48, 16), (256, 128)]:
            expect_equal(student.num_blocks_needed(num_tokens, block_size), num_tokens // block_size,
                         f"num_blocks_needed({num_tokens}, {block_size})")


@pytest.mark.points(1)
def test_partial_block(student):
    """One token past a block boundary opens a new block."""
    with plug(student, LAB):
        for num_tokens, block_size, want in [(1, 16, 1), (17, 16, 2), (33, 16, 3), (129, 128, 2)]:
            expect_equal(student.num_blocks_needed(num_tokens, block_size), want,
                         f"num_blocks_needed({num_tokens}, {block_size})")


@pytest.mark.points(1)
def test_edge_cases(student):
    """No tokens need no block; block size 1 is one block per token; big counts stay exact."""
    with plug(student, LAB):
        expect_equal(student.num_blocks_needed(0, 16), 0, "num_blocks_needed(0, 16): no tokens, no block")
        expect_equal(student.num_blocks_needed(5, 1), 5, "num_blocks_needed(5, 1): one block per token")
        expect_equal(student.num_blocks_needed(10**18 + 1, 16), 10**18 // 16 + 1,
                     "num_blocks_needed(10**18 + 1, 16): float division rounds 10**18 + 1 to 10**18 and loses a block")


@pytest.mark.points(1)
def test_matches_specification(student):
    """Every (tokens, block size) pair in a small grid agrees with the definition."""
    with plug(student, LAB):
        for block_size in (1, 2, 3, 8, 16):
            for num_tokens in range(0, 50):
                expect_equal(student.num_blocks_needed(num_tokens, block_size), expected_blocks(num_tokens, block_size),
                             f"num_blocks_needed({num_tokens}, {block_size})")


WORKLOAD = [("a", 9, 6), ("b", 4, 5), ("c", 13, 3)]  # (request, prompt length, max_tokens), blocks of 4


@pytest.mark.points(1)
@pytest.mark.task("engine")
@pytest.mark.end_to_end
def test_the_scheduler_sizes_block_tables_with_it(student):
    """Your function is the engine's `cdiv`: the scheduler sizes every block table with it. Three requests
    run on 16 blocks of 4 slots; their tables must hold exactly ceil(tokens / 4) blocks."""
    with plug(student, LAB) as plugged:
        sched = make_scheduler(16)
        runner = FakeRunner.for_scheduler(sched)
        for rid, n, max_tokens in WORKLOAD:
            sched.add_request(make_request(rid, [(3 * k + len(rid)) % 40 + 1 for k in range(n)], max_tokens))
        step(sched, runner)
        # after step 1 all three prompts are computed (budget 16 covers 9 + 4 + 3 of c's 13: c is chunked)
        tables = {rid: len(sched.kv_cache_manager.get_block_ids(rid)) for rid, _, _ in WORKLOAD}
        outputs = run_to_completion(sched, runner, max_steps=100)
    expect_equal(tables, {"a": 3, "b": 1, "c": 1},
                 "block tables after step 1 (budget 16: a's 9 prompt tokens, b's 4, c's first 3 of 13; blocks of 4)")
    expect_equal(outputs, {rid: reference_output([(3 * k + len(rid)) % 40 + 1 for k in range(n)], m)
                           for rid, n, m in WORKLOAD}, "the fake model's greedy tokens of a, b and c")
    expect_equal(plugged.uncalled(), [], "your functions the scheduler never called")
