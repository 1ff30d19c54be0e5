"""Planted bugs for lab 09_multi_lora: slips a learner plausibly makes; each must fail a test."""
from grader.bugs import PlantedBug

BUGS = [
    # predictions
    PlantedBug("prediction_mha_kv_heads", "2 * (hidden + kv)", "2 * (hidden + q)"),  # k/v as wide as q: +12.5%
    PlantedBug("prediction_fp32_adapter", "layers, rank, nbytes = 4096, 32 * 128, 8 * 128, 14336, 32, 16, 2",
               "layers, rank, nbytes = 4096, 32 * 128, 8 * 128, 14336, 32, 16, 4"),
    PlantedBug("prediction_pcie_gen4", "predicted_adapter_bytes() / 64e9", "predicted_adapter_bytes() / 32e9"),
    PlantedBug("prediction_steps_one_batch", "return 8, 4 * 8", "return 8, 8"),
    # add_lora
    PlantedBug("delta_not_scaled", "delta = stack.scaling[s] * (", "delta = ("),
    PlantedBug("every_slice_reads_the_first_rank_block", "t[:, j * r:(j + 1) * r]", "t[:, :r]"),
    PlantedBug("slices_all_write_the_first_columns", "            col += out\n", ""),
    PlantedBug("segments_ignore_the_decode_rows", "torch.arange(n + starts[j], n + starts[j + 1]",
               "torch.arange(starts[j], starts[j + 1]"),
    # slot -1 indexes the last slot in Python: base-model rows get that adapter's delta
    PlantedBug("base_rows_get_the_last_slot", "        if s >= 0:\n            groups.append",
               "        if True:\n            groups.append"),
    # one matmul per decode row (a Python loop over rows): the right values, slow
    PlantedBug("add_lora_one_matmul_per_row",
               "    for s in sorted(set(row_slots)):\n        if s >= 0:\n"
               "            groups.append((torch.tensor([i for i, t in enumerate(row_slots) if t == s], device=x.device), s))\n",
               "    for i, s in enumerate(row_slots):\n        if s >= 0:\n"
               "            groups.append((torch.tensor([i], device=x.device), s))\n"),
    # the Triton BGMV shrink
    # the rank tile fixed at 16: ranks above 16 silently truncated
    PlantedBug("shrink_rank_tile_fixed_at_16", "BLOCK_R=max(16, triton.next_power_of_2(rank))", "BLOCK_R=16"),
    PlantedBug("kernel_base_rows_read_slot_0", "    r_mask = (r < R) & (slot >= 0)\n", "    r_mask = r < R\n",
               more=(("        k_mask = (k < K) & (slot >= 0)\n", "        k_mask = k < K\n"),)),
    PlantedBug("kernel_k_tail_unmasked", "        k_mask = (k < K) & (slot >= 0)\n", "        k_mask = (k >= 0) & (slot >= 0)\n"),
    PlantedBug("shrink_output_in_the_input_dtype", "out = torch.zeros(num_rows, rank, dtype=torch.float32",
               "out = torch.zeros(num_rows, rank, dtype=x.dtype"),
    PlantedBug("one_launch_per_adapter",
               "        bgmv_shrink_kernel[(num_rows,)](x, lora_a, out, row_slots,",
               "        for s in row_slots.unique().tolist():\n"
               "          bgmv_shrink_kernel[(num_rows,)](x, lora_a, out, torch.where(row_slots == s, row_slots, -1),"),
    # assign
    # a repeated id in `needed` counted twice: a missing one evicts two adapters (or raises) for one load
    PlantedBug("repeated_id_counted_twice", "step = list(dict.fromkeys(needed))", "step = list(needed)"),
    PlantedBug("evicts_pinned_adapters", "keep = set(step) | set(pinned)", "keep = set(step)"),
    PlantedBug("evicts_most_recently_used", "evictable[:num_evict]", "evictable[len(evictable) - num_evict:]"),
    PlantedBug("evicts_even_with_free_slots", "num_evict = max(0, len(missing) - len(self.free_slots))",
               "num_evict = min(len(missing), len(evictable))"),
    PlantedBug("recency_not_refreshed", "            self.slot_of.move_to_end(i)\n", "            pass\n"),
    # the check after the evictions: a rejected call has already evicted adapters
    PlantedBug("evicts_before_checking", "    if num_evict > len(evictable):\n        raise RuntimeError(",
               "    if False:\n        raise RuntimeError(",
               more=(("        self.free_slots.append(self.slot_of.pop(i))\n",
                      "        self.free_slots.append(self.slot_of.pop(i))\n    if num_evict > len(evictable):\n"
                      "        raise RuntimeError('no slot left: max_loras')\n"),)),
    # _lora_slot_available
    PlantedBug("slot_rule_off_by_one", "len(running_loras) < self.config.max_loras",
               "len(running_loras) <= self.config.max_loras"),
    PlantedBug("running_adapter_must_wait_too", "request.lora_id in running_loras or len(", "len("),
    PlantedBug("slot_rule_ignores_enable_lora", " or not self.config.enable_lora:", ":"),
]
