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
    PlantedBug("no_double_free_check", "        if block.ref_cnt <= 0:\n", "        if False:\n"),
    PlantedBug("floor_division", "cdiv(num_tokens, self.block_size)", "num_tokens // self.block_size"),
    PlantedBug("ignores_the_table", "cdiv(num_tokens, self.block_size) - len(table) - len(hits)",
               "cdiv(num_tokens, self.block_size) - len(hits)"),
    PlantedBug("counts_all_tokens_not_computed", "num_tokens = request.num_computed_tokens +",
               "num_tokens = request.num_tokens +"),
    PlantedBug("free_hits_counted_as_room", "self.block_pool.num_free_blocks - num_free_hits",
               "self.block_pool.num_free_blocks"),
    PlantedBug("hits_not_touched", "    self.block_pool.touch(hits)\n", ""),
]
