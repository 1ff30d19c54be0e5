"""Planted bugs for lab 11_parallelism: slips a learner plausibly makes; each must fail a test."""
from grader.bugs import PlantedBug

BUGS = [
    # predictions
    PlantedBug("prediction_ethernet_bits_as_bytes", "nvlink_bytes_per_s=ETHERNET_BYTES_PER_S",
               "nvlink_bytes_per_s=100e9"),
    PlantedBug("prediction_no_cross_node_latency", "allreduce_latency_s=ETHERNET_LATENCY_S)",
               "allreduce_latency_s=H100.allreduce_latency_s)"),
    # a pipeline stage holds half the layers, so "half the TPOT": but a token passes both stages
    PlantedBug("prediction_pipeline_halves_tpot", '"tp8_pp2": 1e3 * (tp8 + send)', '"tp8_pp2": 1e3 * (tp8 / 2 + send)'),
    # the stage-to-stage send left out: 0.3% of the TPOT, inside its 1%, but the whole of what the pipeline adds
    PlantedBug("prediction_pipeline_send_left_out", '"tp8_pp2": 1e3 * (tp8 + send)', '"tp8_pp2": 1e3 * tp8'),
    PlantedBug("prediction_pipeline_for_throughput", 'return "tp16_infiniband", "tp8_replicas"',
               'return "tp16_infiniband", "tp8_pp2"'),
    # layer_shards
    PlantedBug("kv_heads_sharded_past_num_kv_heads", "    if tp_size <= num_kv_heads:\n", "    if True:\n"),
    PlantedBug("kv_head_replicas_round_robin", "first_kv = tp_rank // (tp_size // num_kv_heads)",
               "first_kv = tp_rank % num_kv_heads"),
    PlantedBug("o_proj_column_parallel", '"o_proj": (ROW, q)', '"o_proj": (COLUMN, q)'),
    # the MLP's kinds swapped: the all-reduce after the column-parallel half
    PlantedBug("mlp_row_and_column_swapped", '"gate_proj": (COLUMN, mlp), "up_proj": (COLUMN, mlp), "down_proj": (ROW, mlp)',
               '"gate_proj": (ROW, mlp), "up_proj": (ROW, mlp), "down_proj": (COLUMN, mlp)'),
    PlantedBug("q_split_by_heads_not_rows", "q = slice(tp_rank * per_q * head_dim, (tp_rank + 1) * per_q * head_dim)",
               "q = slice(tp_rank * per_q, (tp_rank + 1) * per_q)"),
    # row_parallel_forward
    PlantedBug("residual_on_every_rank", "residual if self.tp.is_first_rank else None", "residual"),
    PlantedBug("row_parallel_without_all_reduce", "    return self.tp.all_reduce(partial)\n", "    return partial\n"),
    # embedding_forward
    PlantedBug("embedding_mask_off_by_one_at_the_edge", "(input_ids < self.end)", "(input_ids <= self.end)"),
    PlantedBug("embedding_other_shards_not_zeroed", "self.tp.all_reduce(x.masked_fill_(~mine[:, None], 0.0))",
               "self.tp.all_reduce(x)"),
    # the right values, one all-reduce per token instead of one per batch: a latency per token
    PlantedBug("embedding_one_all_reduce_per_token", "    return self.tp.all_reduce(x.masked_fill_(~mine[:, None], 0.0))\n",
               "    x = x.masked_fill_(~mine[:, None], 0.0)\n"
               "    return torch.stack([self.tp.all_reduce(row) for row in x]) if len(x) else self.tp.all_reduce(x)\n"),
    # get_pp_indices
    PlantedBug("remainder_on_the_first_stages", "partitions[-i] += 1", "partitions[i - 2] += 1"),
    PlantedBug("remainder_on_the_last_stage", "range(2, num_layers % pp_size + 2)", "range(1, num_layers % pp_size + 1)"),
    # pipeline_schedule, bubble_fraction
    PlantedBug("bubble_m_over_m_plus_p", "return (num_stages - 1) / (num_microbatches + num_stages - 1)",
               "return num_microbatches / (num_microbatches + num_stages)"),
    # Megatron's bubble-time ratio (idle time over ideal time): another quantity than the idle share
    PlantedBug("bubble_relative_to_the_ideal_time", "return (num_stages - 1) / (num_microbatches + num_stages - 1)",
               "return (num_stages - 1) / num_microbatches"),
    PlantedBug("schedule_one_slot_short", "slots = num_microbatches + num_stages - 1",
               "slots = num_microbatches + num_stages - 2"),
    PlantedBug("zero_microbatches_accepted", "or value < 1:", "or value < 0:"),
    # interleaved_bubble: v left out (the plain schedule's bubble), or the idle share of section 6 divided by v
    PlantedBug("interleaved_bubble_ignores_chunks", "return (num_stages - 1) / (num_chunks * num_microbatches)",
               "return (num_stages - 1) / num_microbatches"),
    PlantedBug("interleaved_bubble_as_idle_share", "return (num_stages - 1) / (num_chunks * num_microbatches)",
               "return (num_stages - 1) / (num_chunks * num_microbatches + num_stages - 1)"),
    # the stage boundary: bf16's 2 bytes counted as saved; the kernels' launches left out of the cost
    PlantedBug("boundary_saves_both_bytes", "saved = elements * 1 / ETHERNET_BYTES_PER_S",
               "saved = elements * 2 / ETHERNET_BYTES_PER_S"),
    PlantedBug("boundary_cost_without_launches", "cost = 2 * KERNEL_LAUNCH_S + elements",
               "cost = elements"),
    # ZeRO: Adam's state as 8 B (m and v, the fp32 master forgotten); ZeRO-2 keeping whole gradients
    PlantedBug("zero_adam_state_without_master",
               '"ddp": 2 + 2 + 12, "zero1": 2 + 2 + 12 / n, "zero2": 2 + (2 + 12) / n, "zero3": (2 + 2 + 12) / n',
               '"ddp": 2 + 2 + 8, "zero1": 2 + 2 + 8 / n, "zero2": 2 + (2 + 8) / n, "zero3": (2 + 2 + 8) / n'),
    PlantedBug("zero2_gradients_not_sharded", '"zero2": 2 + (2 + 12) / n', '"zero2": 2 + 2 + 12 / n'),
    # FSDP traffic: one all-gather per step (forgetting the backward's), or the whole tensor per GPU
    PlantedBug("fsdp_one_all_gather", 'return {"all_gather": 2 * ring', 'return {"all_gather": ring'),
    # fsdp_shard / gather_layer
    PlantedBug("fsdp_shard_without_padding", "per_rank = -(-flat.numel() // world)", "per_rank = flat.numel() // world"),
    PlantedBug("fsdp_shard_strided", "return flat[rank * per_rank:(rank + 1) * per_rank].clone()",
               "return flat[rank::world].clone()"),
    PlantedBug("fsdp_rank_equal_world_accepted", "not 0 <= rank < world", "not 0 <= rank <= world"),
    PlantedBug("gather_layer_keeps_padding", "flat = torch.cat(shards)[:sum(sizes)]\n",
               "flat = torch.cat(shards)\n    sizes[-1] += flat.numel() - sum(sizes)\n"),
]
