"""Planted bugs for lab 01_kv_cache_math: slips a learner plausibly makes; each must fail a test."""
from grader.bugs import PlantedBug

BUGS = [
    # the interview article's slip: one factor of 2 too many
    PlantedBug("kv_counted_twice", "return 2 * spec.num_layers", "return 2 * 2 * spec.num_layers"),
    PlantedBug("kv_query_heads", "2 * spec.num_layers * spec.num_kv_heads * spec.head_dim",
               "2 * spec.num_layers * spec.num_attention_heads * spec.head_dim"),
    PlantedBug("kv_head_dim_from_hidden", "spec.head_dim * dtype_bytes(dtype)",
               "(spec.hidden_size // spec.num_attention_heads) * dtype_bytes(dtype)"),
    PlantedBug("embeddings_never_tied", "(1 if s.tie_word_embeddings else 2)", "2"),
    PlantedBug("moe_active_experts_only", "mlp = s.num_experts * mlp", "mlp = s.num_experts_per_tok * mlp"),
    PlantedBug("no_block_rounding", "tokens = math.ceil(context_len / block_size) * block_size", "tokens = context_len"),
    PlantedBug("decode_ignores_kv_reads", "bytes_read = weight_bytes(config, dtype) / tp + batch_size * context_len * kv_per_gpu",
               "bytes_read = weight_bytes(config, dtype) / tp"),
    PlantedBug("roofline_sum_not_max",
               "roofline = max(bytes_read / gpu.hbm_bytes_per_s, flops / gpu.bf16_flops)",
               "roofline = bytes_read / gpu.hbm_bytes_per_s + flops / gpu.bf16_flops"),
    PlantedBug("kv_heads_split_below_one", "* kv_heads_per_gpu(config, tp) // spec.num_kv_heads", "// tp"),
    PlantedBug("replicas_rounded_down", "replicas = math.ceil(requests_per_s / rate)",
               "replicas = max(1, int(requests_per_s / rate))"),
    PlantedBug("first_feasible_tp", "if best is None or tp * replicas < best.num_gpus:", "if best is None:"),
    PlantedBug("prefills_do_not_slow_decode", "tpot = step + batch / output_len * prefill", "tpot = step"),
    # the activation peak and the utilization budget
    PlantedBug("activations_counted_per_layer", "return num_tokens * per_token * max(2, dtype_bytes(dtype))",
               "return s.num_layers * num_tokens * per_token * max(2, dtype_bytes(dtype))"),
    PlantedBug("activations_in_fp8", "return num_tokens * per_token * max(2, dtype_bytes(dtype))",
               "return num_tokens * per_token * dtype_bytes(dtype)"),
    PlantedBug("activations_ignore_top_k", "experts = s.num_experts_per_tok if s.num_experts else 1", "experts = 1"),
    PlantedBug("budget_without_activations",
               "- activation_bytes(config, dtype, max_num_batched_tokens) - non_torch_bytes)", "- non_torch_bytes)"),
    # the alpha-beta all-reduce
    PlantedBug("allreduce_bandwidth_only", "one = gpu.allreduce_latency_s + 2 *", "one = 2 *"),
    PlantedBug("allreduce_latency_once_per_step", "return 2 * s.num_layers * one",
               "return 2 * s.num_layers * (one - gpu.allreduce_latency_s) + gpu.allreduce_latency_s"),
    PlantedBug("allreduce_once_per_layer", "return 2 * s.num_layers * one", "return s.num_layers * one"),
    # 4-bit GPTQ weights
    PlantedBug("int4_forgets_group_scales", "layer_int4 += groups * n * 2  # scales", "layer_int4 += 0  # scales"),
    PlantedBug("int4_zeros_in_fp16", "layer_int4 += groups * n // 2  # qzeros",
               "layer_int4 += groups * n * 2  # qzeros"),
    PlantedBug("int4_quantizes_embeddings", "return s.num_layers * layer_int4 + rest",
               "return s.num_layers * layer_int4 + rest // 4"),
    PlantedBug("int4_quantizes_the_router", "[(h, i), (h, i), (i, h)] * (s.num_experts or 1)",
               "[(h, i), (h, i), (i, h)] * (s.num_experts or 1) + [(h, s.num_experts)] * bool(s.num_experts)"),
    PlantedBug("prediction_int4_is_a_quarter", "return (int4 + rest) / (params * 2)", "return 0.25"),
    # the prediction
    PlantedBug("prediction_forgets_the_kv", "return (weights + kv) / 3.35e12 * 1e3", "return weights / 3.35e12 * 1e3"),
]
