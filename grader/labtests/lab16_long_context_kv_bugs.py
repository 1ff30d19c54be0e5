"""Planted bugs for lab 16_long_context_kv: each must make at least one official test fail."""
from grader.bugs import PlantedBug

BUGS = [
    # the predictions
    PlantedBug("kv_without_v", "return 2 * num_layers * num_kv_heads * head_dim * dtype_bytes * num_tokens",
               "return num_layers * num_kv_heads * head_dim * dtype_bytes * num_tokens"),
    PlantedBug("weights_one_byte_per_param", "/ (LLAMA3_70B_PARAMS * 2)", "/ LLAMA3_70B_PARAMS"),
    PlantedBug("truncation_drops_the_system_prompt",
               "return (system_tokens + turns * tokens_per_turn) * bytes_per_token",
               "return (turns * tokens_per_turn + (0 if keep_last_turns else system_tokens)) * bytes_per_token"),
    PlantedBug("window_floor_of_blocks", "num_blocks = -(-num_computed_tokens // block_size)",
               "num_blocks = num_computed_tokens // block_size"),
    PlantedBug("mla_without_the_rope_key", "return num_layers * (kv_lora_rank + qk_rope_head_dim) * dtype_bytes",
               "return num_layers * kv_lora_rank * dtype_bytes"),
    PlantedBug("restore_round_trip", "return num_tokens * bytes_per_token / link_bytes_per_s",
               "return 2 * num_tokens * bytes_per_token / link_bytes_per_s"),
    PlantedBug("prefill_without_the_weight_floor", "return max(compute, weights)", "return compute"),
    # the window's block release
    PlantedBug("window_off_by_one", "return max(0, (num_computed_tokens - window + 1) // block_size)",
               "return max(0, (num_computed_tokens - window) // block_size)"),
    PlantedBug("window_accepts_zero", "if window < 1:", "if window < 0:"),
    # eviction
    PlantedBug("streaming_keeps_the_oldest", "return list(middle[:len(middle) - num_heavy])",
               "return list(middle[num_heavy:])"),
    PlantedBug("h2o_tie_to_the_older", "key=lambda i: (block_scores[i], i), reverse=True",
               "key=lambda i: (block_scores[i], -i), reverse=True"),
    PlantedBug("h2o_evicts_the_heavy", "return [i for i in middle if i not in heavy]",
               "return [i for i in middle if i in heavy]"),
    PlantedBug("budget_below_sinks_accepted", "if budget_blocks < num_sink_blocks + num_recent_blocks:",
               "if budget_blocks < num_sink_blocks:"),
    # the offload tier's save
    PlantedBug("save_copies_stored_blocks_again", "if entry is not None and entry[1] == block_hash:",
               "if False:"),
    PlantedBug("save_evicts_its_own_blocks", "victim = next((h for h in self.entries if h not in keep), None)",
               "victim = next((h for h in self.entries), None)"),
    PlantedBug("save_evicts_most_recent", "victim = next((h for h in self.entries if h not in keep), None)",
               "victim = next((h for h in reversed(self.entries) if h not in keep), None)"),
    PlantedBug("save_collision_kept", "if entry is not None and entry[1] == block_hash:",
               "if entry is not None:"),
    # the offload tier's load (contract only)
    PlantedBug("load_skips_a_miss", "        if entry is None:\n            break\n",
               "        if entry is None:\n            continue\n"),
    PlantedBug("load_serves_a_collision", "        if entry[1] != block_hash:\n", "        if False:\n"),
    PlantedBug("load_without_lru_refresh", "        self.entries.move_to_end(block_hash.hash_value)\n    self.counters",
               "    self.counters"),
    PlantedBug("load_counts_hits_as_queries", "self.counters.external_prefix_cache_queries += len(block_hashes)",
               "self.counters.external_prefix_cache_queries += len(slots)"),
]
