"""Official tests of lab 00_warmup: `num_blocks_needed`, ceil division of tokens into KV blocks.

Called from the notebook's test cells through `grader.check("00_warmup", globals(), tests=[...])`:
the first two are visible, the other two sit in a hidden-test block of the solution notebook.
"""
import pytest

pytestmark = pytest.mark.task("num_blocks_needed")


def expected_blocks(num_tokens: int, block_size: int) -> int:
    """The specification, written independently of the solution: blocks = ceil(tokens / size)."""
    blocks = 0
    while blocks * block_size < num_tokens:
        blocks += 1
    return blocks


def assert_blocks(student, num_tokens: int, block_size: int, want: int) -> None:
    got = student.num_blocks_needed(num_tokens, block_size)
    assert got == want, f"num_blocks_needed({num_tokens}, {block_size}) returned {got!r}, expected {want}"


@pytest.mark.points(1)
def test_whole_blocks(student):
    """Tokens that fill their blocks exactly need no extra block."""
    for num_tokens, block_size in [(16, 16), (32, 16), (48, 16), (256, 128)]:
        assert_blocks(student, num_tokens, block_size, num_tokens // block_size)


@pytest.mark.points(1)
def test_partial_block(student):
    """One token past a block boundary opens a new block."""
    for num_tokens, block_size, want in [(1, 16, 1), (17, 16, 2), (33, 16, 3), (129, 128, 2)]:
        assert_blocks(student, num_tokens, block_size, want)


@pytest.mark.points(1)
def test_edge_cases(student):
    """No tokens need no block; block size 1 is one block per token; big counts stay exact."""
    assert_blocks(student, 0, 16, 0)
    assert_blocks(student, 5, 1, 5)
    # float division rounds 10**18 + 1 to 10**18 and loses the extra block
    assert_blocks(student, 10**18 + 1, 16, 10**18 // 16 + 1)


@pytest.mark.points(1)
def test_matches_specification(student):
    """Every (tokens, block size) pair in a small grid agrees with the definition."""
    for block_size in (1, 2, 3, 8, 16):
        for num_tokens in range(0, 50):
            assert_blocks(student, num_tokens, block_size, expected_blocks(num_tokens, block_size))
