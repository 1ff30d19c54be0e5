"""Planted bugs for lab 03_preemption: preemption slips a learner plausibly makes; each must fail a test."""
from grader.bugs import PlantedBug

VICTIM = "victim = max(self.running, key=lambda r: (r.priority, r.arrival_time))"

BUGS = [
    PlantedBug("victim_earliest_arrival", VICTIM,
               "victim = max(self.running, key=lambda r: (r.priority, -r.arrival_time))"),
    PlantedBug("victim_ignores_priority", VICTIM, "victim = max(self.running, key=lambda r: r.arrival_time)"),
    PlantedBug("victim_most_important", VICTIM, "victim = min(self.running, key=lambda r: (r.priority, r.arrival_time))"),
    # vLLM v1's FCFS rule (the tail of the running list) where this engine uses the priority rule
    PlantedBug("victim_running_tail", VICTIM, "victim = self.running[-1]"),
    PlantedBug("recompute_keeps_progress", "        victim.num_computed_tokens = 0\n", ""),
    PlantedBug("recompute_to_the_back", "self.waiting.appendleft(victim)", "self.waiting.append(victim)"),
    PlantedBug("swapped_queue_unsorted",
               "bisect.insort(self.swapped, victim, key=lambda r: (r.priority, r.arrival_time))",
               "self.swapped.append(victim)"),
    PlantedBug("swap_cost_one_way", "swap_s = 2 * n *", "swap_s = n *"),
    PlantedBug("swap_cost_assumes_fp16", "kv_cache_bytes_per_token(cm.model_spec, cm.kv_cache_dtype)",
               'kv_cache_bytes_per_token(cm.model_spec, "fp16")'),
    # a forced mode that consults the cost model anyway (tiny-llama at the CPU default rates prefers swap)
    PlantedBug("forced_swap_follows_the_cost_model", '    if mode == "swap":\n        return "swap"\n', ""),
    PlantedBug("forced_swap_without_cpu_room", " or not self.kv_cache_manager.can_swap_out(request)", ""),
    # the CPU room checked against the whole block table: a request mid-prefill is refused a swap it fits
    PlantedBug("swap_room_from_the_whole_table", " or not self.kv_cache_manager.can_swap_out(request)",
               " or len(self.kv_cache_manager.req_to_blocks.get(request.request_id, []))"
               " > self.kv_cache_manager.cpu_block_pool.num_free_blocks"),
    # the CPU room checked against the pool's size: a swap is admitted into blocks another request holds
    PlantedBug("swap_room_against_the_cpu_pool_size", " or not self.kv_cache_manager.can_swap_out(request)",
               " or -(-n // self.kv_cache_manager.block_size) > self.kv_cache_manager.num_cpu_blocks"),
    PlantedBug("swap_out_copies_whole_table", "n = cdiv(request.num_computed_tokens, self.block_size)",
               "n = len(self.req_to_blocks.get(rid, []))"),
    # the find-the-bug task's own bug, written by the learner: the partly written last block is not copied
    PlantedBug("swap_out_full_blocks_only", "n = cdiv(request.num_computed_tokens, self.block_size)",
               "n = request.num_computed_tokens // self.block_size"),
    PlantedBug("swap_out_leaks_gpu_blocks", "    self.block_pool.free_blocks(reversed(self.req_to_blocks.pop(rid, [])))\n",
               "    self.req_to_blocks.pop(rid, [])\n"),
    # performance only: a request back from the CPU never caches its later blocks again (fewer prefix hits)
    PlantedBug("swap_out_keeps_cached_count", "    self.num_cached_blocks.pop(rid, None)\n", ""),
    PlantedBug("swap_in_leaks_cpu_blocks", "    self.cpu_block_pool.free_blocks(self.req_to_cpu_blocks.pop(rid, []))\n",
               "    self.req_to_cpu_blocks.pop(rid, [])\n"),
    PlantedBug("swap_in_pairs_reversed", "mapping = [(c.block_id, g.block_id) for c, g in zip(cpu_blocks, gpu_blocks)]",
               "mapping = [(g.block_id, c.block_id) for c, g in zip(cpu_blocks, gpu_blocks)]"),
    # find the bug: a failing input on which the buggy version happens to be right (whole blocks of KV)
    PlantedBug("failing_input_on_a_block_boundary", "return (6, 2)", "return (8, 2)"),
    # prediction: the busy step's own KV reads forgotten: it looks compute-bound much earlier
    PlantedBug("prediction_ignores_the_batch_kv", "read_s = (2 * params / tp + 64 * 2000 * kv_per_gpu)",
               "read_s = (2 * params / tp)"),
    # the knee: a partly filled block rounded away, the output forgotten, the last sampled token given a slot
    PlantedBug("knee_floor_blocks", "blocks_per_request = cdiv(prompt_len + max_tokens - 1, block_size)",
               "blocks_per_request = (prompt_len + max_tokens - 1) // block_size"),
    PlantedBug("knee_prompt_only", "blocks_per_request = cdiv(prompt_len + max_tokens - 1, block_size)",
               "blocks_per_request = cdiv(prompt_len, block_size)"),
    PlantedBug("knee_last_token_holds_kv", "blocks_per_request = cdiv(prompt_len + max_tokens - 1, block_size)",
               "blocks_per_request = cdiv(prompt_len + max_tokens, block_size)"),
    # prediction: the knee from the prompts' blocks only (admission's view, not the last step's)
    PlantedBug("knee_prediction_prompt_only", "blocks_per_request = -(-(1800 + 600 - 1) // 16)",
               "blocks_per_request = -(-1800 // 16)"),
]
