"""Planted bugs for lab 15_fine_tune_to_serve: mistakes a learner makes, each caught by a graded test."""
from grader.bugs import PlantedBug

BUGS = [
    # full fine-tuning without the fp32 master copy (12 bytes a parameter)
    PlantedBug("adam_without_master_weights", "return 16 * total", "return 12 * total"),
    # LoRA counted as A only (r x in)
    PlantedBug("lora_a_only", "rank * (shapes[m][0] + shapes[m][1])", "rank * shapes[m][0]"),
    # QLoRA's base without its block scales
    PlantedBug("nf4_without_absmax", "linear // 2 + linear // NF4_BLOCK * 4 +", "linear // 2 +"),
    # GPUs rounded down (floor division)
    PlantedBug("gpus_rounded_down", "-(-training_memory_bytes(config, method) // gpu.memory_bytes)",
               "training_memory_bytes(config, method) // gpu.memory_bytes"),
    # prefix-tuning's keys only
    PlantedBug("prefix_keys_only", "return 2 * s.num_layers * s.num_kv_heads", "return s.num_layers * s.num_kv_heads"),
    # the expand's FLOPs forgotten
    PlantedBug("lora_flops_shrink_only", "extra = 2 * rank * (in_features + out_features)",
               "extra = 2 * rank * in_features"),
    # NF4 levels not normalized to [-1, 1]
    PlantedBug("nf4_levels_not_normalized", "return levels / levels.abs().max()", "return levels"),
    # absmax without the absolute value: a block whose largest magnitude is negative scales wrong
    PlantedBug("absmax_without_abs", "absmax = blocks.abs().amax(dim=1)", "absmax = blocks.amax(dim=1)"),
    # the nibbles in the other order
    PlantedBug("nibbles_swapped_in_quantize", "return (idx[0::2] << 4) | idx[1::2], absmax",
               "return (idx[1::2] << 4) | idx[0::2], absmax"),
    PlantedBug("nibbles_swapped_in_dequantize", "torch.stack([packed >> 4, packed & 0x0F], dim=-1)",
               "torch.stack([packed & 0x0F, packed >> 4], dim=-1)"),
    # one scale for the whole tensor instead of per block
    PlantedBug("per_tensor_absmax", "levels[idx] * absmax.float()[:, None]", "levels[idx] * absmax.float().max()"),
    # QLoRA's adapter without alpha / r
    PlantedBug("qlora_without_scaling", "F.linear(x, w) + scaling * F.linear(", "F.linear(x, w) + F.linear("),
    # the dequantized weight kept in fp32 under bf16 activations (the output dtype changes)
    PlantedBug("qlora_fp32_weight", "w = nf4_dequantize(packed, absmax, weight_shape, block_size, x.dtype)",
               "w = nf4_dequantize(packed, absmax, weight_shape, block_size)",
               more=(("return F.linear(x, w) + scaling", "return F.linear(x.float(), w) + scaling"),)),
    # alpha 0 accepted (the adapter would be a no-op)
    PlantedBug("alpha_zero_accepted", "or lora_alpha <= 0:", "or lora_alpha < 0:"),
    # a missing target module not refused
    PlantedBug("targets_not_checked", "if not targets or missing:", "if not targets:"),
    # the NaN check after the update: the weights are already garbage
    PlantedBug("nan_checked_after_the_step",
               "        if not torch.isfinite(loss):\n"
               "            raise FloatingPointError(f\"the loss is {loss.item()} at step {step}: the run diverged; "
               "lower \"\n"
               "                                     f\"learning_rate (got {lr})\")\n"
               "        optimizer.zero_grad()\n"
               "        loss.backward()\n"
               "        optimizer.step()\n",
               "        optimizer.zero_grad()\n"
               "        loss.backward()\n"
               "        optimizer.step()\n"
               "        if not torch.isfinite(loss):\n"
               "            raise FloatingPointError(f\"the loss is {loss.item()} at step {step}: the run diverged; "
               "lower \"\n"
               "                                     f\"learning_rate (got {lr})\")\n"),
    # gradients never zeroed: they accumulate over the steps
    PlantedBug("gradients_accumulate", "        optimizer.zero_grad()\n        loss.backward()",
               "        loss.backward()"),
    # packing without the separator
    PlantedBug("pack_without_eos", "stream += list(example) + [eos_id]", "stream += list(example)",
               more=(("positions += list(range(len(example) + 1))", "positions += list(range(len(example)))"),)),
    # positions that never restart
    PlantedBug("positions_never_restart", "positions += list(range(len(example) + 1))",
               "positions += list(range(len(positions), len(positions) + len(example) + 1))"),
    # RAG's passages prefilled as if no question preceded them... or followed: attention to the question forgotten
    PlantedBug("rag_passages_alone", "extra = prefill_flops(config, question_tokens + retrieved_tokens) - "
               "prefill_flops(config, question_tokens)", "extra = prefill_flops(config, retrieved_tokens)"),
    # the base's FLOPs without the LM head
    PlantedBug("overhead_without_lm_head",
               "s.num_layers * sum(i * o for i, o in shapes.values()) + s.vocab_size * s.hidden_size",
               "s.num_layers * sum(i * o for i, o in shapes.values())"),
    # each window's loss averaged, not each token's
    PlantedBug("perplexity_window_averaged", 'reduction="sum"', 'reduction="mean"',
               more=(("count += targets.numel()", "count += 1"),)),
    # the targets not shifted: each position scored on its own token
    PlantedBug("perplexity_unshifted", "targets = window[0, 1:]", "targets = window[0, :-1]"),
]
