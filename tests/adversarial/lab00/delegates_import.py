# Delegation: calls the engine's own `cdiv`. 0 ("uses the reference implementation").
from engine_core.core.kv_cache_manager import cdiv


def num_blocks_needed(num_tokens: int, block_size: int) -> int:
    return cdiv(num_tokens, block_size)
