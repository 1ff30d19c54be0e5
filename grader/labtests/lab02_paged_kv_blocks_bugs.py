"""Planted bugs for lab 02_paged_kv_blocks: allocator slips a learner plausibly makes; each must fail a test."""
from grader.bugs import PlantedBug

BUGS = [
    # a stack instead of a queue: the most recently freed block (likely still a useful cached prefix) goes first
    PlantedBug("takes_from_the_tail", "self.free_queue.popitem(last=False)", "self.free_queue.popitem()"),
    PlantedBug("ref_cnt_not_set", "        block.ref_cnt = 1\n", ""),
    PlantedBug("cached_block_not_evicted", "        self._evict(block)\n", ""),
    PlantedBug("missing_ref_cnt_decrement", "        block.ref_cnt -= 1\n", ""),
    PlantedBug("frees_shared_blocks", "        if block.ref_cnt == 0:\n            self.free_queue",
               "        if True:\n            self.free_queue"),
    PlantedBug("no_double_free_check", "        if block.ref_cnt < drops[block.block_id]:\n", "        if False:\n"),
    # the check one block at a time, while freeing: a rejected call has already freed the blocks before the bad one
    PlantedBug("frees_before_validating", "        if block.ref_cnt < drops[block.block_id]:\n",
               "        if block.ref_cnt < 1:\n"),
    # freeing is not evicting: prefix-cache hits are lost after a free (the tokens stay right)
    PlantedBug("free_evicts_cached_kv", "        if block.ref_cnt == 0:\n            self.free_queue[block.block_id] = block",
               "        if block.ref_cnt == 0:\n            self._evict(block)\n            self.free_queue[block.block_id] = block"),
    PlantedBug("frees_to_the_front", "            self.free_queue[block.block_id] = block",
               "            self.free_queue[block.block_id] = block\n"
               "            self.free_queue.move_to_end(block.block_id, last=False)"),
    PlantedBug("floor_division", "cdiv(num_tokens, self.block_size)", "num_tokens // self.block_size"),
    PlantedBug("ignores_the_table", "cdiv(num_tokens, self.block_size) - len(table) - len(hits)",
               "cdiv(num_tokens, self.block_size) - len(hits)"),
    PlantedBug("counts_all_tokens_not_computed", "num_tokens = request.num_computed_tokens +",
               "num_tokens = request.num_tokens +"),
    # blocks over-allocated next to prefix hits: the hits' blocks are counted again as new ones
    PlantedBug("over_allocates_next_to_hits", "cdiv(num_tokens, self.block_size) - len(table) - len(hits), 0)",
               "cdiv(num_tokens, self.block_size) - len(table), 0)"),
    PlantedBug("free_hits_counted_as_room", "self.block_pool.num_free_blocks - num_free_hits",
               "self.block_pool.num_free_blocks"),
    PlantedBug("hits_not_touched", "    self.block_pool.touch(hits)\n", ""),
    PlantedBug("touches_hits_before_checking_room",
               "    num_free_hits = sum(1 for b in hits if b.ref_cnt == 0)\n",
               "    num_free_hits = sum(1 for b in hits if b.ref_cnt == 0)\n    self.block_pool.touch(hits)\n",
               more=(("        return None\n    self.block_pool.touch(hits)\n", "        return None\n"),)),
    # lab 05's bookkeeping forgotten: the hits would be registered in the prefix cache again
    PlantedBug("num_cached_blocks_not_set", "        self.num_cached_blocks[request.request_id] = len(table)\n", ""),
    # the prediction: the bound (under one block) instead of the mean
    PlantedBug("prediction_is_the_bound", "    return (block_size - 1) / 2", "    return block_size - 1"),
    PlantedBug("prediction_is_a_block", "    return (block_size - 1) / 2", "    return float(block_size)"),
]
