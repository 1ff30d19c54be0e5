"""Planted bugs for lab 14_find_the_bottleneck: slips a learner plausibly makes; each must fail a test."""
from grader.bugs import PlantedBug

BUGS = [
    # predictions
    PlantedBug("prediction_launches_forget_the_layers", "return seqs * layers, layers", "return seqs, 1"),
    PlantedBug("prediction_clone_one_tensor", "return 2 * layers * blocks", "return layers * blocks"),
    # write_kv
    PlantedBug("write_kv_key_into_both_caches",
               "self.ops.reshape_and_cache(key, value, kv.key_cache", "self.ops.reshape_and_cache(key, key, kv.key_cache"),
    # correct but not faster: the batched op called once per token
    PlantedBug("write_kv_one_call_per_token",
               "    self.ops.reshape_and_cache(key, value, kv.key_cache, kv.value_cache, self.meta.slot_mapping,\n"
               "                               self.meta.kv_cache_dtype, kv.k_scale, kv.v_scale)\n",
               "    for i in range(key.shape[0]):\n"
               "        self.ops.reshape_and_cache(key[i:i + 1], value[i:i + 1], kv.key_cache, kv.value_cache,\n"
               "                                   self.meta.slot_mapping[i:i + 1], self.meta.kv_cache_dtype, kv.k_scale,\n"
               "                                   kv.v_scale)\n"),
    # attend
    # correct but not faster: the defensive copy kept
    PlantedBug("attend_still_clones_the_cache", "    cache = (kv.key_cache, kv.value_cache)\n",
               "    cache = (kv.key_cache.clone(), kv.value_cache.clone())\n"),
    # correct but not faster: one decode launch per sequence in a decode-only step
    PlantedBug("attend_decode_per_sequence",
               "    if nd == self.num_seqs:\n        return ops.paged_attention_decode(query, *cache, *self.decode, scale, "
               "kv.k_scale, kv.v_scale,\n                                          num_splits=splits)\n",
               "    if nd == self.num_seqs:\n        tables, lens = self.decode\n"
               "        return torch.cat([ops.paged_attention_decode(query[i:i + 1], *cache, tables[i:i + 1], lens[i:i + 1],\n"
               "                                                     scale, kv.k_scale, kv.v_scale, num_splits=splits)\n"
               "                          for i in range(nd)])\n"),
    # the prefill chunks' query_start_loc not rebased past the decode rows: each chunk reads another's rows
    PlantedBug("attend_prefill_offsets_not_rebased",
               "    out[nd:] = ops.paged_attention(query[nd:], *cache, *self.prefill, scale, kv.k_scale, kv.v_scale)\n",
               "    meta = self.meta\n    out[nd:] = ops.paged_attention(query[nd:], *cache, meta.block_tables[nd:], meta.seq_lens[nd:],\n"
               "                                   meta.query_start_loc[nd:], scale, kv.k_scale, kv.v_scale)\n"),
    # sample
    # correct but not faster: the tokens read back one row at a time (a host sync per request)
    PlantedBug("sample_item_per_row", "    return greedy.masked_fill_(invalid, INVALID_TOKEN).tolist()\n",
               "    tokens = greedy.masked_fill_(invalid, INVALID_TOKEN)\n    return [int(tokens[i].item()) for i in range(len(requests))]\n"),
    # faster but changes tokens: every request decoded greedily
    PlantedBug("sample_everything_greedy", "sampled_rows = [i for i, p in enumerate(params) if not p.greedy]",
               "sampled_rows = []"),
    PlantedBug("sample_temperature_ignored", "x = logits[rows] / temps[:, None]", "x = logits[rows]"),
    PlantedBug("sample_nan_rows_not_invalid", "    invalid = ~top.isfinite()\n",
               "    invalid = torch.zeros_like(top, dtype=torch.bool)\n"),
    # only NaN rows invalid: a +inf logit or a row of -inf still gets a token
    PlantedBug("sample_only_nan_invalid", "    invalid = ~top.isfinite()\n", "    invalid = top.isnan()\n"),
    # block_tables
    PlantedBug("block_tables_width_of_the_first_row", "width = int(self.num_blocks[rows].max()) if rows else 0",
               "width = int(self.num_blocks[rows[0]]) if rows else 0"),
    # numpy's max of no rows raises: a step with no sequence asks for an empty table
    PlantedBug("block_tables_no_rows_raises", "width = int(self.num_blocks[rows].max()) if rows else 0",
               "width = int(self.num_blocks[rows].max())"),
    # correct but not faster: the tables rebuilt from Python lists
    PlantedBug("block_tables_from_python_lists", "    return torch.from_numpy(self.block_table[rows, :width])\n",
               "    return torch.tensor([self.block_table[r, :width].tolist() for r in rows], dtype=torch.int32)"
               ".reshape(len(rows), width)\n"),
    # remove_finished
    PlantedBug("remove_finished_keeps_only_the_finished", "if r.request_id not in done]", "if r.request_id in done]"),
    # correct but not faster: a list of ids scanned for every running request (O(n k) in C)
    PlantedBug("remove_finished_list_scan", "done = {r.request_id for r in finished}",
               "done = [r.request_id for r in finished]"),
    # the OOM hunt
    # the sampler's logits counted outside the budget (vLLM's profile run includes them): 24% more headroom
    PlantedBug("oom_logits_outside_the_budget", "held_at_start = gib", "held_at_start = gib + 512 * LLAMA3_8B.vocab_size * 4"),
    # max_model_len rounded up to a whole block: one block more than fits
    PlantedBug("oom_max_model_len_rounded_up", "math.floor(free_c / (16 * kv)) * 16", "math.ceil(free_c / (16 * kv)) * 16"),
    PlantedBug("oom_swap_at_the_warning_level", "0.7 * 512 / 8", "0.4 * 512 / 8"),
    PlantedBug("oom_max_model_len_without_activations",
               "free_c = small * 0.9 - weights - memory.activation_bytes(LLAMA3_8B, dtype, 8192)",
               "free_c = small * 0.9 - weights"),
    # hardware numbers: the two slips, and a link quoted in both directions
    PlantedBug("quiz_h100_141_gb", '"h100_hbm_bytes": 80e9', '"h100_hbm_bytes": 141e9'),
    PlantedBug("quiz_a100_80gb_at_1_5_tb", '"a100_hbm_bytes_per_s": 2.039e12', '"a100_hbm_bytes_per_s": 1.5e12'),
    PlantedBug("quiz_nvlink_both_directions", '"nvlink4_bytes_per_s": 450e9', '"nvlink4_bytes_per_s": 900e9'),
    PlantedBug("slip_141_gb_not_caught", '"gpu_with_141_gb": "H200"', '"gpu_with_141_gb": "H100"'),
    # mfu: a training step's 6N, the attention FLOPs left out or halved, the fp8 peak
    PlantedBug("mfu_training_flops", "(2 * memory.num_params(spec) + attention)", "(6 * memory.num_params(spec) + attention)"),
    PlantedBug("mfu_no_attention", "(2 * memory.num_params(spec) + attention)", "(2 * memory.num_params(spec))"),
    PlantedBug("mfu_attention_one_matmul", "attention = 4 * spec.num_layers", "attention = 2 * spec.num_layers"),
    PlantedBug("mfu_fp8_peak", ".bf16_flops\n", ".fp8_flops\n"),
    # the prediction with the weights alone read per step: the KV left out is 1.5x off at batch 64
    PlantedBug("predicted_mfu_weights_only", "memory.weight_bytes(LLAMA3_8B, \"bf16\") + batch * 1024 * kv)",
               "memory.weight_bytes(LLAMA3_8B, \"bf16\"))"),
    # the call stack: vLLM's runner name in the kit's path, the step and the scheduler swapped, the kernel before
    # the layer that launches it
    PlantedBug("call_path_vllm_runner_name", '"ModelRunner.execute_model",\n            "LlamaForCausalLM.forward"',
               '"GPUModelRunner.execute_model",\n            "LlamaForCausalLM.forward"'),
    PlantedBug("call_path_schedule_before_step", '"LLMEngine.step", "Scheduler.schedule",',
               '"Scheduler.schedule", "LLMEngine.step",'),
    PlantedBug("call_path_kernel_before_attend", '"AttentionPlan.attend", "paged_attention",',
               '"paged_attention", "AttentionPlan.attend",'),
    PlantedBug("call_path_stops_at_the_layer", '"AttentionPlan.attend", "paged_attention",', '"AttentionPlan.attend",'),
    # vLLM's names: v0's answer (LLMEngine steps itself), the worker for its runner
    PlantedBug("vllm_step_is_llmengine", '"LLMEngine.step": "EngineCore"', '"LLMEngine.step": "LLMEngine"'),
    PlantedBug("vllm_runner_is_the_worker", '"ModelRunner.execute_model": "GPUModelRunner"',
               '"ModelRunner.execute_model": "Worker"'),
    # TensorRT-LLM vs vLLM
    PlantedBug("features_vllm_builds_too", '"ahead_of_time_build": (True, False)', '"ahead_of_time_build": (True, True)'),
    PlantedBug("features_trtllm_without_graphs", '"cuda_graphs": (True, True)', '"cuda_graphs": (False, True)'),
    # buckets as powers of two (33 rows run at 64, not 48), or the next size strictly above n
    PlantedBug("padding_powers_of_two",
               "sizes = [s for s in (1, 2, 4, 8) if s < max_num_seqs] + list(range(16, max_num_seqs, 16)) + [max_num_seqs]",
               "sizes = [2 ** k for k in range(max_num_seqs.bit_length() + 1)]"),
    PlantedBug("padding_strictly_above", "min(s for s in sizes if s >= n) - n", "min([s for s in sizes if s > n] + [n]) - n"),
    # the prefill step's 40 rows counted as a decode step
    PlantedBug("predicted_padding_counts_the_prefill", "rows = list(range(39, 0, -1))", "rows = list(range(40, 0, -1))"),
    # TTFT: the queue ahead forgotten, milliseconds
    PlantedBug("ttft_without_the_queue", "return sum(prompt_lens[:index + 1]) / prefill_tokens_per_s",
               "return prompt_lens[index] / prefill_tokens_per_s"),
    PlantedBug("ttft_in_milliseconds", "return sum(prompt_lens[:index + 1]) / prefill_tokens_per_s",
               "return 1e3 * sum(prompt_lens[:index + 1]) / prefill_tokens_per_s"),
    # the queue ahead without the request's own prompt
    PlantedBug("ttft_queue_without_its_own_prompt", "return sum(prompt_lens[:index + 1]) / prefill_tokens_per_s",
               "return sum(prompt_lens[:index]) / prefill_tokens_per_s"),
]
