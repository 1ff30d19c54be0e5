# Honest, wrong for 0 tokens only. Deserves 3 / 5 (test_edge_cases and test_matches_specification fail).
def num_blocks_needed(num_tokens: int, block_size: int) -> int:
    return max(1, (num_tokens + block_size - 1) // block_size)
