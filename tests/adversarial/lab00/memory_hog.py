# Allocates 16 GiB per call: MemoryError in each test under the address-space limit: 0.
def num_blocks_needed(num_tokens: int, block_size: int) -> int:
    return len(bytearray(2**34))
