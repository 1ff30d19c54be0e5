"""Planted bugs for lab 05_prefix_caching: slips a learner plausibly makes; each must fail a test."""
from grader.bugs import PlantedBug

BUGS = [
    PlantedBug("hash_not_chained", "pickle.dumps((parent_hash, tokens, extra_keys)", "pickle.dumps((tokens, extra_keys)"),
    PlantedBug("lora_id_not_hashed", "pickle.dumps((parent_hash, tokens, extra_keys)", "pickle.dumps((parent_hash, tokens)"),
    # structured blocks: XOR chaining cancels on a repeated block; sorted tokens ignore their order
    PlantedBug("hash_xor_chain", 'return BlockHash(int.from_bytes(digest[:16], "little"), tokens, extra_keys)',
               'return BlockHash((parent_hash or 0) ^ int.from_bytes(hashlib.sha256(pickle.dumps((tokens, extra_keys))).digest()[:16], "little"), tokens, extra_keys)'),
    PlantedBug("hash_ignores_order", "pickle.dumps((parent_hash, tokens, extra_keys)", "pickle.dumps((parent_hash, tuple(sorted(tokens)), extra_keys)"),
    PlantedBug("hits_capped_by_the_prompt", "max_blocks = (request.num_tokens - 1) // self.block_size",
               "max_blocks = (request.num_prompt_tokens - 1) // self.block_size"),
    PlantedBug("tokens_not_kept", 'return BlockHash(int.from_bytes(digest[:16], "little"), tokens, extra_keys)',
               'return BlockHash(int.from_bytes(digest[:16], "little"), (), extra_keys)'),
    PlantedBug("full_hit_allowed", "max_blocks = (request.num_tokens - 1) // self.block_size",
               "max_blocks = request.num_tokens // self.block_size"),
    PlantedBug("lookup_skips_misses", "        if block is None:\n            break\n        hits.append(block)",
               "        if block is None:\n            continue\n        hits.append(block)"),
    PlantedBug("evicts_most_recently_used", "self.free_queue.popitem(last=False)", "self.free_queue.popitem(last=True)"),
    PlantedBug("eviction_keeps_hash", "                del self.cached_blocks[block.block_hash]\n            block.block_hash = None",
               "                pass"),
    # find the bug: both cached blocks in a row, no gap: the buggy filter happens to be right
    PlantedBug("failing_input_without_a_gap", "return (13, {0, 2})", "return (13, {0, 1})"),
    # prediction: the partial last block of the prefix counted as cached
    PlantedBug("prediction_caches_the_partial_block", "shared = 248 // 16 * 16", "shared = 248"),
    PlantedBug("touch_leaves_block_free", "            del self.free_queue[block.block_id]\n", "            pass\n"),
]
