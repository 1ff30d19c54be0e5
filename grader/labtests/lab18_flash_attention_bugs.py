"""Planted bugs for lab 18_flash_attention: each must make at least one official test fail."""
from grader.bugs import PlantedBug

BUGS = [
    # the predictions
    PlantedBug("naive_bytes_scores_once", "return (4 * n * d + 4 * n * n) * b", "return (4 * n * d + 2 * n * n) * b"),
    PlantedBug("fused_bytes_without_the_output", "return 4 * n * d * b  # Q, K, V read, O written",
               "return 3 * n * d * b"),
    PlantedBug("tile_single_buffer_counted_once", "(1 + 2 * stages)", "(1 + stages)"),
    PlantedBug("causal_flops_without_the_diagonal", "pairs = n * (n + 1) // 2", "pairs = n * n // 2"),
    PlantedBug("roofline_adds_the_terms", "max(compute_s, memory_s)", "compute_s + memory_s"),
    # the PyTorch loop nest
    PlantedBug("tiled_missing_rescale", "acc = acc * alpha[..., None] + p @ v_all[:, start:stop]",
               "acc = acc + p @ v_all[:, start:stop]"),
    PlantedBug("tiled_sum_not_rescaled", "l = l * alpha + p.sum(dim=-1)", "l = l + p.sum(dim=-1)"),
    PlantedBug("tiled_causal_off_by_one", "t[None, None, :] > q_pos[None, :, None]",
               "t[None, None, :] >= q_pos[None, :, None]"),
    # GQA with the KV heads repeated as a block (head h reads h % H_kv) instead of interleaved (h // group)
    PlantedBug("tiled_gqa_head_mapping", "k_all = key.to(acc_dtype).repeat_interleave(group, dim=1)",
               "k_all = key.to(acc_dtype).repeat(1, group, 1)",
               more=(("v_all = value.to(acc_dtype).repeat_interleave(group, dim=1)",
                      "v_all = value.to(acc_dtype).repeat(1, group, 1)"),)),
    PlantedBug("tiled_fp16_accumulation", "acc_dtype = torch.promote_types(query.dtype, torch.float32)",
               "acc_dtype = query.dtype"),
    PlantedBug("tiled_without_the_max", "p = torch.exp(s - m_new[..., None])", "p = torch.exp(s)",
               more=(("alpha = torch.exp(m - m_new)", "alpha = torch.ones_like(m)"),)),
    # materialises every head's whole score row block against all keys at once: right values, N x N memory
    PlantedBug("tiled_materialises_the_scores", "    for first in range(0, q_len, block_m):\n",
               "    block_m = block_n = max(q_len, seq_len)\n    for first in range(0, q_len, block_m):\n"),
    # the early exit (contract only)
    PlantedBug("tiles_rounded_up_from_the_position", "return last_position // block_n + 1",
               "return -(-last_position // block_n)"),
    PlantedBug("tiles_past_the_chunk_end", "last_position = context_len + min(first_row + block_m, q_len) - 1",
               "last_position = context_len + first_row + block_m - 1"),
    PlantedBug("tiles_ignore_the_prefix", "last_position = context_len + min(first_row + block_m, q_len) - 1",
               "last_position = min(first_row + block_m, q_len) - 1"),
    # the Triton kernel and its launcher
    PlantedBug("kernel_missing_rescale", "acc = acc * alpha[:, None] + pv", "acc = acc + pv"),
    PlantedBug("kernel_causal_off_by_one", "(t[None, :] <= q_pos[:, None]) & t_mask[None, :]",
               "(t[None, :] <= q_pos[:, None] + 1) & t_mask[None, :]"),
    # a sequence's length taken from seq_lens: a chunk after a prefix reads and writes rows past its end in cu_seqlens
    PlantedBug("kernel_reads_past_cu_seqlens", "q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start",
               "q_len = tl.load(seq_lens_ptr + seq)"),
    PlantedBug("launcher_gqa_group_is_num_kv_heads", "GROUP=num_heads // num_kv_heads", "GROUP=num_kv_heads"),
    PlantedBug("kernel_without_the_early_exit", "kv_end = context_len + tl.minimum(first + BLOCK_M, q_len)",
               "kv_end = seq_len"),
    PlantedBug("kernel_natural_scale_with_exp2", "scale * LOG2E,", "scale,"),
    PlantedBug("kernel_not_normalised", "out = acc / l[:, None]", "out = acc"),
    PlantedBug("launcher_one_tile_per_sequence", 'grid = (triton.cdiv(num_tokens, cfg["BLOCK_M"]), num_heads, num_seqs)',
               "grid = (1, num_heads, num_seqs)"),
    # the questions
    PlantedBug("answers_fa1_queries_outside", '"fa1_loop_order": "b"', '"fa1_loop_order": "a"'),
]
