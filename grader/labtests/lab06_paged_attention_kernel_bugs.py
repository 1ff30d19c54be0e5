"""Planted bugs for lab 06_paged_attention_kernel: each must make at least one official test fail."""
from grader.bugs import PlantedBug

BUGS = [
    # online softmax (PyTorch)
    PlantedBug("softmax_acc_not_rescaled", "acc * alpha[:, None] + p @ v", "acc + p @ v"),
    PlantedBug("softmax_nan_when_all_masked",
               'torch.where(m_new == float("-inf"), torch.zeros_like(m_new), m_new)', "m_new"),
    # the Triton kernel
    PlantedBug("kernel_skips_block_table",
               "tl.load(block_tables_ptr + seq * stride_bt + t // BLOCK_SIZE, mask=t_mask, other=0).to(tl.int64)",
               "(t // BLOCK_SIZE).to(tl.int64)"),
    PlantedBug("kernel_gqa_head_mapping", "heads = kv_head * GROUP + g", "heads = kv_head + g"),
    PlantedBug("kernel_reads_past_seq_len", "t_mask = t < seq_len", "t_mask = t <= seq_len"),
    PlantedBug("kernel_padding_not_masked", 's = tl.where(t_mask[None, :], s, float("-inf"))\n', ""),
    PlantedBug("kernel_acc_not_rescaled", "acc = acc * alpha[:, None] + dot(", "acc = acc + dot("),
    PlantedBug("kernel_output_uses_query_stride", "out_ptr + seq * stride_os", "out_ptr + seq * stride_qs"),
    PlantedBug("launcher_falls_back_to_pytorch",
               "    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)\n",
               "    from kernels import reference\n    return reference.paged_attention_decode(\n"
               "        query, key_cache, value_cache, block_tables, seq_lens, scale)\n"),
    PlantedBug("kernel_nan_on_empty_row", "acc / tl.where(l == 0.0, 1.0, l)[:, None]", "acc / l[:, None]"),
    # the prediction: the newest token's KV is read too; V counts as much as K
    PlantedBug("prediction_without_the_newest_token", "seq_lens = [n + 11 for n", "seq_lens = [n + 10 for n"),
    PlantedBug("prediction_reads_k_only", "return 2 * sum(seq_lens) * 2 * 16 * 4", "return sum(seq_lens) * 2 * 16 * 4"),
]
