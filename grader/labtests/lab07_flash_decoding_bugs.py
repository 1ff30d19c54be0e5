"""Planted bugs for lab 07_flash_decoding: each must make at least one official test fail."""
from grader.bugs import PlantedBug

BUGS = [
    # the merge (PyTorch)
    PlantedBug("merge_without_max_subtraction", "weights = torch.exp(lse - top)", "weights = torch.exp(lse)"),
    PlantedBug("merge_empty_split_weighted_as_lse_0", "weights = torch.exp(lse - top)",
               "weights = torch.exp(torch.nan_to_num(lse, neginf=0.0) - top)"),
    PlantedBug("merge_nan_when_every_split_is_empty",
               "    top = torch.where(torch.isinf(top), torch.zeros_like(top), top)  # all splits empty: shift by 0, "
               "not by -inf\n", ""),
    PlantedBug("merge_one_max_for_the_whole_tensor", "top = lse.amax(dim=-1, keepdim=True)", "top = lse.amax()"),
    PlantedBug("merge_over_the_wrong_axis", "merged = (weights.unsqueeze(-1) * outputs).sum(dim=-2)",
               "merged = (weights.unsqueeze(-1) * outputs).sum(dim=-1)"),
    # a Python loop over the splits: the right values, S small ops instead of one (counted)
    PlantedBug("merge_loops_over_splits", "    merged = (weights.unsqueeze(-1) * outputs).sum(dim=-2)\n",
               "    merged = torch.zeros_like(outputs[..., 0, :])\n    for s in range(outputs.shape[-2]):\n"
               "        merged = merged + weights[..., s:s + 1] * outputs[..., s, :]\n"),
    PlantedBug("merge_not_normalised", "return merged / torch.where(total == 0, torch.ones_like(total), total)",
               "return merged"),
    # the split kernel and its launcher
    PlantedBug("kernel_lse_left_in_base_2", "(m + tl.log2(l_safe)) * 0.6931471805599453", "(m + tl.log2(l_safe))"),
    PlantedBug("kernel_empty_split_lse_0", 'lse = tl.where(l == 0.0, float("-inf"),', "lse = tl.where(l == 0.0, 0.0,"),
    PlantedBug("kernel_splits_not_tile_aligned",
               "tiles_per_split = tl.cdiv(tl.cdiv(seq_len, BLOCK_N), NUM_SPLITS)\n"
               "    start = split * tiles_per_split * BLOCK_N\n"
               "    end = tl.minimum(start + tiles_per_split * BLOCK_N, seq_len)",
               "span = tl.cdiv(seq_len, NUM_SPLITS)\n    start = split * span\n    end = tl.minimum(start + span, seq_len)"),
    PlantedBug("kernel_splits_overlap", "end = tl.minimum(start + tiles_per_split * BLOCK_N, seq_len)",
               "end = tl.minimum(start + (tiles_per_split + 1) * BLOCK_N, seq_len)"),
    PlantedBug("kernel_last_split_drops_the_tail", "tiles_per_split = tl.cdiv(tl.cdiv(seq_len, BLOCK_N), NUM_SPLITS)",
               "tiles_per_split = tl.cdiv(seq_len, BLOCK_N) // NUM_SPLITS"),
    PlantedBug("kernel_lse_from_a_stale_sum", "l = l * alpha + tl.sum(p, 1)", "l = l + tl.sum(p, 1)"),
    PlantedBug("launcher_returns_fp32", "return merge_partials(partials, lse).to(query.dtype)",
               "return merge_partials(partials, lse)"),
    # partials and lse in the query's dtype: an fp16 cache gets fp16 partials and an fp16 merge
    PlantedBug("launcher_partials_in_the_query_dtype",
               "partials = torch.empty(num_seqs, num_heads, num_splits, head_dim, dtype=torch.float32,",
               "partials = torch.empty(num_seqs, num_heads, num_splits, head_dim, dtype=query.dtype,",
               more=(("lse = torch.empty(num_seqs, num_heads, num_splits, dtype=torch.float32,",
                      "lse = torch.empty(num_seqs, num_heads, num_splits, dtype=query.dtype,"),)),
    # fp16 partials handed over as fp32: the merge's dtype is right, the lse already rounded
    PlantedBug("launcher_fp16_partials_upcast_for_the_merge",
               "partials = torch.empty(num_seqs, num_heads, num_splits, head_dim, dtype=torch.float32,",
               "partials = torch.empty(num_seqs, num_heads, num_splits, head_dim, dtype=query.dtype,",
               more=(("lse = torch.empty(num_seqs, num_heads, num_splits, dtype=torch.float32,",
                      "lse = torch.empty(num_seqs, num_heads, num_splits, dtype=query.dtype,"),
                     ("return merge_partials(partials, lse).to(query.dtype)",
                      "return merge_partials(partials.float(), lse.float()).to(query.dtype)"))),
    # the policy
    PlantedBug("policy_ignores_the_min_tiles_rule",
               "while (programs * splits < 2 * num_sms and max_seq_len // (2 * splits) >= MIN_TILES_PER_SPLIT * block_n\n"
               "           and splits < SPLIT_COUNTS[-1]):",
               "while (programs * splits < 2 * num_sms\n           and splits < SPLIT_COUNTS[-1]):"),
    PlantedBug("policy_not_a_power_of_two", "splits *= 2", "splits += 1"),
    PlantedBug("policy_one_program_per_sm", "programs * splits < 2 * num_sms", "programs * splits < num_sms"),
    # one doubling too many where the grid has exactly 2 programs per SM
    PlantedBug("policy_doubles_at_exactly_two_per_sm", "programs * splits < 2 * num_sms", "programs * splits <= 2 * num_sms"),
    PlantedBug("policy_without_the_cap", "\n           and splits < SPLIT_COUNTS[-1]):", "):"),
    PlantedBug("policy_ignores_block_n", ">= MIN_TILES_PER_SPLIT * block_n", ">= MIN_TILES_PER_SPLIT * 64"),
    # the prediction
    PlantedBug("prediction_counts_query_heads", "programs = 132, 1 * 8", "programs = 132, 1 * 32"),
]
